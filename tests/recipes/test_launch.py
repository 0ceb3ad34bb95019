"""Hydra sweeps with Lightning's script launcher: each job's ranks run that job, in its folder, once."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import types

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lit_dp_recipes.config import register_configs
from lit_dp_recipes.launch import config_flags, rank_command
from tests.helpers.recipes import CONF, QUIET, ROOT


def test_a_sweep_jobs_ranks_run_that_job_alone_in_its_folder(tmp_path, monkeypatch):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("digits", overrides=["trainer.devices=3", "strategy=ddp"], return_hydra_config=True)
    with open_dict(cfg):  # what Hydra's launcher sets for job 1 of `-m trainer.devices=2,3 strategy=ddp`
        cfg.hydra.overrides.hydra = ["hydra.mode=MULTIRUN", "hydra.sweep.dir=multirun/x", "hydra.verbose=true"]
        cfg.hydra.runtime.output_dir = str(tmp_path / "multirun" / "1")
        cfg.hydra.runtime.cwd = str(tmp_path)  # where the user typed the command
    HydraConfig.instance().set_config(cfg)
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a script, not `python -m`
    try:
        command = rank_command(2, ["recipes/digits.py", "-m", "-cn", "digits", "trainer.devices=2,3", "strategy=ddp"])
    finally:
        HydraConfig.instance().cfg = None
    assert command[:5] == [sys.executable, str(tmp_path / "recipes" / "digits.py"), "-cn", "digits", "trainer.devices=3"]
    assert command[5:] == [
        "strategy=ddp", "hydra.verbose=true", "hydra.mode=RUN", f'hydra.run.dir="{tmp_path / "multirun" / "1"}"',
        "hydra.job.name=train_ddp_process_2", "hydra.output_subdir=null",
    ]


@pytest.mark.parametrize(("strategy", "answers"), [("paddle_dp", True), ("ddp", False)])
def test_the_job_launcher_binds_the_ranks_and_answers_stop_signals_outside_the_fit_as_the_strategy_does(strategy, answers):
    # Under Hydra every strategy's ranks are started by the job launcher, bound to it (lit_dp.job.orphans);
    # outside the fit it answers SIGTERM itself for lit_dp's strategy only: Lightning's DDP keeps its own handling.
    import lightning.pytorch as pl

    import lit_dp  # noqa: F401 - registers "paddle_dp"
    from lit_dp.strategies.preemption import BoundScriptLauncher
    from lit_dp_recipes.launch import JobScriptLauncher, use_job_launcher

    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        HydraConfig.instance().set_config(compose("digits", return_hydra_config=True))
    try:
        use_job_launcher(trainer.strategy)
    finally:
        HydraConfig.instance().cfg = None
    launcher = trainer.strategy.launcher
    assert type(launcher) is JobScriptLauncher and isinstance(launcher, BoundScriptLauncher)
    assert launcher.stops_outside_the_fit is answers


def test_config_flags_keep_the_config_choice_and_drop_the_sweep():
    assert config_flags(["-m", "--config-name=gpt", "a=1", "-cd", "/x", "--multirun", "b=1,2"]) == [
        "--config-name=gpt", "-cd", "/x"
    ]


@pytest.mark.slow
def test_a_sweep_over_devices_runs_each_job_once_with_its_ranks(tmp_path):
    # `trainer.devices=2,3` hung on its second job: the first had left LOCAL_RANK in the launching
    # process, so Lightning started no rank for it; and each rank re-ran the whole sweep.
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "digits.py"), "-m", "trainer.devices=2,3", *QUIET,
         "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("Launching 2 jobs") == 1
    assert output.count("[lit_dp] final ") == 2
    assert "world_size=2 " in output and "world_size=3 " in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no outputs/, no second multirun/
    for job, ranks in (("0", 2), ("1", 3)):
        folder = tmp_path / "sweep" / job
        logs = sorted(p.name for p in folder.glob("*.log"))
        assert logs == ["digits.log", *(f"train_ddp_process_{r}.log" for r in range(1, ranks))]
        # The [lit_dp] lines reach the job's log file too, not only the console.
        assert "[lit_dp] final " in (folder / "digits.log").read_text()
    assert output.count("Seed set to 7") == 2 and "[rank: 1] Seed set" not in output  # once a job, from rank 0


@pytest.mark.slow
def test_a_sweeps_job_on_one_device_leaves_no_group_and_its_resume_hint_resumes_it(tmp_path):
    # Issue 47: `-m trainer.devices=1,2` failed its second job on the first's group of one rank;
    # and each job's hint was the whole sweep's command line, which pasted started a new sweep.
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    short = [*QUIET, "trainer.limit_train_batches=4", "trainer.limit_val_batches=1", "~logger"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "digits.py"), "-m", "trainer.devices=1,2", "trainer.max_epochs=1",
         *short, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400, env=environ,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("[lit_dp] final ") == 2
    assert "0 buckets" not in output  # one rank communicates nothing: no comm figures to print
    hints = [line.removeprefix("[lit_dp] to resume this run: ") for line in output.splitlines()
             if line.startswith("[lit_dp] to resume this run: ")]
    command = shlex.split(hints[1])
    assert "-m" not in command and "trainer.devices=2" in command and "trainer.devices=1,2" not in command
    assert command[-1] == f"hydra.run.dir={tmp_path / 'sweep' / '1'}"
    resumed = subprocess.run([sys.executable, *command[1:], "trainer.max_epochs=2"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=400, env=environ)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert f"[lit_dp] resuming from {tmp_path / 'sweep' / '1' / 'checkpoints'}" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no new sweep, no outputs/
