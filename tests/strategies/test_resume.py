"""A fit resumed from a checkpoint taken inside an epoch goes on after the last sample it trained.

On one process, a one-rank ``paddle_dp`` group: Lightning injects its ``DistributedSampler`` as on
many ranks, and the loader continuation (``lit_dp.strategies.resume``) is what is tested. The
comparison is exact: the same batches in the same order give bitwise the same float operations.
On another number of ranks (real processes): every sample of the epoch's order is trained once,
but for the few the resume line says are trained twice. Lightning's "not resumable" warning is
gone where lit_dp continues the loader, and kept where it does not.
"""

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Sampler, TensorDataset

import lit_dp  # noqa: F401 - registers "paddle_dp"
from lit_dp_recipes.digits import DigitsDataModule, MLPClassifier
from tests.helpers.distributed import run_ranks


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


class _Indexed(pl.LightningModule):
    """Records the dataset indices each training step sees, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(6, 1)
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        x, index = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        dataset = TensorDataset(torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(0)), torch.arange(SAMPLES))
        return DataLoader(dataset, batch_size=BATCH, shuffle=True)


SAMPLES, BATCH = 96, 4
STOP_BEFORE = 16  # 2 ranks: 12 batches an epoch, so batch 4 of epoch 1


def _fit_with_checkpoints(model, folder, ckpt_path=None, stop_before=None, **options) -> list[str]:
    """Fit ``model`` for 2 epochs (stopped before step ``stop_before``, if given), a checkpoint at every
    step in ``folder``; Lightning's "not resumable" warnings during the fit."""
    callbacks = [ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=0, save_last=True)]
    if stop_before is not None:
        callbacks.append(_StopBeforeStep(stop_before))
    trainer = pl.Trainer(
        accelerator="cpu", strategy="paddle_dp", max_epochs=2, logger=False, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **options,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, ckpt_path=ckpt_path)
        except _Preempted:
            pass
    return [str(w.message) for w in caught if "dataloader is not resumable" in str(w.message)]


def _indexed_fit(rank, folder, devices, ckpt_path=None):
    """One rank of a fit of ``_Indexed`` (stopped before step 16 when not resuming): the indices it
    trained in epoch 1, lit_dp's lines, and whether Lightning's "not resumable" warning came."""
    from pathlib import Path

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    model = _Indexed()
    stop_before = STOP_BEFORE if ckpt_path is None else None
    warned = _fit_with_checkpoints(model, Path(folder), ckpt_path, stop_before, devices=devices)
    return model.seen.get(1, []), [line for line in lines if line.startswith("[lit_dp] epoch")], bool(warned)


@pytest.fixture(scope="module")
def interrupted_on_two_ranks(tmp_path_factory):
    """The checkpoint of a 2-rank fit stopped inside epoch 1, and the indices it trained in that epoch."""
    folder = tmp_path_factory.mktemp("two_ranks")
    first = run_ranks(_indexed_fit, 2, str(folder), 2, timeout=180)
    return folder / "last.ckpt", [index for rank in (0, 1) for index in first[rank][0]]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [3, 1])
def test_a_resume_on_another_number_of_ranks_trains_the_rest_of_the_epochs_order(tmp_path, interrupted_on_two_ranks, devices):
    checkpoint, trained = interrupted_on_two_ranks
    assert len(trained) == (STOP_BEFORE - 12) * BATCH * 2  # 32 samples of epoch 1 trained before the stop
    resumed = run_ranks(_indexed_fit, devices, str(tmp_path), devices, str(checkpoint), timeout=180)
    rest = [index for rank in range(devices) for index in resumed[rank][0]]
    again = 32 - (32 // devices) * devices  # fewer than `devices` samples at the boundary come twice
    assert sorted(set(trained) | set(rest)) == list(range(SAMPLES))
    assert len(trained) + len(rest) == SAMPLES + again
    lines = resumed[0][1]
    assert len(lines) == 1 and lines[0].startswith(
        f"[lit_dp] epoch 1 continues after the first 32 samples of its shuffled order, trained as 4 batches of "
        f"{BATCH} samples on each of 2 ranks; here {BATCH} samples on {'each of 3 ranks' if devices == 3 else '1 rank'}, "
        "each rank skips "
        f"{32 // devices} samples"
    )
    assert ("trained a second time" in lines[0]) == bool(again)
    assert not any(not_resumable for _, _, not_resumable in resumed.values())


class _OwnBatches(Sampler):
    """A batch sampler of the user's own: lit_dp cannot know what skipping means for it."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self):
        return iter([list(range(i, min(i + BATCH, self.length))) for i in range(0, self.length, BATCH)])

    def __len__(self) -> int:
        return -(-self.length // BATCH)


class _OwnBatchesIndexed(_Indexed):
    def train_dataloader(self):
        loader = super().train_dataloader()
        return DataLoader(loader.dataset, batch_sampler=_OwnBatches(SAMPLES))


@pytest.mark.slow
def test_lightnings_not_resumable_warning_stays_where_lit_dp_does_not_restore_the_position(tmp_path):
    def fit(model, ckpt_path=None):
        stop_before = None if ckpt_path else 30
        return _fit_with_checkpoints(model, tmp_path, ckpt_path, stop_before, devices=1, use_distributed_sampler=False)

    assert fit(_OwnBatchesIndexed()) == []
    assert len(fit(_OwnBatchesIndexed(), tmp_path / "last.ckpt")) == 1  # Lightning's own, kept
    assert fit(_Indexed()) == []
    assert fit(_Indexed(), tmp_path / "last.ckpt") == []  # continued by lit_dp: silenced
    assert not any("dataloader is not resumable" in str(f[1].pattern) for f in warnings.filters if f[1] is not None)


def test_a_layout_of_one_rank_says_rank_once():
    from lit_dp.strategies.resume import _describe

    assert _describe({"batch_size": 4, "world_size": 1}) == "4 samples on 1 rank"
    assert _describe({"batch_size": 4, "world_size": 2}) == "4 samples on each of 2 ranks"
