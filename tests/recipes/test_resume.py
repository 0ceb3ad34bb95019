"""Recipes that resume by themselves: run folders per job, ckpt_path=auto, damaged checkpoints,
reruns of the same command, the messages that say where things are, the restart limit.

The torchrun tests run the digits recipe as a user would, with rank 1 killed once mid-epoch
(``lit_dp_recipes.faults.KillRankOnce``), and compare with one uninterrupted run; the others run
``python recipes/digits.py`` from a fresh working directory, with real truncated files.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lit_dp.job.restart import JobAttempt
from lit_dp.strategies.preemption import Preempted
from lit_dp_recipes.cli import CommandLineMistake
from lit_dp_recipes.config import check_checkpoint_every_n_steps, register_configs
from lit_dp_recipes.resume import (
    FINISHED_MARKER,
    RESUMABLE_KEYS,
    NoUsableCheckpoint,
    ResumableRun,
    choose_checkpoint,
    earlier_run,
    newest_checkpoint,
)
from lit_dp_recipes.train import train
from tests.helpers.recipes import CONF, QUIET, ROOT, compose_config, model_metrics, torchrun_recipe

TORCHRUN_TIMEOUT = 300  # two attempts of a 2-process job on a loaded 2-core machine
RECIPE_TIMEOUT = 240


def _checkpoint(path: Path, step: int, **extra) -> Path:
    content = {key: {} for key in RESUMABLE_KEYS} | {"global_step": step, "epoch": 0} | extra
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(content, path)
    return path


def _truncate(path: Path) -> None:
    """What a crash or a full disk leaves behind a non-atomic writer: the first half of the file."""
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_good_one(tmp_path):
    folder = tmp_path / "checkpoints"
    previous = _checkpoint(folder / "step=10.ckpt", 10)
    newest = _checkpoint(folder / "step=20.ckpt", 20, weights=torch.zeros(10_000))
    _truncate(newest)
    (folder / "last.ckpt").symlink_to("step=20.ckpt")  # save_last: link, pointing at the damaged one
    (folder / "empty.ckpt").write_bytes(b"")
    # ... and with AtomicCheckpointIO: a partial file under a name no `*.ckpt` pattern matches.
    (folder / ".last.ckpt.partial-123").write_bytes(b"\0" * 100)
    torch.save({"state_dict": {}, "global_step": 30}, folder / "weights.ckpt")  # cannot resume a fit
    os.utime(previous, (1, 1))  # the others are newer

    chosen, skipped = choose_checkpoint([tmp_path, folder])
    assert chosen is not None and chosen.path == previous.resolve() and chosen.step == 10
    reasons = {u.path.name: u.reason for u in skipped}
    assert reasons.keys() == {"step=20.ckpt", "empty.ckpt", "weights.ckpt"}  # the link is its target, once
    assert reasons["step=20.ckpt"].startswith("damaged: ") and "truncated" in reasons["step=20.ckpt"]
    assert reasons["empty.ckpt"] == "damaged: empty"
    assert reasons["weights.ckpt"] == "cannot resume a fit: no optimizer_states, loops, epoch (saved with weights only?)"
    assert newest_checkpoint([folder]) == chosen


def test_no_good_checkpoint_stops_before_any_work_naming_each_file(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (5, 10):
        _truncate(_checkpoint(folder / f"step={step}.ckpt", step, weights=torch.zeros(1000)))
    with pytest.raises(NoUsableCheckpoint) as error:
        choose_checkpoint([tmp_path, folder])
    message = str(error.value)
    assert message.startswith(f"ckpt_path=auto: no checkpoint in {tmp_path}, {folder} can resume this run: ")
    for step in (5, 10):
        assert f"{folder / f'step={step}.ckpt'} (damaged: " in message
    assert "pass ckpt_path=<a good checkpoint> to resume from one kept elsewhere, or ckpt_path=null" in message
    assert choose_checkpoint([tmp_path / "nothing-here"]) == (None, [])


def _resumable_run(folder: Path, attempt: JobAttempt) -> ResumableRun:
    return ResumableRun(compose_config("digits", [], folder), attempt)


def test_a_restarted_replica_group_without_a_checkpoint_says_it_recovers_from_a_peer(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    restart = JobAttempt.from_environ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"})
    run = ResumableRun(compose_config("gpt", ["strategy.fault_tolerance=torchft"], tmp_path), restart)
    assert run.resolve("auto") is None
    out = capsys.readouterr().out
    assert "[lit_dp] restart 1 of 3: this replica group takes a peer's state at its first quorum" in out
    assert "starting from scratch" not in out


def test_ckpt_path_auto_null_and_explicit(tmp_path, capsys):
    first = JobAttempt()
    restart = JobAttempt.from_environ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"})
    run, restarted = _resumable_run(tmp_path, first), _resumable_run(tmp_path, restart)
    assert run.resolve("auto") is None  # nothing yet: from scratch, silently
    assert restarted.resolve("auto") is None
    assert "[lit_dp] restart 1 of 3, but no checkpoint in" in capsys.readouterr().out

    last = _checkpoint(tmp_path / "checkpoints" / "last.ckpt", 40)
    _checkpoint(tmp_path / "checkpoints" / "epoch=0-step=23.ckpt", 23)
    assert restarted.resolve("auto") == str(last.resolve())
    assert f"[lit_dp] resuming from {last.resolve()} (step 40, restart 1 of 3)" in capsys.readouterr().out
    assert run.resolve("auto") == str(last.resolve())
    assert "(step 40, a checkpoint of this run is already in its folder)" in capsys.readouterr().out
    assert restarted.resolve(None) is None
    assert restarted.resolve("elsewhere.ckpt") == "elsewhere.ckpt"
    _truncate(last)
    assert run.resolve("auto") == str((tmp_path / "checkpoints" / "epoch=0-step=23.ckpt").resolve())
    out = capsys.readouterr().out
    assert f"(step 23, a checkpoint of this run is already in its folder); skipped, newer but unusable: {last.resolve()} (damaged: " in out


def test_a_rerun_continues_the_newest_unfinished_run_of_the_same_command(tmp_path):
    task = tmp_path / "outputs" / "digits"

    def run_folder(name: str, overrides: list[str], steps: tuple[int, ...] = (), finished: bool = False) -> Path:
        folder = task / name
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        for step in steps:
            _checkpoint(folder / "checkpoints" / f"step={step}.ckpt", step)
        if finished:
            (folder / FINISHED_MARKER).touch()
        os.utime(folder / ".hydra" / "overrides.yaml", (len(list(task.iterdir())),) * 2)  # started in this order
        return folder

    # An interpolation in an override is recorded as typed, and compared so, never resolved.
    same = ["trainer.devices=2", "seed=3", "strategy.trace.dir=${paths.output_dir}/trace"]
    run_folder("a", same, steps=(5,))
    finished = run_folder("b", same, steps=(9,), finished=True)
    unfinished = run_folder("c", [*reversed(same), "ckpt_path=auto"], steps=(4, 8))  # the same command
    run_folder("d", same)  # started, and failed before any checkpoint
    run_folder("e", ["trainer.devices=3", "seed=3"], steps=(11,))  # another command
    current = run_folder("f", same)
    folders = [current, current / "checkpoints"]

    found = earlier_run(current, same, folders)
    assert found is not None and found.folder == unfinished
    assert found.folders == [unfinished, unfinished / "checkpoints"]
    assert choose_checkpoint(found.folders)[0].step == 8
    (unfinished / FINISHED_MARKER).touch()  # it finished after all: nothing before it is continued
    assert earlier_run(current, same, folders) is None
    assert finished.is_dir() and earlier_run(current, ["seed=4"], folders) is None


@pytest.mark.parametrize("bad", [0, -5, 2.5, "10", True])
def test_checkpoint_every_n_steps_is_checked(bad):
    with pytest.raises(ValueError, match=f"checkpoint_every_n_steps={bad!r} is invalid: expected a positive number"):
        check_checkpoint_every_n_steps(bad)
    assert check_checkpoint_every_n_steps(None) is None


def _run_dir(environ: dict[str, str], *overrides: str) -> str:
    with mock.patch.dict(os.environ, environ, clear=True), initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="digits", overrides=list(overrides), return_hydra_config=True).hydra.run.dir


def test_run_folder_survives_restarts_and_requeues():
    compose_config("digits", [], Path("unused"))  # registers the schemas and the resolver
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2"}
    assert _run_dir(slurm) == _run_dir({**slurm, "SLURM_RESTART_COUNT": "3"}) == "outputs/digits/slurm-4242"
    torchrun = {"TORCHELASTIC_RUN_ID": "a1b2", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert _run_dir(torchrun) == _run_dir({**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"}) == "outputs/digits/torchrun-a1b2"
    assert _run_dir({**torchrun, **slurm}) == "outputs/digits/slurm-4242"  # torchrun inside a SLURM job
    assert _run_dir({"PADDLE_JOB_ID": "resnet"}) == "outputs/digits/paddle-resnet"
    # Outside a launcher (or with torchrun's shared default run id): a time-stamped folder, as before.
    for environ in ({}, {"TORCHELASTIC_RUN_ID": "none"}):
        assert _run_dir(environ).startswith("outputs/digits/20")
    assert _run_dir(slurm, "hydra.run.dir=mine") == "mine"
    with pytest.raises(Exception, match="SLURM_JOB_ID='1 2' is invalid"):
        _run_dir({"SLURM_JOB_ID": "1 2"})


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    # Sharing one would make the second run's ckpt_path=auto resume the first's checkpoints as its
    # own (a GPT-2 small run loaded a byte-level model's: size mismatch for tokens.weight).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)  # restored afterwards
    compose_config("digits", [], Path("unused"))  # registers the schemas and the resolver
    with mock.patch.dict(os.environ, {}, clear=True), initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        configs = [compose(config_name="digits", overrides=["hydra.run.dir=${lit_dp.job_folder:stamp,runs}"],
                           return_hydra_config=True) for _ in range(3)]
        folders = []
        for cfg in configs:
            HydraConfig.instance().set_config(cfg)  # as Hydra's run_job does: a run claims its folder
            folders.append(cfg.hydra.run.dir)
            # Lightning resolves it again to start ranks 1..: the folder claimed, not the next free one.
            assert HydraConfig.get().run.dir == folders[-1]
    assert folders == ["stamp", "stamp_1", "stamp_2"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == folders


def test_the_last_attempts_failure_names_the_checkpoint_to_resume_from(tmp_path, capsys):
    last_ckpt = _checkpoint(tmp_path / "checkpoints" / "last.ckpt", 40).resolve()
    last = JobAttempt.from_environ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "2"})
    with pytest.raises(RuntimeError) as error, _resumable_run(tmp_path, last).fitting(None):
        raise ValueError("rank 1 died")
    message = str(error.value)
    assert message.startswith("[lit_dp] restart 2 of 2 failed, and the launcher allows no more restarts: ValueError: rank 1 died")
    assert f"\na rerun with ckpt_path=auto in {tmp_path.resolve()} resumes from {last_ckpt} (step 40)" in message
    assert "the run stopped" not in capsys.readouterr().out  # said once, in the error
    # Not the last attempt: the launcher restarts the job, the error passes unchanged, rank 0 says where a rerun resumes.
    with pytest.raises(ValueError, match="^rank 1 died$"), _resumable_run(tmp_path, JobAttempt()).fitting(None):
        raise ValueError("rank 1 died")
    out = capsys.readouterr().out
    assert "[lit_dp] the run stopped: ValueError: rank 1 died\n" in out
    assert f"[lit_dp] a rerun with ckpt_path=auto in {tmp_path.resolve()} resumes from {last_ckpt} (step 40)\n" in out


class _SignalAt(pl.Callback):
    """``signum`` to this process after optimizer step ``step``: a scheduler's warning, a real signal."""

    def __init__(self, step: int, signum: int = signal.SIGUSR1) -> None:
        self.step = step
        self.signum = signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _slurm_environ(restart: int, bin_dir: Path) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": str(restart), "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "digits", "SLURM_NODELIST": "localhost",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",  # our `scontrol`, which records the requeue
    }


@pytest.mark.slow
def test_slurm_requeue_resumes_from_lightnings_hpc_checkpoint_in_the_same_folder(tmp_path, capsys):
    bin_dir, requeues = tmp_path / "bin", tmp_path / "requeues.txt"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {requeues}\n')
    (bin_dir / "scontrol").chmod(0o755)
    folder = tmp_path / "outputs" / "digits" / "slurm-4242"
    overrides = [*QUIET, "trainer.devices=1", "trainer.max_epochs=1", "trainer.limit_val_batches=1",
                 "checkpoint_every_n_steps=1000", "~logger", f"paths.output_dir={folder}"]
    with mock.patch.dict(os.environ, _slurm_environ(0, bin_dir)):
        cfg = compose_config("digits", [*overrides, f"+callbacks.requeue._target_={__name__}._SignalAt",
                                        "+callbacks.requeue.step=6"], tmp_path)
        with pytest.raises(Preempted) as stop:
            train(cfg)
    assert stop.value.code == 128 + signal.SIGUSR1 and stop.value.step == 6
    assert stop.value.checkpoint == str(folder / "hpc_ckpt_1.ckpt")
    assert torch.load(folder / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"] == 6
    assert requeues.read_text() == "requeue 4242\n"  # Lightning's own requeue, called at the agreed step
    out = capsys.readouterr().out
    assert f"[lit_dp] SIGUSR1 received by rank 0: every rank stopped after step 6, checkpoint {folder / 'hpc_ckpt_1.ckpt'}" in out
    with mock.patch.dict(os.environ, _slurm_environ(1, bin_dir)):
        train(compose_config("digits", overrides, tmp_path))
    assert f"[lit_dp] resuming from {folder / 'hpc_ckpt_1.ckpt'} (step 6, SLURM requeue 1)" in capsys.readouterr().out


def test_ckpt_path_null_starts_fresh_even_when_checkpoints_exist(tmp_path, capsys):
    overrides = [*QUIET, "trainer.devices=1", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
                 "trainer.limit_val_batches=1", "~logger"]
    train(compose_config("digits", overrides, tmp_path))
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    capsys.readouterr()
    train(compose_config("digits", [*overrides, "ckpt_path=null"], tmp_path))
    assert "resuming from" not in capsys.readouterr().out
    train(compose_config("digits", [*overrides, "trainer.max_epochs=2"], tmp_path))  # auto, the default
    assert f"[lit_dp] resuming from {tmp_path / 'checkpoints' / 'last.ckpt'} (step 4," in capsys.readouterr().out


def test_a_resume_does_not_warn_that_the_checkpoints_it_resumes_from_exist(tmp_path):
    overrides = [*QUIET, "trainer.devices=1", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
                 "trainer.limit_val_batches=1", "~logger"]
    train(compose_config("digits", overrides, tmp_path))
    for more, warned in (["trainer.max_epochs=2"], False), (["ckpt_path=null"], True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(compose_config("digits", [*overrides, *more], tmp_path))
        assert any("exists and is not empty" in str(w.message) for w in caught) == warned, (more, caught)


@pytest.mark.parametrize("mode", ["RUN", "MULTIRUN"])
def test_the_resume_hint_of_a_sweeps_job_continues_that_job_alone(mode, tmp_path, monkeypatch):
    # Issue 47: each job of `-m trainer.devices=2,3` printed the whole sweep's command line, which
    # pasted started a new sweep instead of resuming the job.
    folder = tmp_path / "multirun" / "digits" / "stamp" / "1"
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("digits", overrides=["trainer.devices=3", "seed=3"], return_hydra_config=True)
    with open_dict(cfg):  # what Hydra's launcher sets for job 1 of the sweep
        cfg.hydra.mode = mode
        cfg.hydra.overrides.hydra = ["hydra.sweep.dir=multirun/x", "hydra.verbose=true"] if mode == "MULTIRUN" else []
        cfg.hydra.runtime.output_dir = str(folder)
        cfg.paths.output_dir = str(folder)
    monkeypatch.setattr(sys, "argv", ["recipes/digits.py", "-m", "trainer.devices=2,3", "seed=3", "ckpt_path=auto"]
                        if mode == "MULTIRUN" else ["recipes/digits.py", "trainer.devices=3", "seed=3"])
    HydraConfig.instance().set_config(cfg)
    try:
        command = ResumableRun(cfg).command
    finally:
        HydraConfig.instance().cfg = None
    verbose = ["hydra.verbose=true"] if mode == "MULTIRUN" else []
    assert shlex.split(command) == [
        "python", "recipes/digits.py", "trainer.devices=3", "seed=3", *verbose, f"hydra.run.dir={folder}"
    ]


def _digits(cwd: Path, *overrides: str) -> tuple[int, str]:
    """``python recipes/digits.py overrides...`` run from ``cwd``: its exit status and output."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "digits.py"), *overrides], cwd=cwd, capture_output=True, text=True,
        timeout=RECIPE_TIMEOUT, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr


def _resume_command(output: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.startswith("[lit_dp] to resume this run: "))
    return shlex.split(line.removeprefix("[lit_dp] to resume this run: "))


@pytest.mark.slow
def test_a_truncated_last_checkpoint_falls_back_by_name_and_none_good_stops_the_run(tmp_path):
    # One process, 12 steps, a checkpoint every 4: step=8.ckpt, step=12.ckpt, and last.ckpt (step 12, at the fit's end).
    status, output = _digits(tmp_path, *QUIET, "~logger", "trainer.devices=1", "trainer.max_steps=12",
                             "checkpoint_every_n_steps=4")
    assert status == 0, output[-4000:]
    command = _resume_command(output)  # what rank 0 printed at the start
    [folder] = (tmp_path / "outputs" / "digits").iterdir()
    checkpoints = folder / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step=12.ckpt", "step=8.ckpt"]
    for name in ("last.ckpt", "step=12.ckpt"):  # the newest two, as a crash while writing both would leave them
        _truncate(checkpoints / name)

    # The printed command, run as printed but for two more steps, resumes from the previous good checkpoint.
    assert command[:2] == ["python", str(ROOT / "recipes" / "digits.py")] and command[-1] == f"hydra.run.dir={folder}"
    status, output = _digits(tmp_path, *command[2:], "trainer.max_steps=14")
    assert status == 0, output[-4000:]
    resumed = next(line for line in output.splitlines() if line.startswith("[lit_dp] resuming from "))
    assert resumed.startswith(
        f"[lit_dp] resuming from {checkpoints / 'step=8.ckpt'} (step 8, a checkpoint of this run is already in its "
        "folder); skipped, newer but unusable: "
    )
    for name in ("last.ckpt", "step=12.ckpt"):
        assert f"{checkpoints / name} (damaged: " in resumed
    assert torch.load(checkpoints / "step=12.ckpt", weights_only=False)["global_step"] == 12  # written again, whole

    for path in checkpoints.glob("*.ckpt"):
        _truncate(path)
    before = {path.name: path.read_bytes() for path in checkpoints.glob("*.ckpt")}
    status, output = _digits(tmp_path, *command[2:], "trainer.max_steps=14")
    assert status == 1
    assert f"error: ckpt_path=auto: no checkpoint in {folder}, {checkpoints} can resume this run: " in output
    for name in before:
        assert f"{checkpoints / name} (damaged: " in output
    assert before == {path.name: path.read_bytes() for path in checkpoints.glob("*.ckpt")}  # left as they were
    assert "Traceback" not in output  # refused in one line


# The torchrun runs: as short as a mid-epoch kill allows (digits: 23 steps an epoch on 2 ranks).
RUN = [*QUIET, "trainer.max_epochs=2", "trainer.limit_val_batches=2", "checkpoint_every_n_steps=5", "~logger"]
KILL = ["+callbacks.kill._target_=lit_dp_recipes.faults.KillRankOnce", "+callbacks.kill.step=30"]


def _torchrun(*overrides: str, cwd: Path, max_restarts: int = 1) -> str:
    return torchrun_recipe("digits", *overrides, cwd=cwd, max_restarts=max_restarts, timeout=TORCHRUN_TIMEOUT)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    output = _torchrun(*RUN, f"hydra.run.dir={run_dir}", cwd=run_dir, max_restarts=0)
    return model_metrics(output), torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


def _assert_resumed_exactly(output: str, run_dir: Path, uninterrupted) -> None:
    metrics, weights = uninterrupted
    assert "[lit_dp] fault: rank 1 killed after step 30" in output
    # The step-30 checkpoint is not written: rank 1 dies before the checkpoint callback's agreement on it.
    assert f"[lit_dp] resuming from {run_dir / 'checkpoints' / 'step=25.ckpt'} (step 25, restart 1 of 1)" in output
    assert "[lit_dp] epoch 1 continues at batch 2" in output
    assert model_metrics(output) == metrics
    resumed = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(resumed[name], weights[name]) for name in weights)


@pytest.mark.slow
def test_torchrun_restart_resumes_exactly_in_the_explicit_run_dir(tmp_path, uninterrupted):
    output = _torchrun(*RUN, *KILL, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    _assert_resumed_exactly(output, (tmp_path / "run").resolve(), uninterrupted)


@pytest.mark.slow
def test_torchrun_restart_resumes_exactly_in_the_default_run_folder(tmp_path, uninterrupted):
    output = _torchrun(*RUN, *KILL, cwd=tmp_path)
    [run_dir] = (tmp_path / "outputs" / "digits").iterdir()  # one folder for both attempts
    assert run_dir.name.startswith("torchrun-")
    _assert_resumed_exactly(output, run_dir, uninterrupted)


def test_a_sharded_run_resumes_from_its_folder_and_a_lower_max_epochs_is_one_line(tmp_path, capsys):
    # Issue 51: strategy.state_dict_type=sharded writes each checkpoint as a folder, which ckpt_path=auto finds;
    # a finished run's folder rerun with fewer epochs is refused in one line, not Lightning's traceback; a resume
    # the recipe arranged prints neither of Lightning's warnings about the run it resumes.
    overrides = [*QUIET, "trainer.devices=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1", "~logger",
                 "strategy.state_dict_type=sharded"]  # fmt: skip
    train(compose_config("digits", [*overrides, "trainer.max_epochs=2", "checkpoint_every_n_steps=2"], tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / "meta.pt").is_file()
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Another step checkpoint's period: Lightning would say "Be aware ..." of the one in the checkpoint.
        train(compose_config("digits", [*overrides, "trainer.max_epochs=3", "checkpoint_every_n_steps=3"], tmp_path))
    assert f"[lit_dp] resuming from {last} (step 8, a checkpoint of this run is already in its folder)" in capsys.readouterr().out
    lightnings = [str(w.message) for w in caught if "dirpath has changed" in str(w.message) or "Be aware" in str(w.message)]
    assert lightnings == []
    with pytest.raises(CommandLineMistake) as refused:
        train(compose_config("digits", [*overrides, "trainer.max_epochs=1"], tmp_path))
    newest = newest_checkpoint([tmp_path, tmp_path / "checkpoints"])
    assert newest is not None and newest.path.is_dir() and newest.epoch > 1
    assert str(refused.value) == (
        f"trainer.max_epochs=1 is below the checkpoint this run resumes, {newest.path}, which completed {newest.epoch} "
        f"epochs (step 12): raise trainer.max_epochs above {newest.epoch} to train on from there, or pass ckpt_path=null "
        "to start over in this folder "
        "(hydra.run.dir=<another folder> keeps it)."
    )
