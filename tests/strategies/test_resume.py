"""A fit resumed from a checkpoint taken inside an epoch ends with the weights of an uninterrupted fit.

One process, a one-rank ``paddle_dp`` group: Lightning injects its ``DistributedSampler`` as on
many ranks, and the loader continuation (``lit_dp.strategies.resume``) is what is tested. The
comparison is exact: the same batches in the same order give bitwise the same float operations.
"""

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lit_dp  # noqa: F401 - registers "paddle_dp"
from lit_dp_recipes.digits import DigitsDataModule, MLPClassifier


class _Preempted(Exception):
    pass


class _StopBeforeStep(pl.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise _Preempted


def _fit(checkpoints, ckpt_path=None, stop_before=None):
    pl.seed_everything(7, workers=True)
    model = MLPClassifier()
    callbacks = [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=0, save_last=True)]
    if stop_before is not None:
        callbacks.append(_StopBeforeStep(stop_before))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="paddle_dp", max_epochs=2, limit_val_batches=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    try:
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=128), ckpt_path=ckpt_path)
    except _Preempted:
        pass
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("reference"))


@pytest.mark.slow
def test_resume_inside_an_epoch_is_exact(tmp_path, uninterrupted, caplog):
    # Inside the second epoch (12 batches each): both the restored epoch's shuffle and the skip matter.
    stop_before = 16
    _fit(tmp_path, stop_before=stop_before)
    with caplog.at_level(logging.INFO):
        resumed = _fit(tmp_path / "resumed", ckpt_path=tmp_path / "last.ckpt")
    epoch, batch = divmod(stop_before, 12)
    assert f"[lit_dp] epoch {epoch} continues at batch {batch}" in caplog.text
    assert torch.equal(resumed, uninterrupted)
