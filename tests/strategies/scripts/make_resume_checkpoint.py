"""Writes the checkpoint that ``tests/strategies/test_feature_checkpoints.py`` resumes.

``python tests/strategies/scripts/make_resume_checkpoint.py OUT.ckpt`` with the lit_dp of the
commit to keep on ``PYTHONPATH``. It fits ``tiny_fit`` (one rank, ``comm_buffer_size="auto"``,
LocalSGD every 2 steps after 3 warm-up steps, 16 batches an epoch, a checkpoint after every
step) and stops inside the first epoch at step ``STOP_AFTER``, before its checkpoint: the one
kept, ``last.ckpt`` after step ``STOP_AFTER - 1``, holds in the strategy's entry the tuned bucket
size, the LocalSGD schedule and the loader's layout, as that commit wrote them.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lit_dp  # noqa: F401 - registers "paddle_dp"

STOP_AFTER = 5  # the fit stops at this step; the checkpoint kept is the one before
BATCH_SIZE = 4
SAMPLES = 64  # 16 batches an epoch


class TinyRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 1)
        self.seen: list[int] = []  # the first sample index of each batch trained

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append(int(index[0]))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=generator)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True).sin(), torch.arange(SAMPLES))
    return DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)


class _Stop(Exception):
    pass


class _StopAfter(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == STOP_AFTER:
            raise _Stop


def tiny_fit(
    root: Path, callbacks: list, ckpt_path: str | None = None, warmup_steps: int = 3
) -> tuple[pl.Trainer, TinyRegression]:
    pl.seed_everything(3, workers=True)
    model = TinyRegression()
    strategy = lit_dp.PaddleDPStrategy(comm_buffer_size="auto", local_sgd_steps=2, local_sgd_warmup_steps=warmup_steps)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=callbacks, default_root_dir=root,
    )
    try:
        trainer.fit(model, train_dataloaders=loader(), ckpt_path=ckpt_path)
    except _Stop:
        pass
    return trainer, model


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        every_step = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=0, save_last=True)
        tiny_fit(Path(folder), [every_step, _StopAfter()])
        shutil.copy(Path(folder) / "last.ckpt", sys.argv[1])
