"""The recipes end to end, as a user runs them: `python recipes/<name>.py overrides...`.

Each run is a real 2-process job under Lightning's subprocess launcher (except the benchmark,
whose multirun needs the spawn launcher).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import lit_dp_recipes as lit_dp_recipes
from tests.helpers.recipes import QUIET, ROOT, final_metrics, run_recipe

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
    output = run_recipe("gpt", "experiment=gpt_tiny", "trainer.enable_model_summary=false", f"hydra.run.dir={tmp_path}")
    lines = output.replace("\r", "\n").splitlines()
    bar = [line for line in lines if "step:" in line and "10/10" in line]
    assert bar and "loss=" in bar[-1] and "tokens/s=" in bar[-1], bar[-1:]  # steps out of trainer.max_steps=10
    # Once, from rank 0: the seed, the skipped TensorBoard logger, a deprecation inside Lightning.
    assert output.count("Seed set to 7") == 1 and "[rank: 1]" not in output
    assert output.count("logger.tensorboard skipped") <= 1
    assert output.count("isinstance(treespec, LeafSpec)") <= 1
    assert "sync_dist=True" not in output  # Lightning's advice on the recipe's own epoch-level logging
    assert "dynamo:" not in output and "dynamo_recompiles" not in output  # compile is off
    assert "[lit_dp] final " in (tmp_path / "gpt.log").read_text()
