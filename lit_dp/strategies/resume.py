"""Resuming inside an epoch: the training loader goes on after the last sample trained.

Lightning restores the loops' progress from a checkpoint (the epoch, and how many of its batches
were trained), but a plain ``DataLoader`` starts its epoch over: the resumed epoch trains again on
the batches it had already seen (Lightning warns, "your dataloader is not resumable"). And the
iterator of the resumed epoch is created before ``set_epoch`` is called for it, so a
``DistributedSampler`` shuffles it as epoch 0.

``EpochContinuation`` fixes both for a map-style loader batched by a ``BatchSampler`` (what
Lightning's ``DistributedSampler`` injection produces): it sets the sampler's epoch, and skips,
at the index level (no sample is loaded), what the checkpoint had trained. It is a feature of
the Trainer's strategy (``lit_dp.strategies.feature``) acting in ``process_dataloader``, the one
hook Lightning runs after restoring the loops and before the first batch is fetched; it also
keeps the loader's layout (world size, batch size) in the strategy's checkpoint entry (``loader``), and Lightning's warning is filtered for the fit
whose loader it continued (only that message, only for that fit). Loaders it cannot continue
(an ``IterableDataset``, a custom batch sampler, ``batch_size=None``) keep Lightning's own
behaviour and its warning.

Resuming with another number of ranks or another batch size: a ``DistributedSampler`` deals
the epoch's one shuffled order (the same for any world size) to the ranks in turn, so the
samples the checkpoint trained are the first ``batches x batch_size x world_size`` of that
order. Each new rank skips its share of them, ``consumed // new world size`` of its own indices,
and Lightning's batch count for the epoch is set to the batches of the new layout those make,
so the epoch ends where the order ends. When the new world size does not divide the count, the
fewer than ``world_size`` samples at the boundary are trained a second time; the line saying
where the epoch goes on says so. With another sampler the order is the sampler's own: each rank
skips the checkpoint's batch count, and the line says that the samples skipped may differ.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sized
from typing import Any

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler
from typing_extensions import override

from lit_dp.strategies.feature import Feature, Run
from lit_dp.strategies.lightning_private import FitLoop, parse_num_batches, set_sampler_epoch

# The start of the warning Lightning's `_TrainingEpochLoop.reset` gives for a mid-epoch resume of
# a loader that has no `state_dict`: wrong for the loaders continued here.
NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"


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


class EpochContinuation(Feature):
    """A resumed fit's training loader, continued where the checkpoint stopped (see the module docstring).

    Its checkpoint entry, ``loader``, is the training loader's layout.
    """

    key = "loader"

    def __init__(self) -> None:
        self._run: Run | None = None  # from setup
        self._layout: dict[str, Any] | None = None  # this fit's training loader, for checkpoints
        self._saved_layout: dict[str, Any] | None = None  # from the checkpoint being resumed
        self._filter: tuple | None = None  # our entry in `warnings.filters`, while fitting

    @override
    def state_dict(self) -> dict[str, Any] | None:
        """The training loader's layout (``world_size``, ``batch_size``), once known."""
        return self._layout

    @override
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The layout of the checkpoint's run (None: unknown, an older checkpoint; assumed unchanged)."""
        self._saved_layout = state

    @override
    def setup(self, run: Run) -> None:
        self._run = run

    @override
    def teardown(self) -> None:
        # Removing an "ignore" entry needs no cache reset: an ignored warning leaves no registry entry.
        if self._filter is not None and self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
        self._filter = None
        self._saved_layout = None
        self._run = None

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader: pointed at the restored epoch, past the samples already trained in it (in place)."""
        trainer = self._run.trainer if self._run is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return self._continue(dataloader, trainer.fit_loop, self._run.strategy.world_size)

    def _continue(self, dataloader: object, fit_loop: FitLoop, world_size: int) -> object:
        if not isinstance(dataloader, DataLoader):
            return dataloader
        batch_sampler = dataloader.batch_sampler
        if type(batch_sampler) is not BatchSampler or not isinstance(batch_sampler.sampler, Sized):
            return dataloader
        sampler = batch_sampler.sampler
        if isinstance(sampler, _ContinuedSampler):
            sampler = sampler.sampler
        self._layout = {"world_size": world_size, "batch_size": batch_sampler.batch_size}
        if not fit_loop.restarting:
            return dataloader
        epoch = fit_loop.epoch_progress.current.processed
        set_sampler_epoch(dataloader, epoch)
        saved = self._saved_layout or self._layout
        if saved != self._layout and isinstance(sampler, DistributedSampler):
            trained = fit_loop.epoch_loop.batch_progress.current.processed
            if not trained:
                return dataloader
            skip, line = _continue_in_new_layout(fit_loop, dataloader, trained, saved, world_size)
        else:
            trained = batches_trained(fit_loop, dataloader)
            if not trained:
                return dataloader
            skip = trained * batch_sampler.batch_size
            line = f"continues at batch {trained}: the batches before it were trained"
            if saved != self._layout:
                line += (
                    f" as {_describe(saved)} (here {_describe(self._layout)}); the sampler is not a DistributedSampler, "
                    "so which samples that skips is its own"
                )
        # DataLoader forbids replacing its samplers; the batch sampler's own is a plain attribute.
        batch_sampler.sampler = _ContinuedSampler(sampler, skip)
        if self._filter is None:
            warnings.filterwarnings("ignore", message=NOT_RESUMABLE_WARNING, category=PossibleUserWarning)
            self._filter = warnings.filters[0]
        rank_zero_info(f"[lit_dp] epoch {epoch} {line}")
        return dataloader


def batches_trained(fit_loop: FitLoop, dataloader: DataLoader) -> int:
    """How many batches of the current epoch the restored checkpoint had trained (0: none, or all)."""
    if not fit_loop.restarting:
        return 0
    trained = fit_loop.epoch_loop.batch_progress.current.processed
    per_epoch = parse_num_batches(RunningStage.TRAINING, len(dataloader), fit_loop.trainer.limit_train_batches)
    return trained if 0 < trained < per_epoch else 0


def _continue_in_new_layout(
    fit_loop: FitLoop, dataloader: DataLoader, trained: int, saved: dict[str, Any], world_size: int
) -> tuple[int, str]:
    """The indices each rank skips, and the line saying where the epoch goes on, after a change of
    world size or batch size under a ``DistributedSampler``; sets the epoch's batch count to match."""
    batch_size = dataloader.batch_sampler.batch_size
    per_rank = len(dataloader.batch_sampler.sampler)
    length = parse_num_batches(RunningStage.TRAINING, len(dataloader), fit_loop.trainer.limit_train_batches)
    consumed = trained * saved["batch_size"] * saved["world_size"]
    here = _describe({"world_size": world_size, "batch_size": batch_size})
    skip = consumed // world_size
    if skip >= per_rank:
        skip, batches = 0, length
        line = f"was trained to its end ({trained} batches of {_describe(saved)}; here {here}): the next one starts"
    else:
        batches = skip // batch_size
        line = (
            f"continues after the first {consumed} samples of its shuffled order, trained as {trained} batches of "
            f"{_describe(saved)}; here {here}, each rank skips {skip} samples and the epoch goes on at batch "
            f"{batches} of {length}"
        )
        if again := consumed - skip * world_size:
            line += f"; {again} samples at the boundary are trained a second time"
    # Lightning's count of the epoch's batches, in the new layout (before its loop resets on restart).
    progress = fit_loop.epoch_loop.batch_progress.current
    shift = batches - progress.processed
    progress.ready += shift
    progress.started += shift
    progress.processed += shift
    progress.completed += shift
    return skip, line


def _describe(layout: dict[str, Any]) -> str:
    """``4 samples on each of 2 ranks``; ``4 samples on 1 rank``."""
    ranks = layout["world_size"]
    return f"{layout['batch_size']} samples on " + (f"each of {ranks} ranks" if ranks != 1 else "1 rank")
