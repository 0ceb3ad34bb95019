"""``PaddleDPStrategy(uneven_inputs=True)``: ranks with different numbers of batches under the Trainer.

torch's ``Join`` lets a rank that ran out leave its loop and shadow the others from outside
it. Lightning's loop cannot be left like that: each training batch starts with a broadcast of
its own (the SIGTERM check), callbacks may synchronise after a step, validation runs at the
same batch on every rank, and the epoch ends with a reduction of the logged metrics. So here a
rank that has run out stays in the loop and keeps taking steps without data until every rank
has run out:

- ``UnevenLoader`` wraps the training and validation dataloaders. Before each batch the ranks
  exchange, in one small all-reduce, which of them still have one; when none has, the epoch
  ends on every rank at once. A rank without a batch yields its last real batch again (a
  peer's, broadcast once, if it never had one), so the hooks that see batches keep working,
  and the strategy learns, per batch, whether this rank takes it for real.
- On such a replayed batch the strategy does not run the user's ``training_step``: the
  model's ``replay_step`` issues the step's collectives without a backward of this rank's
  (gradients it accumulated earlier in an accumulation window still count), the average lands
  in ``.grad``, and the optimizer steps like everyone else's, so weights and optimizer state
  stay identical. Gradients are divided by the world size, as with the distributed sampler's
  padding, but without counting any sample twice. ``validation_step`` is skipped the same way.
- Collectives the replaying rank cannot match, those of the user's own ``training_step`` or
  ``validation_step`` (``self.log(..., sync_dist=True)`` at step level, ``all_gather``) while
  some rank is out, raise at once with the remedy instead of hanging.
- A rank with no batch at all in an epoch logged nothing, yet the epoch-level ``sync_dist``
  reductions need every rank: it gets the others' sync_dist entries with values that add
  nothing (``UnevenMetricsCallback``).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from lit_dp.gradients.waiting import UNWATCHED, Waiter

REMEDY = (
    "log per-step values with sync_dist=False, or with on_step=False, on_epoch=True (reduced once at the "
    "epoch's end, when every rank is there)"
)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """One batch as every rank sees it: whether this rank replays it, and which ranks have none."""

    replay: bool
    ranks_out: tuple[int, ...]


class UnevenInputs:
    """The strategy's state for uneven inputs: the per-batch exchange and the batch being taken.

    Args:
        group: where the exchange runs (a Gloo group: its tensors stay on the host).
        waiter: how its waits are made (the hang watchdog's, when on).
    """

    def __init__(self, group: dist.ProcessGroup | None, waiter: Waiter) -> None:
        self._group = group
        self._waiter = waiter
        self._ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self._plans: dict[str, deque[BatchPlan]] = {"train": deque(), "val": deque()}
        self.current: BatchPlan | None = None
        self.real_batches: dict[str, list[int]] = {"train": [], "val": []}
        self._in_user_step: str | None = None
        self.on_exhausted: Callable[[str], None] | None = None  # called on every rank when a loader ends

    def close(self) -> None:
        """Let go of the group: the trainer's loaders outlive the fit and still reference this object,
        and a group kept alive keeps rank 0's rendezvous port bound."""
        self._group = None
        self._waiter = UNWATCHED

    @property
    def replaying(self) -> bool:
        return self.current is not None and self.current.replay

    def wrap(self, loader: object, kind: str, length: int | None) -> UnevenLoader:
        wrapper_type = SizedUnevenLoader if length is not None else UnevenLoader
        return wrapper_type(loader, self, kind, length)

    def start_batch(self, kind: str) -> None:
        """``batch_to_device`` of a batch of ``kind`` ("train" or "val"): it is the next one yielded."""
        plans = self._plans[kind]
        self.current = plans.popleft() if plans else None

    def reset(self, kind: str) -> None:
        """Forget the batches of ``kind`` not taken (an epoch cut short) and the counts of real ones.

        Training resets when its loader's iteration starts; validation when its run ends (its
        loaders' iterations start one after another within a run, with a batch prefetched ahead).
        """
        self._plans[kind].clear()
        self.real_batches[kind] = []

    @contextmanager
    def user_step(self, name: str) -> Iterator[None]:
        """The user's ``training_step``/``validation_step`` runs inside: its collectives are checked."""
        self._in_user_step = name
        try:
            yield
        finally:
            self._in_user_step = None

    def check_collective(self, collective: str) -> None:
        """Raise if the user's step issues a collective that a rank without a batch cannot match."""
        plan = self.current
        if self._in_user_step is None or plan is None or not plan.ranks_out:
            return
        raise RuntimeError(
            f"lit_dp (uneven_inputs=True): {self._in_user_step} called strategy.{collective} while rank(s) "
            f"{list(plan.ranks_out)} have run out of batches and do not run {self._in_user_step}: the collective "
            f"could never be matched. Instead, {REMEDY}."
        )

    # -- the exchange, called by the loaders ----------------------------------------------------

    def exchange(self, kind: str, has_batch: bool, needs_template: bool) -> tuple[list[bool], list[bool]]:
        """Which ranks have a batch, and which need one to replay (one all-reduce of 2 x world flags)."""
        world = len(self._ranks)
        flags = torch.zeros(2 * world, dtype=torch.int32)
        position = self._ranks.index(dist.get_rank())
        flags[position] = int(has_batch)
        flags[world + position] = int(needs_template)
        work = dist.all_reduce(flags, group=self._group, async_op=True)
        self._waiter.wait(work, f"the per-batch exchange of uneven inputs ({kind})")
        values = [bool(v) for v in flags.tolist()]
        return values[:world], values[world:]

    def share_template(self, batch: Any, has: list[bool], needs: list[bool]) -> Any:
        """The lowest rank with a batch sends it to the ranks that never had one (once per rank and stage)."""
        source = self._ranks[has.index(True)]
        holder = [batch if dist.get_rank() == source else None]
        with self.watched("the broadcast of a batch to replay (uneven inputs)"):
            dist.broadcast_object_list(holder, src=source, group=self._group)
        return holder[0]

    def watched(self, what: str) -> AbstractContextManager:
        """An object collective of uneven inputs, watched by the hang watchdog (issue 27)."""
        return self._waiter.outside(what)

    def record(self, kind: str, plan: BatchPlan, has: list[bool]) -> None:
        self._plans[kind].append(plan)
        counts = self.real_batches[kind]
        if len(counts) != len(has):
            counts[:] = [0] * len(has)
        for position, present in enumerate(has):
            counts[position] += present


class UnevenLoader:
    """A dataloader whose iteration goes on, replaying, until every rank has run out (see the module docstring).

    Attributes not its own (``sampler``, ``dataset``, ``batch_size``, ...) are the wrapped loader's.
    """

    def __init__(self, loader: object, uneven: UnevenInputs, kind: str, length: int | None) -> None:
        self.loader = loader
        self._uneven = uneven
        self._kind = kind
        self._length = length
        self._template: Any = None
        self._has_template = False

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        uneven, kind = self._uneven, self._kind
        if kind == "train":
            uneven.reset(kind)
        iterator = iter(self.loader)  # type: ignore[call-overload]
        exhausted = False
        while True:
            batch = None
            if not exhausted:
                try:
                    batch = next(iterator)
                except StopIteration:
                    exhausted = True
            has, needs = uneven.exchange(kind, not exhausted, exhausted and not self._has_template)
            if not any(has):
                if uneven.on_exhausted is not None:
                    uneven.on_exhausted(kind)
                return
            if any(needs):
                shared = uneven.share_template(batch, has, needs)
                if not self._has_template:
                    self._template, self._has_template = shared, True
            if not exhausted:
                self._template, self._has_template = batch, True
            ranks = uneven._ranks
            plan = BatchPlan(replay=exhausted, ranks_out=tuple(r for r, present in zip(ranks, has) if not present))
            uneven.record(kind, plan, has)
            yield batch if not exhausted else self._template


class SizedUnevenLoader(UnevenLoader):
    """An ``UnevenLoader`` over loaders whose lengths every rank knows: its length is the longest."""

    def __len__(self) -> int:
        assert self._length is not None
        return self._length


class UnevenMetricsCallback(Callback):
    """Gives a rank that had no batch of its own the sync_dist entries the others logged, with
    values that change no reduction (0 with a batch size of 0 for means and sums, -inf for max,
    +inf for min), so the epoch-level reductions meet on every rank instead of hanging.

    It acts where every rank is at once and before Lightning reduces: at the exchange that ends
    a loader (validation fetches without prefetching, so its steps are done by then), and at
    the batch Lightning marks last (training prefetches: the exchange runs before the last step,
    whose first logs a rank with a single batch has not made yet). Acting twice adds nothing.
    """

    def __init__(self, uneven: UnevenInputs, trainer: pl.Trainer) -> None:
        self._uneven = uneven
        self._trainer = trainer
        uneven.on_exhausted = self._align

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._align("train")

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.val_loop.batch_progress.is_last_batch:
            self._align("val")

    def _align(self, kind: str) -> None:
        counts = self._uneven.real_batches[kind]
        results = self._trainer._results
        if not counts or all(counts) or results is None:
            return  # every rank logged from its own steps
        entries = [
            (key, {f.name: getattr(metric.meta, f.name) for f in dataclasses.fields(_Metadata) if f.name != "_sync"})
            for key, metric in results.valid_items()
            if metric.is_tensor and metric.meta.sync.should and metric.meta.on_epoch
        ]
        gathered: list[Any] = [None] * len(counts)
        with self._uneven.watched("the exchange of logged metrics (uneven inputs)"):
            dist.all_gather_object(gathered, entries)
        if counts[self._uneven._ranks.index(dist.get_rank())]:
            return
        donor = next(entries for entries, count in zip(gathered, counts) if count)
        for key, fields in donor:
            if key in results and not results[key].has_reset:
                continue  # given at an earlier call
            meta = _Metadata(**fields)
            meta.sync = _Sync(_should=True, fn=self._trainer.strategy.reduce)
            metric = _ResultMetric(meta, is_tensor=True).to(self._trainer.strategy.root_device)
            metric._update_count = 1  # torchmetrics' "updated" mark: its fresh values are meant
            results[key] = metric  # its default values add nothing to the reduction


def gather_lengths(dataloader: object) -> list[int | None]:
    """Every rank's number of batches (None where unknown): one small all-gather."""
    lengths: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lengths, sized_len(dataloader))
    return lengths


def check_equal_lengths(lengths: list[int | None], limit: int | float) -> None:
    """Raise, on every rank, if the ranks' training lengths (after ``limit_train_batches``) are
    known and differ: the longer ones would wait forever in an all-reduce at the first batch the
    shorter ones do not have."""
    if None in lengths:
        return
    effective = [_parse_num_batches(RunningStage.TRAINING, length, limit) for length in lengths]  # type: ignore[arg-type]
    if len(set(effective)) < 2:
        return
    listed = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(effective))
    raise ValueError(
        f"lit_dp: the ranks' training dataloaders have different numbers of batches ({listed}), so the ranks with "
        "more would wait forever for the others in an all-reduce. Pass PaddleDPStrategy(uneven_inputs=True) "
        "(strategy.uneven_inputs=true in a recipe) to let a rank that runs out take the remaining steps without "
        "data, or give every rank the same number of batches (use_distributed_sampler=True does)."
    )
