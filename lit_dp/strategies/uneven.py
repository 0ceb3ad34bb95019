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
- On such a replayed batch the strategy does not run the user's ``training_step``; it returns
  an output of the structure this rank's last real one had (``ReplayedOutputs``), every tensor
  zero. Lightning's backward path runs as on every rank, with its hooks (``on_before_backward``,
  ``on_after_backward``, the precision plugin's), so a collective there meets its partners;
  only the backward itself is the model's ``replay_step``, which issues the step's collectives
  without a backward of this rank's (gradients it accumulated earlier in an accumulation window
  still count). The average lands in ``.grad``, and the optimizer steps like everyone else's,
  so weights and optimizer state stay identical. Gradients are divided by the world size, as
  with the distributed sampler's padding, but without counting any sample twice.
  ``validation_step`` is skipped the same way (Lightning's validation has no backward).
- Collectives the replaying rank cannot match, those of the user's own ``training_step`` or
  ``validation_step`` (``self.log(..., sync_dist=True)`` at step level, ``all_gather``) while
  some rank is out, raise at once with the remedy instead of hanging.
- A rank with no batch at all in an epoch logged nothing, yet the epoch-level ``sync_dist``
  reductions need every rank: it gets the others' sync_dist entries with values that add
  nothing (``UnevenMetricsCallback``).

Without the option, training loaders of known, different lengths are an error at the start of
``fit`` (``check_equal_lengths``), instead of a hang at the first batch a rank does not have.

``UnevenInputs`` is the Trainer strategy's feature (``lit_dp.strategies.feature``); ``BatchExchange``
is the ranks' per-batch exchange that the wrapped loaders run and the metrics callback reads.

A Fabric loop can leave its loop, so there uneven inputs are torch's ``Join`` itself:
``with fabric.strategy.join(model):`` (``FabricUnevenInputs``, which exposes ``join`` on Fabric's
strategy; ``lit_dp.join``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.waiting import UNWATCHED, Waiter
from lit_dp.join import DataParallelJoin
from lit_dp.options import Options
from lit_dp.strategies.feature import Feature, Run
from lit_dp.strategies.lightning_private import (
    add_synced_metric,
    forward_module,
    logged_results,
    parse_num_batches,
    synced_epoch_metrics,
)

log = logging.getLogger(__name__)

REMEDY = (
    "log per-step values with sync_dist=False, or with on_step=False, on_epoch=True (reduced once at the "
    "epoch's end, when every rank is there)"
)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """One batch as every rank sees it: whether this rank replays it, and which ranks have none."""

    replay: bool
    ranks_out: tuple[int, ...]


class UnevenInputs(Feature):
    """Uneven inputs as the Trainer's strategy sees them: a feature (``lit_dp.strategies.feature``).

    Off (nothing wrapped, nothing replayed) until ``setup`` turns it on for a fit with
    ``uneven_inputs=True`` on more than one rank; off, ``process_dataloader`` still refuses
    training loaders of known, different lengths. On, ``process_dataloader`` wraps the loaders,
    ``batch_to_device`` takes each batch's plan, ``joined`` says this rank replays the step (the
    strategy's ``backward`` then takes the synchronisation without a backward), ``training_step``
    and ``validation_step`` skip the user's on a replayed batch and check the collectives of a
    real one (``collective``).

    Args:
        enabled: the ``uneven_inputs`` option.
    """

    exposes = {"joined": False}  # the Trainer's strategy.joined; built for every option: never off

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._trainer: pl.Trainer | None = None  # from setup
        self._device = torch.device("cpu")  # this rank's, from setup
        self._exchange: BatchExchange | None = None  # on: from setup to teardown
        self._current: BatchPlan | None = None  # the batch being taken
        self._model: DataParallel | None = None  # on: from setup to teardown
        # The lowest rank that took the last training step with a batch of its own: its buffers
        # (BatchNorm's statistics) are the freshest, so the next forward broadcasts from it.
        self._freshest = 0
        self._in_user_step: str | None = None
        self._outputs = ReplayedOutputs()

    @classmethod
    @override
    def build(cls, options: Options) -> UnevenInputs:
        return cls(enabled=options.uneven_inputs)

    @override
    def setup(self, run: Run) -> None:
        """Turn on for this fit (``run.model`` is the wrapped module), or refuse what cannot work with it."""
        self._trainer = trainer = run.trainer
        self._device = run.strategy.root_device
        model = run.model
        if trainer is None or model is None or not run.fitting:
            return
        if not self._enabled or model.reducer is None or trainer.world_size < 2:
            reason = "uneven_inputs=False" if not self._enabled else f"world size {trainer.world_size}"
            log.debug("uneven inputs: off (%s)", reason)
            return
        if any(isinstance(module, torch.nn.SyncBatchNorm) for module in model.modules()):
            raise ValueError(
                "uneven_inputs=True with Trainer(sync_batchnorm=True) (or SyncBatchNorm layers) is invalid: "
                "SyncBatchNorm all-reduces inside the forward, which a rank that has run out of batches does not "
                "run; expected one of them."
            )
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "uneven_inputs=True needs automatic optimization: under manual optimization the strategy cannot "
                "know how many synchronised backwards a training_step takes, so a rank without a batch could not "
                "take them with the others."
            )
        self._outputs = ReplayedOutputs()  # learnt anew in each fit
        self._model, self._freshest = model, 0
        # The exchange runs on the host: under NCCL on a Gloo group of its own.
        separate_group = dist.get_backend() == "nccl"
        self._exchange = BatchExchange(dist.new_group(backend="gloo") if separate_group else None, model.waiter)
        trainer.callbacks = [
            c for c in trainer.callbacks if not isinstance(c, (UnevenMetricsCallback, UnevenBuffersCallback))
        ]
        trainer.callbacks += [UnevenMetricsCallback(self._exchange, trainer), UnevenBuffersCallback(self)]
        where = "a Gloo group of its own" if separate_group else "the default group"
        log.debug(
            "uneven inputs: on; the per-batch exchange runs on %s; "
            "UnevenMetricsCallback and UnevenBuffersCallback added",
            where,
        )

    @override
    def teardown(self) -> None:
        self._trainer = None
        if self._exchange is None:
            return
        log.debug("uneven inputs: releasing the exchange's group")
        self._exchange.close()
        self._model.buffers_from(0)
        self._exchange = self._model = None
        self._current = None

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Training: with different lengths on the ranks, an error now (or, when on, a loader that
        replays until every rank is out); validation, when on: the same."""
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.world_size < 2 or not dist.is_initialized():
            return dataloader
        training = trainer.state.stage == RunningStage.TRAINING
        if not training and self._exchange is None:
            return dataloader
        lengths = gather_lengths(dataloader)
        if self._exchange is None:
            check_equal_lengths(lengths, trainer.limit_train_batches)
            return dataloader
        known = None if None in lengths else max(lengths)  # type: ignore[type-var]
        kind = "train" if training else "val"
        log.debug("uneven inputs: %s loader wrapped (lengths per rank: %s)", kind, lengths)
        wrapper_type = SizedUnevenLoader if known is not None else UnevenLoader
        return wrapper_type(dataloader, self._exchange, kind, known)

    @override
    def batch_to_device(self, batch: Any) -> Any:
        """A batch is about to be taken: it is the next one its stage's loader yielded."""
        if self._exchange is None or self._trainer is None:
            return batch
        trainer = self._trainer
        # This batch's forward broadcasts the buffers of the freshest rank (every rank names the same:
        # the plans are agreed); then, in training, the ranks with a batch now are the freshest.
        self._model.buffers_from(self._freshest)
        if trainer.training:
            self._current = self._exchange.next_plan("train")
            if self._current is not None:
                present = [i for i, rank in enumerate(self._exchange.ranks) if rank not in self._current.ranks_out]
                self._freshest = present[0]
        elif trainer.validating or trainer.sanity_checking:
            self._current = self._exchange.next_plan("val")
        return batch

    def settle_buffers(self) -> None:
        """After an epoch's last training step, every rank takes the freshest rank's buffers, as
        torch's ``Join`` ends with the last rank's: what is checkpointed or evaluated next holds the
        statistics of the batches only some ranks had."""
        # Rank 0 took the last step: the next forward broadcasts its buffers anyway. No model: the fit
        # that added the callback has been torn down (Lightning keeps its callbacks).
        if self._model is not None and self._freshest != 0:
            self._model.replay_forward()  # the buffer broadcast a forward takes, from the freshest rank

    @property
    @override
    def joined(self) -> bool:
        """This rank has no batch of its own for the current step (it takes the step with the others)."""
        return self._current is not None and self._current.replay

    @override
    def training_step(self, step: Callable[[], Any]) -> Any:
        if self.joined:
            # No batch of this rank's: an output shaped like the others' (zeros), which Lightning
            # backpropagates through the strategy's `backward`, where the step's collectives are taken.
            return self._outputs.replayed(self._device)
        with self._user_step("training_step"):
            output = step()
        if self._exchange is not None:
            self._outputs.remember(output)  # the structure a replayed step's output copies
        return output

    @override
    def validation_step(self, step: Callable[[], Any]) -> Any:
        if self.joined:
            assert self._model is not None
            self._model.replay_forward()  # the buffer broadcast the forwards of the ranks with a batch take
            return None
        with self._user_step("validation_step"):
            return step()

    @contextmanager
    def _user_step(self, name: str) -> Iterator[None]:
        """The user's ``training_step``/``validation_step`` runs inside: its collectives are checked."""
        self._in_user_step = name
        try:
            yield
        finally:
            self._in_user_step = None

    @contextmanager
    @override
    def collective(self, name: str) -> Iterator[None]:
        """Raise if the user's step issues a collective that a rank without a batch cannot match."""
        plan = self._current
        if self._in_user_step is not None and plan is not None and plan.ranks_out:
            raise RuntimeError(
                f"lit_dp (uneven_inputs=True): {self._in_user_step} called strategy.{name} while rank(s) "
                f"{list(plan.ranks_out)} have run out of batches and do not run {self._in_user_step}: the collective "
                f"could never be matched. Instead, {REMEDY}."
            )
        yield

    @override
    def on_validation_end(self) -> None:
        if self._exchange is not None:
            self._exchange.reset("val")


class FabricUnevenInputs(Feature):
    """Uneven inputs in a Fabric loop: ``with fabric.strategy.join(model):`` (torch's ``Join``), exposed on the strategy."""

    exposes = {"join": None}  # built for every option: never off

    def join(
        self,
        module: torch.nn.Module,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> DataParallelJoin:
        """Train on uneven inputs in a hand-written loop: ``with fabric.strategy.join(model):``.

        ``model`` is what ``fabric.setup`` returned. Ranks that run out of batches shadow the
        others' synchronised steps until all have, then every rank holds the same parameters
        (``lit_dp.DataParallel.join``; the arguments are torch DDP's ``join``'s).
        """
        inner = forward_module(module)
        if not isinstance(inner, DataParallel):
            raise TypeError(
                f"fabric.strategy.join expects the module returned by fabric.setup (a lit_dp.DataParallel inside), "
                f"got {type(inner).__name__}."
            )
        return inner.join(divide_by_initial_world_size, enable, throw_on_early_termination)


class ReplayedOutputs:
    """What ``training_step`` returns on a replayed batch: the structure of this rank's last real
    output (a tensor, or a dict with ``"loss"`` and the user's other entries, nested as they
    were), every tensor zero, on its device, with its shape and dtype; the loss is a zero that
    requires grad, as a loss does. Lightning hands it to ``on_train_batch_end`` like any output,
    so a callback reading ``outputs["preds"]`` (or gathering it) runs on every rank; the zeros
    count nothing, like the metrics of ``UnevenMetricsCallback``.

    Before this rank's first real step (a rank with no batch at all), the output is a bare zero
    loss: the structure of a step nobody has returned yet cannot be known.
    """

    def __init__(self) -> None:
        self._template: Any = None  # the last real output, tensors as `_TensorLike`

    def remember(self, output: Any) -> None:
        """Learn the structure of a real ``training_step`` output (None, a skipped step, teaches nothing)."""
        if output is not None:
            self._template = apply_to_collection(output, Tensor, _TensorLike.of)

    def replayed(self, device: torch.device) -> Any:
        if self._template is None:
            return torch.zeros((), device=device, requires_grad=True)
        output = apply_to_collection(self._template, _TensorLike, _TensorLike.zeros)
        if isinstance(output, Tensor):
            return output.requires_grad_()
        if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
            output["loss"].requires_grad_()
        return output


@dataclasses.dataclass(frozen=True)
class _TensorLike:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: Tensor) -> _TensorLike:
        return cls(tensor.shape, tensor.dtype, tensor.device)

    def zeros(self) -> Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


class BatchExchange:
    """The ranks' per-batch exchange, shared by the wrapped loaders and ``UnevenMetricsCallback``.

    Args:
        group: where the exchange runs (a Gloo group: its tensors stay on the host).
        waiter: how its waits are made (the hang watchdog's, when on).
    """

    def __init__(self, group: dist.ProcessGroup | None, waiter: Waiter) -> None:
        self._group = group
        self._waiter = waiter
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self._plans: dict[str, deque[BatchPlan]] = {"train": deque(), "val": deque()}
        self.real_batches: dict[str, list[int]] = {"train": [], "val": []}
        self.on_exhausted: Callable[[str], None] | None = None  # called on every rank when a loader ends

    def close(self) -> None:
        """Let go of the group: the trainer's loaders outlive the fit and still reference this object,
        and a group kept alive keeps rank 0's rendezvous port bound."""
        self._group = None
        self._waiter = UNWATCHED

    def next_plan(self, kind: str) -> BatchPlan | None:
        """The plan of the next batch of ``kind`` ("train" or "val") taken, in the order the loader yielded them."""
        plans = self._plans[kind]
        return plans.popleft() if plans else None

    def reset(self, kind: str) -> None:
        """Forget the batches of ``kind`` not taken (an epoch cut short) and the counts of real ones.

        Training resets when its loader's iteration starts; validation when its run ends (its
        loaders' iterations start one after another within a run, with a batch prefetched ahead).
        """
        self._plans[kind].clear()
        self.real_batches[kind] = []

    def exchange(self, kind: str, has_batch: bool, needs_template: bool) -> tuple[list[bool], list[bool]]:
        """Which ranks have a batch, and which need one to replay (one all-reduce of 2 x world flags)."""
        world = len(self.ranks)
        flags = torch.zeros(2 * world, dtype=torch.int32)
        position = self.ranks.index(dist.get_rank())
        flags[position] = int(has_batch)
        flags[world + position] = int(needs_template)
        work = dist.all_reduce(flags, group=self._group, async_op=True)
        self._waiter.wait(work, f"the per-batch exchange of uneven inputs ({kind})")
        values = [bool(v) for v in flags.tolist()]
        return values[:world], values[world:]

    def share_template(self, batch: Any, has: list[bool], needs: list[bool]) -> Any:
        """The lowest rank with a batch sends it to the ranks that never had one (once per rank and stage)."""
        source = self.ranks[has.index(True)]
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

    def __init__(self, loader: object, exchange: BatchExchange, kind: str, length: int | None) -> None:
        self.loader = loader
        self._exchange = exchange
        self._kind = kind
        self._length = length
        self._template: Any = None
        self._has_template = False

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        exchange, kind = self._exchange, self._kind
        if kind == "train":
            exchange.reset(kind)
        iterator = iter(self.loader)  # type: ignore[call-overload]
        exhausted = False
        while True:
            batch = None
            if not exhausted:
                try:
                    batch = next(iterator)
                except StopIteration:
                    exhausted = True
            has, needs = exchange.exchange(kind, not exhausted, exhausted and not self._has_template)
            if not any(has):
                if exchange.on_exhausted is not None:
                    exchange.on_exhausted(kind)
                return
            if any(needs):
                shared = exchange.share_template(batch, has, needs)
                if not self._has_template:
                    self._template, self._has_template = shared, True
            if not exhausted:
                self._template, self._has_template = batch, True
            ranks_out = tuple(rank for rank, present in zip(exchange.ranks, has) if not present)
            exchange.record(kind, BatchPlan(replay=exhausted, ranks_out=ranks_out), has)
            yield batch if not exhausted else self._template


class SizedUnevenLoader(UnevenLoader):
    """An ``UnevenLoader`` over loaders whose lengths every rank knows: its length is the longest."""

    def __len__(self) -> int:
        assert self._length is not None
        return self._length


class UnevenBuffersCallback(Callback):
    """Calls ``UnevenInputs.settle_buffers`` after each epoch's last training batch, where every rank is
    (training prefetches: the loader's end comes before the last step)."""

    def __init__(self, uneven: UnevenInputs) -> None:
        self._uneven = uneven

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._uneven.settle_buffers()


class UnevenMetricsCallback(Callback):
    """Gives a rank that had no batch of its own the sync_dist entries the others logged, with
    values that change no reduction (0 with a batch size of 0 for means and sums, -inf for max,
    +inf for min), so the epoch-level reductions meet on every rank instead of hanging.

    It acts where every rank is at once and before Lightning reduces: at the exchange that ends
    a loader (validation fetches without prefetching, so its steps are done by then), and at
    the batch Lightning marks last (training prefetches: the exchange runs before the last step,
    whose first logs a rank with a single batch has not made yet). Acting twice adds nothing.
    """

    def __init__(self, exchange: BatchExchange, trainer: pl.Trainer) -> None:
        self._exchange = exchange
        self._trainer = trainer
        exchange.on_exhausted = self._align

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._align("train")

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.val_loop.batch_progress.is_last_batch:
            self._align("val")

    def _align(self, kind: str) -> None:
        counts = self._exchange.real_batches[kind]
        results = logged_results(self._trainer)
        if not counts or all(counts) or results is None:
            return  # every rank logged from its own steps
        entries = synced_epoch_metrics(results)
        gathered: list[Any] = [None] * len(counts)
        with self._exchange.watched("the exchange of logged metrics (uneven inputs)"):
            dist.all_gather_object(gathered, entries)
        if counts[self._exchange.ranks.index(dist.get_rank())]:
            return
        donor = next(entries for entries, count in zip(gathered, counts) if count)
        for key, fields in donor:
            if key in results and not results[key].has_reset:
                continue  # given at an earlier call
            add_synced_metric(results, key, fields, self._trainer.strategy.reduce, self._trainer.strategy.root_device)


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
    effective = [parse_num_batches(RunningStage.TRAINING, length, limit) for length in lengths]  # type: ignore[arg-type]
    if len(set(effective)) < 2:
        return
    listed = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(effective))
    raise ValueError(
        f"lit_dp: the ranks' training dataloaders have different numbers of batches ({listed}), so the ranks with "
        "more would wait forever for the others in an all-reduce. Pass PaddleDPStrategy(uneven_inputs=True) "
        "(strategy.uneven_inputs=true in a recipe) to let a rank that runs out take the remaining steps without "
        "data, or give every rank the same number of batches (use_distributed_sampler=True does)."
    )
