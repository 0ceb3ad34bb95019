"""A fit whose process dies in the middle of an asynchronous save, for ``tests/strategies/test_checkpointing.py``.

``python async_save_killed.py FOLDER FORMAT`` fits one rank with ``async_save=True`` and
``state_dict_type=FORMAT``, ``epoch=<n>-step=<m>.ckpt`` and ``last.ckpt`` after each epoch (ModelCheckpoint's
defaults with ``save_last``). The first epoch's saves complete; from
the second epoch on, the first ``fsync`` of a save's write (its data is written, not yet made
durable nor renamed into place) kills the process with SIGKILL: a crash while the background
thread writes, the training thread already on. What it leaves in ``FOLDER/checkpoints`` is the test's.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import lit_dp
from tests.strategies.test_checkpointing import AdamRegressor


class KillInTheNextWrite(pl.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            trainer.strategy._checkpointing.wait()  # the first epoch's save is complete

            def die(descriptor: int) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            os.fsync = die  # the writer's next flush to disk, in the background thread


def main(folder: Path, state_dict_type: str) -> None:
    strategy = lit_dp.PaddleDPStrategy(state_dict_type=state_dict_type, async_save=True)
    checkpoints = ModelCheckpoint(dirpath=folder / "checkpoints", save_last=True)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[KillInTheNextWrite(), checkpoints], default_root_dir=folder,
    )  # fmt: skip
    trainer.fit(AdamRegressor())


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
