"""The one declaration of the options: validated once where they enter, the same at every front door."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from lit_dp import DataParallel, Options, PaddleDPStrategy, fabric
from lit_dp.options import FABRIC, MODULE, TRAINER, option_fields, options_markdown

EXPECTED_SIZE = "expected a positive number of megabytes or 'auto'"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "options.md"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("comm_buffer_size", -1, "comm_buffer_size=-1 is invalid: expected a positive number of megabytes"),
        ("last_comm_buffer_size", 0, "last_comm_buffer_size=0 is invalid"),
        ("backend", "nope", "backend='nope' is invalid: expected 'auto', a backend torch.distributed reports"),
        ("nrings", 9, r"nrings=9 is invalid: expected an integer in \[1, 8\]"),
        ("timeout", -3, "timeout=-3 is invalid: expected a positive duration"),
        ("start_method", "thread", "start_method='thread' is invalid"),
        ("find_unused_parameters", "yes", "find_unused_parameters='yes' is invalid: expected True or False"),
    ],
)
def test_the_trainer_strategy_validates_each_option(option, value, message):
    with pytest.raises(ValueError, match=message):
        PaddleDPStrategy(**{option: value})


def test_the_fabric_strategy_and_data_parallel_validate_the_same_way():
    with pytest.raises(ValueError, match="comm_buffer_size=0 is invalid"):
        fabric.PaddleDPStrategy(comm_buffer_size=0)
    with pytest.raises(ValueError, match="backend='nope' is invalid: expected 'auto', a backend"):
        fabric.PaddleDPStrategy(backend="nope")
    with pytest.raises(ValueError, match="last_comm_buffer_size=-1 is invalid"):
        DataParallel(None, last_comm_buffer_size=-1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"comm_buffer_size": "fast"}, f"strategy.comm_buffer_size='fast' is invalid: {EXPECTED_SIZE}"),
        ({"comm_buffer_size": 0}, f"strategy.comm_buffer_size=0 is invalid: {EXPECTED_SIZE}"),
        ({"trace_steps": [3, 1]}, "strategy.trace_steps=[3, 1] is invalid: expected two integers (start, stop)"),
        ({"comm_stats": "yes"}, "strategy.comm_stats='yes' is invalid: expected True or False"),
    ],
)
def test_a_prefix_names_the_option_as_a_config_key(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Options.build(options, "trainer", prefix="strategy.")


@pytest.mark.parametrize(
    ("scope", "given", "message"),
    [
        (TRAINER, {"comm_bufer_size": 5}, "comm_bufer_size=5 is not an option of lit_dp.PaddleDPStrategy. Did you mean 'comm_buffer_size'?"),
        (FABRIC, {"local_sgd_steps": 4}, "local_sgd_steps=4 is not an option of lit_dp.fabric.PaddleDPStrategy"),
        (MODULE, {"backend": "gloo"}, "backend='gloo' is not an option of lit_dp.DataParallel"),
        (TRAINER, {"bucket_cap_mb": 5, "comm_buffer_size": 5}, "bucket_cap_mb=5 and comm_buffer_size=5 are the same option"),
    ],
)
def test_unknown_misplaced_and_doubled_options_are_named(scope, given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Options.build(given, scope)


def test_lightning_names_and_hydra_integers_arrive_as_ours():
    options = Options.build({"bucket_cap_mb": 5, "process_group_backend": "GLOO", "trace_steps": [0, 2]}, TRAINER)
    assert (options.comm_buffer_size, options.backend, options.trace_steps) == (5.0, "gloo", (0, 2))
    assert isinstance(options.comm_buffer_size, float)


def test_every_option_is_declared_with_its_help_check_and_front_doors():
    for field in dataclasses.fields(Options):
        meta = field.metadata
        assert meta["help"] and callable(meta["check"]) and meta["scope"], field.name
        default = field.default
        assert meta["check"](field.name, default) == default, f"{field.name}: its default must pass its own check"


def test_front_doors_list_no_options_of_their_own():
    # The strategies take Lightning's own arguments and the declared options; nothing is retyped.
    for strategy, lightning_arguments in (
        (PaddleDPStrategy, {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}),
        (fabric.PaddleDPStrategy, {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision"}),
    ):
        parameters = set(inspect.signature(strategy.__init__).parameters) - {"self"}
        assert parameters == lightning_arguments | {"options", "values"}, strategy
    assert set(inspect.signature(DataParallel.__init__).parameters) == {
        "self", "layers", "group", "options", "unused_parameters_message", "manager", "init_sync", "option_values"
    }
    assert {f.name for f in option_fields(MODULE)} <= {f.name for f in option_fields(TRAINER)}


def test_the_options_page_is_generated_from_the_declaration():
    assert DOCS.read_text() == options_markdown(), "regenerate docs/options.md with lit_dp.options.options_markdown()"
