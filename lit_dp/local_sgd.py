"""``lit_dp.LocalSGD``: ranks step on their own gradients and average their models periodically.

Paddle's collective ``LocalSGD`` mode (fleet's ``localsgd`` and ``adaptive_localsgd`` meta
optimizers) for torch modules, usable without Lightning::

    model = lit_dp.DataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local_sgd = lit_dp.LocalSGD(model, local_steps=8, warmup_steps=100)
    for inputs, targets in loader:
        loss = criterion(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        local_sgd.step(loss)          # one call after each optimizer step
    local_sgd.finish()                # every rank now holds the same model

Schedule: the first ``warmup_steps`` (W) optimizer steps are ordinary data-parallel steps.
After that ``DataParallel`` stops all-reducing gradients (no ``no_sync`` needed), each rank
steps on its own gradients, and the models are averaged after every ``local_steps``-th (K-th)
local step counted from the end of warm-up: after optimizer steps W+K, W+2K, ... ``finish()``
averages once more unless the last step just did. Optimizer state is never communicated.

Averaging, as Paddle does it: each rank keeps a snapshot ``s`` of the last averaged parameters
and all-reduces the delta ``s - p`` (small numbers, so the sum rounds less than a sum of the
parameters themselves), then sets ``p = s - mean(delta)``, which is the mean of the ranks'
parameters, and takes it as the next snapshot. Floating-point buffers (BatchNorm's running
statistics) are averaged directly; other buffers (BatchNorm's ``num_batches_tracked``) are
taken from the group's first rank. Tensors travel coalesced in buckets of ``comm_buffer_size``
MB (``lit_dp.assign_group_by_size``), the buckets spread over the reducer's rings and all
launched before any is awaited.

Adaptive (``adaptive=True``, Paddle's ``AdaptiveLocalSGDOptimizer``, after Wang & Joshi,
"Adaptive Communication Strategies to Achieve the Best Error-Runtime Trade-off in Local-Update
SGD", 2019): at each average the next period becomes
``clip(ceil(sqrt(lr_0 * loss / (lr * loss_0) * K)), min_local_steps, max_local_steps)``
where ``loss_0`` and ``lr_0`` are the mean training loss and the learning rate at the first
step and ``loss``/``lr`` those at the average. Loss and learning rate are averaged over the
ranks by one all-reduce before the rule is applied, so every rank computes the same period.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lit_dp import join
from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.broadcast import ddp_ignored, synced_buffers, synced_parameters
from lit_dp.gradients.buckets import assign_group_by_size, megabytes_to_bytes
from lit_dp.gradients.waiting import UNWATCHED, Waiter
from lit_dp.job.process_group import get_rings
from lit_dp.options import DEFAULT_BUCKET_MB

# Paddle's AdaptiveLocalSGDOptimizer bounds the period to [1, 16].
ADAPTIVE_MIN_LOCAL_STEPS = 1
ADAPTIVE_MAX_LOCAL_STEPS = 16

_DELTA, _MEAN, _FROM_FIRST_RANK = "delta", "mean", "from_first_rank"


def _check_count(option: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{option}={value!r} is invalid: expected an integer >= {low}.")


class LocalSGD:
    """Periodic model averaging after ``warmup_steps`` data-parallel steps (see the module docstring).

    Args:
        module: the model; when it is a ``lit_dp.DataParallel``, its gradient communication is
            switched off for the local phase. Every rank must hold the same parameters when the
            local phase starts (DataParallel's construction and warm-up guarantee it).
        local_steps: K, local optimizer steps between averages (the first period when adaptive).
        warmup_steps: W, ordinary data-parallel optimizer steps before the local phase.
        adaptive: recompute the period at each average from the loss and learning rate.
        min_local_steps, max_local_steps: bounds of the adaptive period.
        comm_buffer_size: bucket size limit of the averaging all-reduce, MB.
        group: the process group; defaults to the ``DataParallel``'s (``module.rings``), or for
            another module to the rings of ``init_parallel_env``.
    """

    def __init__(
        self,
        module: nn.Module,
        local_steps: int,
        warmup_steps: int = 0,
        adaptive: bool = False,
        min_local_steps: int = ADAPTIVE_MIN_LOCAL_STEPS,
        max_local_steps: int = ADAPTIVE_MAX_LOCAL_STEPS,
        comm_buffer_size: float = DEFAULT_BUCKET_MB,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_count("local_steps", local_steps, 1)
        _check_count("warmup_steps", warmup_steps, 0)
        _check_count("min_local_steps", min_local_steps, 1)
        if not min_local_steps <= max_local_steps:
            raise ValueError(
                f"min_local_steps={min_local_steps!r}, max_local_steps={max_local_steps!r} are invalid: "
                "expected 1 <= min_local_steps <= max_local_steps."
            )
        if isinstance(module, DataParallel) and module.sharding_stage is not None:
            raise ValueError(
                f"lit_dp.LocalSGD with a DataParallel built with sharding_stage={module.sharding_stage} is invalid: "
                "LocalSGD steps every rank's optimizer on its own gradients, sharding steps each parameter on one "
                "rank only; expected one of them."
            )
        self._data_parallel = module if isinstance(module, DataParallel) else None
        self._warmup_steps = warmup_steps
        self._initial_local_steps = local_steps
        self._adaptive = adaptive
        self._bounds = (min_local_steps, max_local_steps)
        if group is not None:
            self._rings = [group]
        else:  # the model's own communicators (its process_group), else those of init_parallel_env
            self._rings = module.rings if isinstance(module, DataParallel) else get_rings()
        self._world_size = dist.get_world_size(self._rings[0]) if self._rings else 1
        self._first_rank = dist.get_process_group_ranks(self._rings[0])[0] if self._rings else 0
        self._bucket_bytes = megabytes_to_bytes("comm_buffer_size", comm_buffer_size)
        inner = module.module if isinstance(module, DataParallel) else module
        # What the model keeps equal across ranks: DDP's ignore list, read when the model was wrapped.
        ignore = module.parameters_to_ignore if isinstance(module, DataParallel) else ddp_ignored(inner)
        self._params = [p for _, p in synced_parameters(inner, ignore) if p.requires_grad]
        self._buffers = [buffer for _, buffer in synced_buffers(inner, ignore)]
        self._buckets: list[_Bucket] | None = None  # built when the local phase starts
        self._step = 0
        self._last_average = warmup_steps
        self._local_steps = local_steps
        self._loss_0: float | None = None
        self._lr_0: float | None = None
        if self._data_parallel is not None:
            # The model synchronises gradients during warm-up only, and under Join a rank that ran
            # out shadows this object's collectives too (lit_dp.join).
            self._data_parallel.use_local_sgd(self)
        self._snapshot_when_local()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (``step()`` calls)."""
        return self._step

    @property
    def local_steps(self) -> int:
        """The current period K (changes only when adaptive)."""
        return self._local_steps

    @property
    def last_average(self) -> int:
        """The step after which the models were last averaged (W before the first average)."""
        return self._last_average

    @property
    def in_local_phase(self) -> bool:
        """Whether warm-up is over: gradients stay local, models are averaged periodically."""
        return self._step >= self._warmup_steps

    def step(self, loss: torch.Tensor | float | None = None, lr: float | None = None, *, joined: bool = False) -> bool:
        """Count one optimizer step; average the models when the schedule says so. Returns whether it did.

        ``loss`` (this rank's training loss) and ``lr`` are required when adaptive. ``joined``:
        this rank ran out of batches and takes the step with the others (the Trainer's uneven
        inputs): its loss does not count in the adaptive period's mean.
        """
        self._step += 1
        agree_first = self._adaptive and self._loss_0 is None
        average = self._step > self._warmup_steps and self._step - self._last_average == self._local_steps
        if (agree_first or average) and self._data_parallel is not None:
            join.notify(self._data_parallel, (agree_first, average))
        if agree_first:
            self._loss_0, self._lr_0 = self._agreed_loss_and_lr(loss, lr, counts=not joined)
        if average:
            self._average()
            if self._adaptive:
                self._local_steps = self._next_period(*self._agreed_loss_and_lr(loss, lr, counts=not joined))
        self._snapshot_when_local()
        return average

    def shadow_step(self, agree_first: bool, average: bool) -> None:
        """The collectives of a ``step()`` that the ranks still in take, on a rank that joined
        (``lit_dp.join``): its model takes part in the average as it stands, its loss does not count."""
        if agree_first:
            self._loss_0, self._lr_0 = self._agreed_loss_and_lr(None, None, counts=False)
        if average:
            self._average()
            if self._adaptive:
                self._local_steps = self._next_period(*self._agreed_loss_and_lr(None, None, counts=False))

    def adopt_schedule_of(self, src: int) -> None:
        """Take global rank ``src``'s schedule (after a Join, whose ranks counted different steps);
        every rank must call it, with parameters already equal on all ranks."""
        if self._world_size < 2:
            return
        schedule = [self.state_dict()]
        with self._waiter.outside("the broadcast of the LocalSGD schedule"):
            dist.broadcast_object_list(schedule, src=src, group=self._rings[0])
        self.load_state_dict(schedule[0])

    def finish(self) -> None:
        """Average once more if any local step was taken since the last average (call when training ends)."""
        if self._step > max(self._last_average, self._warmup_steps):
            self._average()

    def _average(self) -> None:
        """Replace every rank's parameters and buffers by their mean over the ranks."""
        self._last_average = self._step
        if self._world_size < 2:
            return
        if self._buckets is None:
            self._buckets = self._build_buckets()
        with torch.no_grad():
            for bucket in self._buckets:
                bucket.start(self._first_rank)
            for bucket in self._buckets:
                bucket.finish(self._world_size, self._waiter)

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state (no tensors): save it with a checkpoint so a resumed run averages at the same steps."""
        return {
            "step": self._step,
            "last_average": self._last_average,
            "local_steps": self._local_steps,
            "loss_0": self._loss_0,
            "lr_0": self._lr_0,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedule and snapshot the parameters as they are now (equal on every rank after a resume).

        A fixed period is this object's own ``local_steps``, so a run may resume with another K;
        an adaptive period continues from the saved one.
        """
        self._step = int(state["step"])
        self._last_average = int(state["last_average"])
        self._local_steps = int(state["local_steps"]) if self._adaptive else self._initial_local_steps
        self._loss_0 = state.get("loss_0")
        self._lr_0 = state.get("lr_0")
        self._buckets = None
        self._snapshot_when_local()

    def _snapshot_when_local(self) -> None:
        if self.in_local_phase and self._buckets is None and self._world_size > 1:
            # The snapshot must be taken while every rank holds the same parameters: now.
            self._buckets = self._build_buckets()

    def _build_buckets(self) -> list[_Bucket]:
        float_buffers = [b for b in self._buffers if b.is_floating_point()]
        other_buffers = [b for b in self._buffers if not b.is_floating_point()]
        buckets = []
        for kind, tensors in ((_DELTA, self._params), (_MEAN, float_buffers), (_FROM_FIRST_RANK, other_buffers)):
            if not tensors:
                continue
            for indices in assign_group_by_size(tensors, [False] * len(tensors), [self._bucket_bytes]):
                ring = self._rings[len(buckets) % len(self._rings)]
                buckets.append(_Bucket(kind, [tensors[i] for i in indices], ring))
        return buckets

    @property
    def _waiter(self) -> Waiter:
        return self._data_parallel.waiter if self._data_parallel is not None else UNWATCHED

    def _agreed_loss_and_lr(
        self, loss: torch.Tensor | float | None, lr: float | None, counts: bool = True
    ) -> tuple[float, float]:
        """The mean loss and learning rate of the ranks that ``counts`` (one all-reduce of
        weighted sums), the same on every rank."""
        if counts and (loss is None or lr is None):
            raise ValueError(
                f"LocalSGD(adaptive=True).step(loss={loss!r}, lr={lr!r}): expected this rank's training loss "
                "and the learning rate, from which the next averaging period is computed."
            )
        device = self._params[0].device if self._params else torch.device("cpu")
        weighted = [float(loss), float(lr), 1.0] if counts else [0.0, 0.0, 0.0]  # type: ignore[arg-type]
        values = torch.tensor(weighted, dtype=torch.float64, device=device)
        if self._world_size > 1:
            work = dist.all_reduce(values, group=self._rings[0], async_op=True)
            self._waiter.wait(work, "LocalSGD's agreement on the loss and learning rate")
        loss_sum, lr_sum, ranks = values.tolist()
        return loss_sum / ranks, lr_sum / ranks

    def _next_period(self, loss: float, lr: float) -> int:
        assert self._loss_0 is not None and self._lr_0 is not None
        if self._loss_0 <= 0 or loss < 0 or lr <= 0:
            raise ValueError(
                f"adaptive LocalSGD needs a positive training loss and learning rate: got loss_0={self._loss_0}, "
                f"loss={loss}, lr={lr} (averaged over the ranks)."
            )
        period = math.ceil(math.sqrt(self._lr_0 * loss / (lr * self._loss_0) * self._initial_local_steps))
        low, high = self._bounds
        return min(max(period, low), high)


class _Bucket:
    """Tensors of one dtype and device averaged (or broadcast) as one flat buffer."""

    def __init__(self, kind: str, tensors: list[torch.Tensor], ring: dist.ProcessGroup) -> None:
        self.kind = kind
        self.tensors = tensors
        self.ring = ring
        self.numels = [t.numel() for t in tensors]
        self.flat = torch.empty(sum(self.numels), dtype=tensors[0].dtype, device=tensors[0].device)
        self.snapshot = self._gather().clone() if kind == _DELTA else None
        self.work: dist.Work | None = None

    def _gather(self) -> torch.Tensor:
        torch.cat([t.detach().reshape(-1) for t in self.tensors], out=self.flat)
        return self.flat

    def start(self, first_rank: int) -> None:
        flat = self._gather()
        if self.kind == _FROM_FIRST_RANK:
            self.work = dist.broadcast(flat, src=first_rank, group=self.ring, async_op=True)
            return
        if self.snapshot is not None:
            torch.sub(self.snapshot, flat, out=flat)  # the delta: snapshot - parameters
        self.work = dist.all_reduce(flat, group=self.ring, async_op=True)

    def finish(self, world_size: int, waiter: Waiter) -> None:
        assert self.work is not None, "finish() before start()"
        waiter.wait(self.work, "the LocalSGD average")
        self.work = None
        result = self.flat
        if self.snapshot is not None:
            # snapshot - mean(delta): the mean of the ranks' parameters, and the next snapshot.
            # One pass: scaling inside the subtraction (alpha) instead of dividing first.
            result = self.snapshot.sub_(result, alpha=1.0 / world_size)
        elif self.kind == _MEAN:
            result.div_(world_size)
        pieces = result.split(self.numels)
        torch._foreach_copy_([t.detach() for t in self.tensors], [p.view_as(t) for p, t in zip(pieces, self.tensors)])
