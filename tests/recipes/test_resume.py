"""Recipes that resume by themselves: run folders per job, ckpt_path=auto, the restart limit.

The torchrun tests run the digits recipe as a user would, with rank 1 killed once mid-epoch
(``lit_dp_recipes.faults.KillRankOnce``), and compare with one uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir

from lit_dp.job.restart import JobAttempt
from lit_dp_recipes.resume import (
    RESUMABLE_KEYS,
    check_checkpoint_every_n_steps,
    last_attempt_report,
    newest_checkpoint,
    resolve_ckpt_path,
)
from lit_dp_recipes.train import train
from tests.helpers.recipes import CONF, QUIET, ROOT, compose_config, model_metrics

TORCHRUN_TIMEOUT = 300  # two attempts of a 2-process job on a loaded 2-core machine


def _checkpoint(path: Path, step: int, **extra) -> Path:
    content = {key: {} for key in RESUMABLE_KEYS} | {"global_step": step, "epoch": 0} | extra
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(content, path)
    return path


def test_a_half_written_checkpoint_is_never_picked(tmp_path):
    complete = _checkpoint(tmp_path / "checkpoints" / "step-10.ckpt", 10)
    newer = _checkpoint(tmp_path / "scratch.ckpt", 20, weights=torch.zeros(10_000))
    # What a rank dying mid-write leaves with a non-atomic writer: the newest step, truncated.
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(newer.read_bytes()[: newer.stat().st_size // 2])
    newer.unlink()
    # ... and with AtomicCheckpointIO: a partial file under a name no `*.ckpt` pattern matches.
    (tmp_path / "checkpoints" / ".last.ckpt.partial-123").write_bytes(b"\0" * 100)
    # A weights-only checkpoint cannot resume a fit either.
    weights_only = tmp_path / "checkpoints" / "weights.ckpt"
    torch.save({"state_dict": {}, "global_step": 30}, weights_only)

    newest = newest_checkpoint([tmp_path, tmp_path / "checkpoints"])
    assert newest is not None and newest.path == complete.resolve() and newest.step == 10


def test_ckpt_path_auto_null_and_explicit(tmp_path, capsys):
    folders = [tmp_path]
    first = JobAttempt()
    restart = JobAttempt.from_environ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"})
    assert resolve_ckpt_path("auto", folders, first) is None  # nothing yet: from scratch, silently
    assert resolve_ckpt_path("auto", folders, restart) is None
    assert "[lit_dp] restart 1 of 3, but no complete checkpoint in" in capsys.readouterr().out

    last = _checkpoint(tmp_path / "last.ckpt", 40)
    _checkpoint(tmp_path / "epoch=0-step=23.ckpt", 23)
    assert resolve_ckpt_path("auto", folders, restart) == str(last.resolve())
    assert f"[lit_dp] resuming from {last.resolve()} (step 40, restart 1 of 3)" in capsys.readouterr().out
    assert resolve_ckpt_path("auto", folders, first) == str(last.resolve())
    assert "(step 40, a checkpoint of this job is already in its folder)" in capsys.readouterr().out
    assert resolve_ckpt_path(None, folders, restart) is None
    assert resolve_ckpt_path("elsewhere.ckpt", folders, restart) == "elsewhere.ckpt"


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


def test_the_last_attempts_failure_names_the_checkpoint_to_resume_from(tmp_path):
    _checkpoint(tmp_path / "last.ckpt", 40)
    last = JobAttempt.from_environ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "2"})
    with pytest.raises(RuntimeError) as error, last_attempt_report([tmp_path], last):
        raise ValueError("rank 1 died")
    message = str(error.value)
    assert message.startswith("[lit_dp] restart 2 of 2 failed, and the launcher allows no more restarts: ValueError: rank 1 died")
    assert f"would have resumed from {(tmp_path / 'last.ckpt').resolve()} (step 40)" in message
    # Not the last attempt: the launcher restarts the job, the error passes unchanged.
    with pytest.raises(ValueError, match="^rank 1 died$"), last_attempt_report([tmp_path], JobAttempt()):
        raise ValueError("rank 1 died")


class _Requeued(Exception):
    pass


class _SlurmRequeueAt(pl.Callback):
    """SLURM's warning signal at ``step`` (Lightning saves hpc_ckpt_N.ckpt and calls scontrol requeue),
    then the job ends, as when SLURM stops it for the requeue."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)
            raise _Requeued


def _slurm_environ(restart: int) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": str(restart), "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "digits", "SLURM_NODELIST": "localhost",
        "PATH": os.environ["PATH"],  # Lightning calls `scontrol requeue` (absent here: it logs a warning)
    }


@pytest.mark.slow
def test_slurm_requeue_resumes_from_lightnings_hpc_checkpoint_in_the_same_folder(tmp_path, capsys):
    folder = tmp_path / "outputs" / "digits" / "slurm-4242"
    overrides = [*QUIET, "trainer.devices=1", "trainer.max_epochs=1", "trainer.limit_val_batches=1",
                 "checkpoint_every_n_steps=1000", "~logger", f"paths.output_dir={folder}"]
    with mock.patch.dict(os.environ, _slurm_environ(0)):
        cfg = compose_config("digits", [*overrides, "+callbacks.requeue._target_=" + __name__ + "._SlurmRequeueAt",
                                        "+callbacks.requeue.step=6"], tmp_path)
        with pytest.raises(_Requeued):
            train(cfg)
    assert (folder / "hpc_ckpt_1.ckpt").is_file()
    with mock.patch.dict(os.environ, _slurm_environ(1)):
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


# The torchrun runs: as short as a mid-epoch kill allows (digits: 23 steps an epoch on 2 ranks).
RUN = [*QUIET, "trainer.max_epochs=2", "trainer.limit_val_batches=2", "checkpoint_every_n_steps=5", "~logger"]
KILL = ["+callbacks.kill._target_=lit_dp_recipes.faults.KillRankOnce", "+callbacks.kill.step=30"]


def _torchrun(*overrides: str, cwd: Path, max_restarts: int = 1) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={max_restarts}", str(ROOT / "recipes" / "digits.py"), *overrides]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    output = _torchrun(*RUN, f"hydra.run.dir={run_dir}", cwd=run_dir, max_restarts=0)
    return model_metrics(output), torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


def _assert_resumed_exactly(output: str, run_dir: Path, uninterrupted) -> None:
    metrics, weights = uninterrupted
    assert "[lit_dp] fault: rank 1 killed after step 30" in output
    assert f"[lit_dp] resuming from {run_dir / 'checkpoints' / 'last.ckpt'} (step 30, restart 1 of 1)" in output
    assert "[lit_dp] epoch 1 continues at batch 7" in output
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
