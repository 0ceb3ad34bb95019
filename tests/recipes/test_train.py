"""The recipes end to end, as a user runs them: `python recipes/<name>.py overrides...`.

Each run is a real 2-process job under Lightning's subprocess launcher (except the benchmark,
whose multirun needs the spawn launcher).
"""

from __future__ import annotations

import importlib
import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import lit_dp_recipes as lit_dp_recipes
from tests.helpers.recipes import (
    QUIET,
    ROOT,
    compose_config,
    final_metrics,
    run_recipe,
    run_recipe_on_a_terminal,
    set_terminal_size,
)


@pytest.mark.slow
def test_digits_trains_to_95_percent_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    output = run_recipe("digits", *QUIET, "trainer.max_epochs=12", "strategy.comm_buffer_size=5", f"hydra.run.dir={run_dir}")
    summary = next(line for line in output.splitlines() if line.startswith("[lit_dp] strategy="))
    assert "backend=gloo world_size=2" in summary and "comm_buffer_size=5.0MB" in summary
    assert final_metrics(output)["val_acc"] >= 0.95
    # One folder for the run, shared by both ranks; Lightning's CSV log and checkpoints in it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert list(run_dir.glob("csv/version_*/metrics.csv"))

    resumed = run_recipe(
        "digits", *QUIET, "trainer.max_epochs=13", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        f"hydra.run.dir={tmp_path / 'resumed'}",
    )
    assert "Restoring states from the checkpoint path" in resumed
    assert final_metrics(resumed)["val_acc"] >= 0.95


@pytest.mark.slow
def test_under_ddp_a_named_hook_is_torchs_registered_on_cpu_too(tmp_path):
    # Lightning's DDPStrategy registers hooks on CUDA only: the peer would have run uncompressed.
    output = run_recipe("digits", *QUIET, "strategy=ddp", "strategy.comm_hook=powersgd", "strategy.powersgd.start_iter=2",
                        "strategy.comm_dtype=fp16", "trainer.max_epochs=1", "trainer.limit_train_batches=8",
                        "trainer.limit_val_batches=1", f"hydra.run.dir={tmp_path}")
    assert "ddp_comm_hook=fp16_compress_wrapper" in output
    assert "val_loss" in final_metrics(output)


def test_bad_override_fails_before_any_process_starts(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "digits.py"), "strategy.comm_buffer_size=-1", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "strategy.comm_buffer_size=-1 is invalid: expected a positive number of megabytes" in result.stderr
    assert "[lit_dp] strategy=" not in result.stdout
    assert not list(tmp_path.glob("train_ddp_process_*.log")), "a rank was started"


@pytest.mark.parametrize("path", sorted(Path(lit_dp_recipes.__file__).parent.glob("*.py")), ids=lambda p: p.stem)
def test_every_recipe_module_imports(path):
    # Recipe modules no test runs end to end must not rot: their imports at least are checked here.
    importlib.import_module(f"lit_dp_recipes.{path.stem}")


@pytest.mark.slow
def test_a_gpt_run_says_each_thing_once_and_its_bar_shows_steps_loss_and_tokens_per_second(tmp_path):
    output = run_recipe_on_a_terminal("gpt", "experiment=gpt_tiny", "trainer.enable_model_summary=false",
                                      f"hydra.run.dir={tmp_path}")
    lines = output.replace("\r", "\n").splitlines()
    bar = [line for line in lines if "step:" in line and "10/10" in line]
    assert bar and "loss=" in bar[-1] and "tokens/s=" in bar[-1], bar[-1:]  # steps out of trainer.max_steps=10
    # Once, from rank 0: the seed; never: the skipped TensorBoard logger, a deprecation inside Lightning, its tips.
    assert output.count("Seed set to 7") == 1 and "[rank: 1]" not in output
    assert "logger.tensorboard skipped" not in output and "LeafSpec" not in output and "Tip:" not in output
    assert "sync_dist=True" not in output  # Lightning's advice on the recipe's own epoch-level logging
    assert "dynamo:" not in output and "dynamo_recompiles" not in output  # compile is off
    assert "[lit_dp] final " in (tmp_path / "gpt.log").read_text()


# --- What a run prints (issue 47; docs/conventions.md: every line true, short, worth reading) ---------


@pytest.mark.parametrize("stdout", ["terminal", "unsized terminal", "pipe"])
def test_a_progress_bar_is_drawn_where_it_is_seen_and_a_line_per_validation_elsewhere(stdout, tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import ProgressBar

    from lit_dp_recipes import train as train_module
    from lit_dp_recipes.callbacks import ProgressLines, StepProgressBar

    # Lightning's bar writes to standard output: what it is decides, whatever standard error is. A
    # terminal of no width (`script` without a terminal) showed nothing from tqdm for the whole run.
    with output_stream(stdout) as stream:
        monkeypatch.setattr(sys, "stdout", stream)
        bar = stdout == "terminal"
        for recipe in ("digits", "gpt"):
            cfg = compose_config(recipe, [], tmp_path)
            callbacks = train_module._callbacks(cfg)
            assert train_module._progress_bar(cfg) is bar
            assert any(isinstance(c, ProgressBar) for c in callbacks) is (bar and recipe == "gpt")  # digits: Lightning's own
            assert any(isinstance(c, ProgressLines) for c in callbacks) is not bar
            if recipe == "gpt" and not bar:
                assert not any(isinstance(c, StepProgressBar) for c in callbacks)
        switched_off = compose_config("digits", ["trainer.enable_progress_bar=false"], tmp_path)
        assert not any(isinstance(c, (ProgressBar, ProgressLines)) for c in train_module._callbacks(switched_off))


@contextmanager
def output_stream(kind: str) -> Iterator[Any]:
    """A writable text stream on a pseudo-terminal 120 columns wide, on one of no width, or on a pipe."""
    if kind == "pipe":
        reading, writing = os.pipe()
    else:
        reading, writing = pty.openpty()
        set_terminal_size(writing, 120 if kind == "terminal" else 0)
    stream = os.fdopen(writing, "w")
    try:
        yield stream
    finally:
        stream.close()
        os.close(reading)


def test_lightnings_tips_and_its_torch_deprecation_are_left_out(caplog):
    import logging
    import warnings

    from lit_dp_recipes import train as train_module

    train_module._quiet_lightning()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        train_module._quiet_lightning()  # as train() does, after any filter of the caller's
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`", FutureWarning)
    assert not caught
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        logger.info("\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud logging and experiment tracking, try installing ...")
        logger.info("`Trainer.fit` stopped: `max_epochs=3` reached.")
    assert [r.getMessage() for r in caplog.records] == ["`Trainer.fit` stopped: `max_epochs=3` reached."]


def test_the_start_up_line_shows_what_differs_from_the_defaults():
    import lightning.pytorch as pl

    from lit_dp import PaddleDPStrategy
    from lit_dp_recipes.callbacks import describe_strategy

    lines = {}
    for name, options in {"default": {}, "set": {"comm_buffer_size": 5, "local_sgd_steps": 4}}.items():
        strategy = PaddleDPStrategy(**options)
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # sets the devices the line reads
        lines[name] = describe_strategy(strategy, 2)
    assert lines["default"] == "strategy=paddle_dp backend=gloo world_size=2 devices=['cpu', 'cpu']"
    assert lines["set"] == lines["default"] + " comm_buffer_size=5.0MB local_sgd.steps=4"


def test_a_run_too_short_to_validate_by_val_check_interval_validates_at_its_last_step(tmp_path, capsys):
    from lit_dp_recipes import train as train_module

    cfg = compose_config("gpt", ["trainer.max_steps=30"], tmp_path)  # val_check_interval: 100
    train_module._validate_by_the_last_step(cfg)
    assert cfg.trainer.val_check_interval == 30
    assert "[lit_dp] validating at step 30, the last (trainer.max_steps=30 < trainer.val_check_interval=100)" in capsys.readouterr().out
    for unchanged in (["trainer.max_steps=300"], ["trainer.max_steps=-1"], ["trainer.max_steps=30", "trainer.val_check_interval=0.5"]):
        cfg = compose_config("gpt", unchanged, tmp_path)
        before = cfg.trainer.val_check_interval
        train_module._validate_by_the_last_step(cfg)
        assert cfg.trainer.val_check_interval == before


def test_a_fit_with_nothing_left_to_do_says_why_instead_of_an_empty_final_line():
    from types import SimpleNamespace

    from lit_dp_recipes import train as train_module

    trainer = SimpleNamespace(max_steps=-1, max_epochs=3, global_step=69, current_epoch=3)
    assert train_module._final_line(trainer, {"val_acc": 0.9}) == "final val_acc=0.9000"
    assert train_module._final_line(trainer, {}) == (
        "final: nothing trained: the checkpoint resumed is at step 69, epoch 3, where trainer.max_epochs=3 already "
        "stopped it; raise it to train on, or pass ckpt_path=null to start over"
    )


@pytest.mark.slow
def test_a_run_piped_to_a_file_reads_well_and_its_rerun_says_there_is_nothing_left(tmp_path):
    run = ["trainer.max_epochs=2", "trainer.limit_val_batches=2", "trainer.enable_model_summary=false",
           f"hydra.run.dir={tmp_path}"]
    output = run_recipe("digits", *run)  # a pipe, as `> log 2>&1`
    assert "\r" not in output and len(output) < 4000, output
    for noise in ("LeafSpec", "Tip:", "tensorboard skipped", "no window completed", "Error executing job"):
        assert noise not in output, noise
    lines = output.splitlines()
    assert all(len(line) < 300 for line in lines if line.startswith("[lit_dp] ")), output
    progress = [line for line in lines if re.match(r"\[lit_dp\] epoch \d, step \d+: .*val_acc=", line)]
    assert len(progress) == 2, output
    assert re.search(r"^\[lit_dp\] straggler: no rank lagged in \d+ windows? of 10 steps$|^\[lit_dp\] straggler: \d+ of ",
                     output, re.M), output
    rerun = run_recipe("digits", *run)  # the same folder: a finished run
    final = next(line for line in rerun.splitlines() if line.startswith("[lit_dp] final"))
    assert final.startswith("[lit_dp] final: nothing trained: the checkpoint resumed is at step "), final


@pytest.mark.slow
@pytest.mark.parametrize("columns", [120, 0], ids=["sized", "unsized"])
def test_a_terminal_shows_progress_a_bar_where_it_reports_a_width_else_a_line_per_epoch(columns, tmp_path):
    output = run_recipe_on_a_terminal("digits", "trainer.max_epochs=2", "trainer.enable_model_summary=false",
                                      f"hydra.run.dir={tmp_path}", columns=columns)
    lines = output.replace("\r", "\n").splitlines()
    epochs = [line for line in lines if re.match(r"\[lit_dp\] epoch \d, step \d+: train_loss=.* val_acc=.* \([\d.]+ steps/s\)$", line)]
    if columns:
        assert "Epoch 1: 100%" in output and not epochs, output[-3000:]
    else:  # tqdm draws nothing there: the lines a pipe gets
        assert len(epochs) == 2 and "%|" not in output, output


@pytest.mark.slow
def test_a_gpt_run_shorter_than_its_validation_interval_ends_with_val_loss(tmp_path):
    output = run_recipe("gpt", "experiment=gpt_tiny", "trainer.max_steps=4", "trainer.val_check_interval=100",
                        "trainer.enable_model_summary=false", f"hydra.run.dir={tmp_path}")
    assert "[lit_dp] validating at step 4, the last" in output
    assert "val_loss" in final_metrics(output), output[-2000:]
