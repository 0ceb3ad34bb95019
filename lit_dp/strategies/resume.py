"""Resuming inside an epoch: the training loader goes on at the batch after the last one trained.

Lightning restores the loops' progress from a checkpoint (the epoch, and how many of its batches
were trained), but a plain ``DataLoader`` starts its epoch over: the resumed epoch trains again on
the batches it had already seen (Lightning warns, "your dataloader is not resumable"). And the
iterator of the resumed epoch is created before ``set_epoch`` is called for it, so a
``DistributedSampler`` shuffles it as epoch 0.

``continue_epoch`` fixes both for a map-style loader batched by a ``BatchSampler`` (what
Lightning's ``DistributedSampler`` injection produces): it sets the sampler's epoch, and skips,
at the index level (no sample is loaded), the batches the checkpoint had trained. The strategy
calls it from ``process_dataloader``, the one hook Lightning runs after restoring the loops and
before the first batch is fetched. Loaders it cannot continue (an ``IterableDataset``, a custom
batch sampler, ``batch_size=None``) keep Lightning's own behaviour and its warning.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any

from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import BatchSampler, DataLoader, Sampler


class _ContinuedSampler(Sampler):
    """``sampler``, whose next iteration starts ``skip`` indices in; later ones are whole."""

    def __init__(self, sampler: Sampler, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        assert isinstance(self.sampler, Sized)
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def batches_to_skip(fit_loop: _FitLoop, dataloader: DataLoader) -> int:
    """How many batches of the current epoch the restored checkpoint had trained (0: none, or all)."""
    if not fit_loop.restarting:
        return 0
    trained = fit_loop.epoch_loop.batch_progress.current.processed
    per_epoch = _parse_num_batches(RunningStage.TRAINING, len(dataloader), fit_loop.trainer.limit_train_batches)
    return trained if 0 < trained < per_epoch else 0


def continue_epoch(dataloader: object, fit_loop: _FitLoop) -> object:
    """Point ``dataloader`` at the restored epoch, past the batches already trained in it (in place)."""
    if not isinstance(dataloader, DataLoader) or not fit_loop.restarting:
        return dataloader
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is not BatchSampler or not isinstance(batch_sampler.sampler, Sized):
        return dataloader
    epoch = fit_loop.epoch_progress.current.processed
    _set_sampler_epoch(dataloader, epoch)
    skip = batches_to_skip(fit_loop, dataloader)
    if skip:
        # DataLoader forbids replacing its samplers; the batch sampler's own is a plain attribute.
        batch_sampler.sampler = _ContinuedSampler(batch_sampler.sampler, skip * batch_sampler.batch_size)
        rank_zero_info(f"[lit_dp] epoch {epoch} continues at batch {skip}: the batches before it were trained")
    return dataloader
