"""The hang watchdog under the Trainer, as users launch it: a rank stuck in ``training_step`` ends
the whole job, naming the rank with its file and line, and no process of the job is left, under
Lightning's own launcher and under torchrun; rank 0's checkpoint writes and a rank-0-only
evaluation are not hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lit_dp
from lit_dp.observability.watchdog import HANG_DIRECTORY
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO
from tests.helpers.distributed import run_ranks
from tests.helpers.jobs import alive_after, kill_session
from tests.helpers.lightning import Regressor, trainer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "stuck_fit.py"
# The contract (issue 27): every process of the job has exited within 60 s of the hang, with
# hang_timeout=10. The protocol needs about 16 s (10 s deadline, the answers, a 5 s grace for
# the stuck rank's main thread), 21 s measured on this 2-core machine under a load of 6
# processes per core; the rest is the margin for the Trainer's teardown and the interpreters'
# exits on a loaded machine.
ENDS_WITHIN = 60.0


def _stuck_line() -> int:
    return next(number for number, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "time.sleep(3600)" in line)


def _run_stuck_fit(command: list[str], root: Path) -> str:
    """Run the stuck fit to its end; check that its whole job ended in time; return its output."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environ = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    with open(root / "output.txt", "w") as output:
        launcher = subprocess.Popen(
            command, cwd=root, stdout=output, stderr=subprocess.STDOUT, env=environ, start_new_session=True
        )
        try:
            launcher.wait(timeout=300)  # start-up on a loaded machine, then the hang, then the end
            pids = [launcher.pid, *(int(path.name) for path in (root / "pids").iterdir())]
            left = alive_after(pids, 120)
            all_gone = time.time()
        finally:
            kill_session(launcher)
    text = (root / "output.txt").read_text()
    assert launcher.returncode != 0, text[-3000:]
    assert not left, f"processes {left} of the job outlived it:\n{text[-3000:]}"
    hang_started = float((root / "hang_started").read_text())
    assert all_gone - hang_started < ENDS_WITHIN, f"the job ended {all_gone - hang_started:.0f}s after the hang"
    return text


def _assert_names_the_stuck_rank(output: str, root: Path) -> None:
    assert "CollectiveHangError" in output, output[-3000:]
    assert "rank 1 never launched bucket" in output, output[-3000:]
    where = f"{SCRIPT}:{_stuck_line()} in training_step"
    assert f"outside lit_dp's collectives (data loading or user code); at {where}" in output, output[-3000:]
    stack = (root / HANG_DIRECTORY / "rank1.txt").read_text()  # in the run's log directory (default_root_dir)
    assert f'File "{SCRIPT}", line {_stuck_line()} in training_step' in stack, stack


@pytest.mark.slow
def test_under_lightnings_launcher_a_stuck_child_rank_is_named_and_no_process_is_left(tmp_path):
    # `python script.py`: rank 0 is the script, Lightning's _SubprocessScriptLauncher starts rank 1 as its child.
    output = _run_stuck_fit([sys.executable, str(SCRIPT), str(tmp_path)], tmp_path)
    _assert_names_the_stuck_rank(output, tmp_path)


@pytest.mark.slow
def test_under_torchrun_a_stuck_rank_is_named_and_no_process_is_left(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT), str(tmp_path)
    ]  # fmt: skip
    output = _run_stuck_fit(command, tmp_path)
    _assert_names_the_stuck_rank(output, tmp_path)


HANG_TIMEOUT = 2.0


class SlowCheckpointIO(AtomicCheckpointIO):
    """Rank 0 writes a checkpoint for twice the hang timeout (a multi-GB file, on a real job)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        time.sleep(2 * HANG_TIMEOUT)
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


class EvaluatedOnRankZero(Regressor):
    """Validation whose epoch end runs an evaluation on rank 0 only, for twice the hang timeout."""

    def validation_step(self, batch, batch_idx):
        return self.step_loss(*batch)

    def on_validation_epoch_end(self) -> None:
        if self.global_rank == 0 and not self.trainer.sanity_checking:
            time.sleep(2 * HANG_TIMEOUT)

    def val_dataloader(self):
        return self.train_dataloader()


def fit_with_slow_checkpoints_and_evaluation(rank: int, root: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = lit_dp.PaddleDPStrategy(hang_timeout=HANG_TIMEOUT, checkpoint_io=SlowCheckpointIO())
    checkpoints = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    fit = trainer(
        strategy, root, max_epochs=1, val_check_interval=2, callbacks=[checkpoints], enable_checkpointing=True,
        num_sanity_val_steps=0,
    )  # fmt: skip
    fit.fit(EvaluatedOnRankZero())


@pytest.mark.slow
def test_rank_zeros_checkpoint_writes_and_its_own_evaluation_are_not_hangs(tmp_path):
    run_ranks(fit_with_slow_checkpoints_and_evaluation, 2, str(tmp_path), timeout=240)
    assert len(list(tmp_path.glob("*.ckpt"))) >= 2
    assert not (tmp_path / HANG_DIRECTORY).exists()
