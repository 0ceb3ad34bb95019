"""lit_dp configured through LightningCLI, with Lightning's BoringModel, as a DDPStrategy user would:
the string form (``--trainer.strategy=paddle_dp`` with options as flags or ``init_args``), the
``class_path`` form with types checked before any rank starts, ``--print_config`` and the help."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.strategies import DDPStrategy

from lit_dp import PaddleDPStrategy, fabric
from lit_dp.options import TRAINER, declared_options
from lit_dp.strategies import registered_names
from lit_dp.strategies.registered_names import named_classes
from tests.helpers.lightning import REGISTERED

ROOT = Path(__file__).resolve().parents[2]
CPU = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false"]


def cli(arguments: list[str]) -> LightningCLI:
    """The CLI parsed and instantiated, nothing run: no process starts."""
    return LightningCLI(BoringModel, BoringDataModule, run=False, args=[*CPU, *arguments], save_config_callback=None)


def printed_config(arguments: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as stop:
        LightningCLI(BoringModel, BoringDataModule, run=False, args=[*CPU, *arguments, "--print_config"])
    assert stop.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def write(path: Path, config: dict) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def strategy_config(class_path: str, **init_args) -> dict:
    return {"trainer": {"strategy": {"class_path": class_path, "init_args": init_args}}}


def test_the_class_path_form_takes_the_options_as_ddp_strategys_takes_its_own(tmp_path):
    ours = cli(["--config", write(tmp_path / "ours.yaml", strategy_config("lit_dp.PaddleDPStrategy", comm_buffer_size=5, sharding_stage=1))])
    theirs = cli(["--config", write(tmp_path / "ddp.yaml", strategy_config("lightning.pytorch.strategies.DDPStrategy", bucket_cap_mb=5))])
    strategy = ours.trainer.strategy
    assert type(strategy) is PaddleDPStrategy and isinstance(theirs.trainer.strategy, DDPStrategy)
    assert (strategy.options.comm_buffer_size, strategy.options.sharding.stage) == (5.0, 1)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("--trainer.strategy.find_unused_parameters=maybe", "find_unused_parameters"),  # jsonargparse: not a bool
        ("--trainer.strategy.sharding_stage=one", "sharding_stage"),  # jsonargparse: not an Optional[int]
        ("--trainer.strategy.nrings=9", re.escape("nrings=9 is invalid: expected an integer in [1, 8]")),  # Options.build
    ],
)
def test_the_class_path_form_checks_types_and_values_before_any_rank_starts(given, expected, capsys):
    # jsonargparse refuses a wrong type as it parses; Options.build a wrong value as the strategy is built.
    with pytest.raises((SystemExit, ValueError)) as raised:
        cli(["--trainer.strategy=lit_dp.PaddleDPStrategy", given])
    assert re.search(expected, capsys.readouterr().err + str(raised.value))


@pytest.mark.slow  # end to end: the script run as a user runs it; the refusal itself is checked in process above
def test_the_documented_scripts_refusal_of_a_value_is_one_line(tmp_path):
    command = [sys.executable, "-m", "lit_dp_recipes.lightning_cli", "fit", "--trainer.strategy=paddle_dp"]
    command += ["--trainer.strategy.comm_buffer_size=-1", *CPU, "--trainer.max_steps=1"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=environment)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: trainer.strategy.comm_buffer_size=-1.0 is invalid: expected a positive number of megabytes or 'auto'."
    )


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (
            ["--trainer.strategy=paddle_dp", "--trainer.strategy.comm_bufer_size=5"],
            "error: trainer.strategy.comm_bufer_size is not an option of paddle_dp: did you mean "
            "trainer.strategy.comm_buffer_size or trainer.strategy.last_comm_buffer_size? (docs/options.md lists them all)",
        ),
        (
            ["--trainer.strategy=lit_dp.PaddleDPStrategy", "--trainer.strategy.init_args.local_sgd_step", "4"],
            "error: trainer.strategy.local_sgd_step is not an option of lit_dp.PaddleDPStrategy: did you mean "
            "trainer.strategy.local_sgd_steps or trainer.strategy.local_sgd_outer or "
            "trainer.strategy.local_sgd_warmup_steps? (docs/options.md lists them all)",
        ),
        (
            ["--trainer.strategy=paddle_dp_spawn", "--trainer.strategy.zzz=1"],
            "error: trainer.strategy.zzz is not an option of paddle_dp_spawn (docs/options.md lists them all)",
        ),
    ],
)
def test_a_misspelt_strategy_option_is_one_line_naming_the_near_ones(arguments, expected, monkeypatch):
    from lit_dp_recipes import lightning_cli

    monkeypatch.setattr(sys, "argv", ["lightning_cli", "fit", *arguments])
    with pytest.raises(SystemExit) as exited:
        lightning_cli.main()
    assert exited.value.code == expected


def test_another_strategys_options_are_left_to_jsonargparse():
    from lit_dp_recipes.lightning_cli import strategy_option_mistake

    assert strategy_option_mistake(["--trainer.strategy=ddp", "--trainer.strategy.comm_bufer_size=5"]) is None
    assert strategy_option_mistake(["--trainer.strategy=paddle_dp", "--trainer.strategy.comm_buffer_size=5"]) is None


def test_the_string_form_takes_options_as_flags_or_init_args(tmp_path):
    assert cli(["--trainer.strategy=paddle_dp"]).trainer.strategy.options.comm_buffer_size == 25.0  # the registry's
    flags = cli(["--trainer.strategy=paddle_dp_spawn", "--trainer.strategy.comm_buffer_size=5"]).trainer.strategy
    assert isinstance(flags, PaddleDPStrategy) and type(flags).__name__ == "paddle_dp_spawn"
    assert (flags.options.comm_buffer_size, flags.options.start_method) == (5.0, "spawn")  # the name's own defaults kept
    config = {"trainer": {"strategy": {"class_path": "paddle_dp", "init_args": {"sharding_stage": 1}}}}
    init_args = cli(["--config", write(tmp_path / "string.yaml", config)]).trainer.strategy
    assert (type(init_args).__name__, init_args.options.sharding.stage) == ("paddle_dp", 1)


def test_each_registered_name_has_a_class_with_that_names_arguments():
    assert set(named_classes()) == set(REGISTERED)
    for name, (start_method, find_unused) in REGISTERED.items():
        strategy = getattr(registered_names, name)(comm_buffer_size=5)
        assert (strategy.options.start_method, strategy.options.find_unused_parameters) == (start_method, find_unused)
        # Spawned ranks get the strategy pickled: its class is found again by its import path.
        copy = pickle.loads(pickle.dumps(strategy))
        assert type(copy) is type(strategy) and copy.options == strategy.options


@pytest.mark.parametrize(
    "arguments",
    [
        ["--trainer.strategy=lit_dp.PaddleDPStrategy", "--trainer.strategy.comm_buffer_size=5", "--trainer.strategy.straggler_every_n_steps=5"],
        ["--trainer.strategy=paddle_dp_fork", "--trainer.strategy.sharding_stage=1"],
    ],
    ids=["class_path", "string"],
)
def test_print_config_round_trips(arguments, tmp_path, capsys):
    printed = printed_config(arguments, capsys)
    again = printed_config(["--config", write(tmp_path / "printed.yaml", printed)], capsys)
    assert again["trainer"]["strategy"] == printed["trainer"]["strategy"]
    keywords = {declared.keyword for declared in declared_options(TRAINER)}
    assert keywords <= set(printed["trainer"]["strategy"]["init_args"])
    rebuilt = cli(["--config", str(tmp_path / "printed.yaml")]).trainer.strategy
    original = cli(arguments).trainer.strategy
    assert rebuilt.options == original.options and type(rebuilt) is type(original)


def test_the_strategys_help_lists_every_option_with_its_help(capsys):
    with pytest.raises(SystemExit):
        LightningCLI(BoringModel, BoringDataModule, run=False, args=["--trainer.strategy.help", "lit_dp.PaddleDPStrategy"])
    shown = " ".join(capsys.readouterr().out.split())  # unwrapped
    for declared in declared_options(TRAINER):
        assert f"--trainer.strategy.{declared.keyword} " in shown, declared.path
        assert " ".join(declared.field.metadata["help"].split()) in shown, declared.path


def test_the_fabric_strategy_is_a_class_path_too():
    from jsonargparse import ArgumentParser
    from lightning.fabric.strategies import Strategy

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=Strategy)
    config = parser.parse_args(['--strategy={"class_path": "lit_dp.fabric.PaddleDPStrategy", "init_args": {"comm_buffer_size": 5}}'])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # the name before jsonargparse 4.49
    strategy = instantiate(config).strategy
    assert type(strategy) is fabric.PaddleDPStrategy and strategy.options.comm_buffer_size == 5.0


def test_lit_dp_fabric_is_a_module_in_a_fresh_process():
    # Imported before Lightning and before lit_dp itself, as a user's first line may do.
    code = (
        "from lit_dp.fabric import PaddleDPStrategy; import lit_dp, lit_dp.fabric, lightning.fabric as lf; "
        "assert lit_dp.fabric.PaddleDPStrategy is PaddleDPStrategy; "
        "assert type(lf.Fabric(strategy='paddle_dp', accelerator='cpu', devices=1).strategy) is PaddleDPStrategy"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "strategy",
    [
        ["--trainer.strategy=paddle_dp", "--trainer.strategy.comm_buffer_size=5", "--trainer.strategy.trace_dir=trace"],
        ["--trainer.strategy=lit_dp.PaddleDPStrategy", "--trainer.strategy.init_args.trace_dir=trace"],
    ],
    ids=["string", "class_path"],
)
def test_a_two_rank_fit_through_lightning_cli(strategy, tmp_path):
    command = [sys.executable, "-m", "lit_dp_recipes.lightning_cli", "fit", *strategy, *CPU, "--trainer.max_steps=3",
               "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    # Each rank's lit_dp.DataParallel traced its communication where the command line said.
    assert sorted(path.name for path in (tmp_path / "trace").glob("rank*.json")) == ["rank0.json", "rank1.json"], output[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in output, output[-4000:]


def test_the_checkpoint_format_and_asynchronous_saves_are_flags_as_under_fsdp():
    # Issue 51: Lightning's FSDPStrategy's name for the format, as LightningCLI users type it there.
    strategy = cli(["--trainer.strategy=paddle_dp", "--trainer.strategy.state_dict_type=sharded",
                    "--trainer.strategy.async_save=true"]).trainer.strategy  # fmt: skip
    assert (strategy.options.state_dict_type, strategy.options.async_save) == ("sharded", True)
