"""The one declaration of the options: validated once where they enter, the same at every front
door, spelt by group, and reaching every surface generated from it."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch.nn.parallel import DistributedDataParallel

from lit_dp import DataParallel, Options, PaddleDPStrategy, fabric
from lit_dp.options import FABRIC, MODULE, TRAINER, ShardingOptions, TraceOptions, declared_options
from lit_dp.options.core import DEFAULT_HANG_TIMEOUT
from lit_dp.options.docs import MARKER, options_markdown
from lit_dp.strategies.base import DataParallelStrategyMixin

EXPECTED_SIZE = "expected a positive number of megabytes or 'auto'"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "options.md"


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
        ("sharding_stage", 3, r"sharding_stage=3 is invalid: expected 1 \(optimizer states\)"),
        ("trace", {"steps": [2, 2]}, r"trace.steps=\[2, 2\] is invalid: expected two integers"),
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
        ({"trace": {"steps": [3, 1]}}, "strategy.trace.steps=[3, 1] is invalid: expected two integers (start, stop)"),
        ({"comm_stats": "yes"}, "strategy.comm_stats='yes' is invalid: expected True or False"),
        ({"local_sgd": {"adaptive": True}}, "strategy.local_sgd.adaptive=True needs strategy.local_sgd.steps"),
    ],
)
def test_a_config_names_the_option_by_its_key(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Options.build(options, TRAINER, prefix="strategy.", nested=True)


@pytest.mark.parametrize(
    ("scope", "given", "message"),
    [
        (TRAINER, {"comm_bufer_size": 5}, "comm_bufer_size=5 is not an option of lit_dp.PaddleDPStrategy. Did you mean 'comm_buffer_size'?"),
        (TRAINER, {"trace": {"dri": "x"}}, "trace.dri='x' is not an option of lit_dp.PaddleDPStrategy. Did you mean 'trace.dir'?"),
        (FABRIC, {"uneven_inputs": True}, "uneven_inputs=True is not an option of lit_dp.fabric.PaddleDPStrategy: ranks with different numbers of batches train inside `with fabric.strategy.join(model):`"),
        (FABRIC, {"local_sgd": {"steps": 4, "adaptive": True}}, "local_sgd.adaptive=True is not an option of lit_dp.fabric.PaddleDPStrategy: the adaptive period needs each step's loss"),
        (MODULE, {"model_averaging_period": 4}, "model_averaging_period=4 is not an option of lit_dp.DataParallel: build lit_dp.LocalSGD(model, local_steps, ...)"),
        (MODULE, {"backend": "gloo"}, "backend='gloo' is not an option of lit_dp.DataParallel"),
        (TRAINER, {"bucket_cap_mb": 5, "comm_buffer_size": 5}, "bucket_cap_mb=5 and comm_buffer_size=5 are the same option"),
        (TRAINER, {"trace_dir": "a", "trace": {"dir": "b"}}, "trace_dir='a' and trace.dir='b' are the same option (trace.dir)"),
        (TRAINER, {"sharding": 2}, "sharding=2 is invalid: expected a mapping of its options (stage, overlap) or their dataclass"),
    ],
)
def test_unknown_misplaced_and_doubled_options_are_named(scope, given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Options.build(given, scope)


@pytest.mark.parametrize(
    ("key", "value", "meant"),
    [
        ("trace_dir", "x", "strategy.trace.dir"),
        ("local_sgd_steps", 4, "strategy.local_sgd.steps"),
        ("powersgd_start_iter", 50, "strategy.powersgd.start_iter"),
        ("model_averaging_period", 4, "strategy.local_sgd.steps"),
        ("bucket_cap_mb", 5, "strategy.comm_buffer_size"),
    ],
)
def test_a_config_refuses_keyword_spellings_naming_its_key(key, value, meant):
    # A config spells groups as nodes; the keyword (or Lightning's) spelling fails naming the key to use.
    with pytest.raises(ValueError, match=re.escape(f"strategy.{key}={value!r} is not an option of lit_dp.PaddleDPStrategy. Did you mean '{meant}'?")):
        Options.build({key: value}, TRAINER, prefix="strategy.", nested=True)


def test_a_group_is_given_whole_or_by_keyword_with_the_same_result():
    by_keyword = Options.build({"trace_dir": "t", "trace_steps": [0, 2], "sharding_stage": 1}, TRAINER)
    as_mapping = Options.build({"trace": {"dir": "t", "steps": (0, 2)}, "sharding": {"stage": 1}}, TRAINER)
    as_dataclass = Options.build({"trace": TraceOptions(dir="t", steps=[0, 2]), "sharding": ShardingOptions(stage=1)}, TRAINER)
    assert by_keyword == as_mapping == as_dataclass
    assert by_keyword.trace == TraceOptions(dir="t", steps=(0, 2)) and by_keyword.sharding.stage == 1
    # A dataclass given whole is validated like the rest: nothing enters unchecked.
    with pytest.raises(ValueError, match="sharding.stage=7 is invalid"):
        Options.build({"sharding": ShardingOptions(stage=7)}, MODULE)


def test_lightning_names_and_hydra_integers_arrive_as_ours():
    options = Options.build(
        {"bucket_cap_mb": 5, "process_group_backend": "GLOO", "trace_dir": "t", "trace_steps": [0, 2], "model_averaging_period": 3},
        TRAINER,
    )
    assert (options.comm_buffer_size, options.backend, options.trace.steps) == (5.0, "gloo", (0, 2))
    assert options.local_sgd.steps == 3 and isinstance(options.comm_buffer_size, float)


def test_combination_errors_name_the_options_as_written():
    with pytest.raises(ValueError, match=re.escape("sharding.stage=1 with local_sgd_steps=4 is invalid")):
        Options.build({"sharding": {"stage": 1}, "local_sgd_steps": 4}, TRAINER)
    with pytest.raises(ValueError, match=re.escape("sharding_overlap=True needs sharding_stage: expected sharding_stage=1 or 2")):
        Options.build({"sharding_overlap": True}, TRAINER)


def test_every_option_is_declared_with_its_help_check_and_front_doors():
    for declared in declared_options():
        meta = declared.field.metadata
        assert meta["help"] and callable(meta["check"]) and meta["scope"], declared.path
        default = declared.field.default
        assert meta["check"](declared.path, default) == default, f"{declared.path}: its default must pass its own check"


def test_front_doors_list_no_options_of_their_own():
    # The strategies take Lightning's own arguments and the declared options; nothing is retyped:
    # one constructor is written for both, and each shows the options of its front door, generated
    # from the declarations (lit_dp.options.signature), and its Lightning base's name for the precision.
    lightning = ["accelerator", "parallel_devices", "cluster_environment", "checkpoint_io"]
    assert _written_parameters(DataParallelStrategyMixin.__init__) == ["self", *lightning, "precision", "options", "values"]
    for strategy, scope, lightning_arguments in (
        (PaddleDPStrategy, TRAINER, [*lightning, "precision_plugin"]),
        (fabric.PaddleDPStrategy, FABRIC, [*lightning, "precision"]),
    ):
        generated = [declared.keyword for declared in declared_options(scope)]
        assert list(inspect.signature(strategy.__init__).parameters) == ["self", *lightning_arguments, "options", *generated, "values"]
    # DataParallel's own arguments are torch DDP's, in DDP's order (so positional calls move over),
    # plus lit_dp's name for the group, the options' doors and a torchft Manager (docs/fault_tolerance.md).
    # DDP's arguments of torch releases after the lowest one lit_dp allows are taken on that one too.
    later_ddp = {"bucket_cap_mb_list", "forward_sync_buffers", "batched_grad_copy"}
    ours = _written_parameters(DataParallel.__init__)
    ddp = list(inspect.signature(DistributedDataParallel.__init__).parameters)
    assert [name for name in ours if name in ddp] == ddp
    assert set(ours) - set(ddp) - later_ddp == {"group", "options", "manager", "option_values"}
    assert {d.path for d in declared_options(MODULE)} <= {d.path for d in declared_options(TRAINER)}


def _written_parameters(init) -> list[str]:
    """The parameters ``init``'s code names (its signature also lists the generated options)."""
    code = init.__code__
    return list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + 1])


def every_option() -> list[tuple[str, dataclasses.Field, str | None]]:
    """``(path, field, named hook)`` of every option, walked from the dataclasses themselves (not
    from ``declared_options``, which the generated surfaces use): what those must all show."""
    found = []
    for field in dataclasses.fields(Options):
        if field.name == "hooks":
            for hook, hook_options in Options().hooks.items():
                found += [(f"{hook}.{member.name}", member, hook) for member in dataclasses.fields(hook_options)]
        elif field.metadata.get("derived"):
            continue  # not an option (hang_timeout_given)
        elif field.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(field.default_factory):
            found += [(f"{field.name}.{member.name}", member, None) for member in dataclasses.fields(field.default_factory)]
        else:
            found.append((field.name, field, None))
    return found


def _start_up_line(**values) -> str:
    strategy = PaddleDPStrategy(**values)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # sets the devices describe() reads
    return strategy.describe()


def test_every_option_reaches_every_generated_surface():
    """Adding a field anywhere (to Options, a group or a named hook's options) shows up in the
    docs, the docstrings, the start-up line and both spellings of build; leaving it out of one fails here."""
    docs = DOCS.read_text()
    line = _start_up_line().split()
    docstrings = {TRAINER: PaddleDPStrategy.__doc__, FABRIC: fabric.PaddleDPStrategy.__doc__, MODULE: DataParallel.__doc__}
    for path, field, hook in every_option():
        assert f"| `{path}` |" in docs, f"{path} is missing from docs/options.md"
        for scope, docstring in docstrings.items():
            if hook is not None or scope in field.metadata["scope"]:
                assert f"        {path}" in docstring, f"{path} is missing from the {scope} front door's docstring"
        if hook is not None:
            described = _start_up_line(comm_hook=hook)
            assert f"{field.name}=" in described, f"{path} is missing from comm_hook={hook}'s description: {described}"
        else:
            shown_as = field.metadata["shown_by"] or path
            assert any(word.startswith(f"{shown_as}=") for word in line), f"{path} is missing from describe(): {line}"
        owner, _, member = path.rpartition(".")
        default = field.default
        nested = {owner: {member: default}} if owner else {path: default}
        # hang_timeout="auto" is resolved as the options are built (300 s, or half a shorter timeout).
        built = DEFAULT_HANG_TIMEOUT if path == "hang_timeout" else default
        assert Options.build(nested, TRAINER, nested=True).value(path) == built, path
        assert Options.build({path.replace(".", "_"): default}, TRAINER).value(path) == built, path


def test_the_options_page_is_generated_from_the_declaration():
    generated = DOCS.read_text().partition(MARKER)[2]
    assert generated == options_markdown(), "regenerate docs/options.md: python -m lit_dp.options.docs"
