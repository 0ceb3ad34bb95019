"""``comm_buffer_size="auto"``: choose the bucket size by timing the first steps of training.

The schedule. Training starts with the default buckets; after the first step the reducer
rebuilds them in gradient-ready order, and tuning begins. The candidates are ``CANDIDATES_MB``
(1 to 100 MB); one that gives the same buckets as a smaller one is dropped without spending a
step (on a model of a few MB most coincide). The remaining candidates are tried in passes
(A B C A B C ..., so that drift on a busy machine hits them alike); each time the buckets are
rebuilt with it, one step is left to warm up (new buffers), then ``MEASURE_STEPS`` steps are
timed, each from one forward's end to the next's, i.e. a whole training iteration. The passes
fill a budget of ``TUNING_STEPS`` steps, at least ``MIN_PASSES`` of them: the fewer the
distinct candidates, the more steps each gets, since single steps vary far more than the few
percent that separate sizes worth telling apart. Every rank then holds, per candidate, the mean
of its timed steps without the fastest and the slowest eighth: the typical step, which is what
a bucket size changes, unmoved by a lone spike (a collection pause, another process). Not the
fastest step: that is the one where communication happened to interfere least with compute,
nearly the same for every size on a shared CPU; not the median either, which ranked close sizes
wrongly more often in recorded tuning runs (docs/benchmarks.md, "Autotune against the best
fixed size", has the measurements behind these choices). An all-reduce (MAX) gives the time as
the slowest rank saw it (a data-parallel step is as slow as its slowest rank), rank 0 takes the
fastest candidate (the smallest size on a tie) and broadcasts it, and every rank rebuilds its
buckets with that size at the same step. Cost: ``TUNING_STEPS`` = 120 steps or fewer (105 with
all 7 candidates distinct), and none at all on a model whose buckets are the same for every
candidate.

Horovod's autotune, the anchor, samples its fusion-buffer size and cycle time with Bayesian
optimisation: by default 3 warm-up samples and up to 20 more, each over 10 steps (about 230
steps); it can afford to because it tunes two parameters in a continuous range. Only the
bucket partition matters here, and it changes at a handful of sizes, so timing each distinct
partition directly is both cheaper and exhaustive over the schedule.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from lit_dp.gradients.buckets import megabytes_to_bytes
from lit_dp.gradients.events import ReducerObserver
from lit_dp.gradients.plan import StepPlan
from lit_dp.gradients.reducer import Reducer
from lit_dp.observability.clocks import clock_for

CANDIDATES_MB = (1, 2, 5, 10, 25, 50, 100)
WARMUP_STEPS = 1
MEASURE_STEPS = 4
TUNING_STEPS = 120
MIN_PASSES = 2


def settled_step() -> int:
    """The first synchronised step whose buckets are final, at the latest: step 0 runs in
    registration order, the tuning steps follow, and the deciding step runs with the choice."""
    window = WARMUP_STEPS + MEASURE_STEPS
    return 1 + max(TUNING_STEPS, MIN_PASSES * len(CANDIDATES_MB) * window)


def _trimmed_mean(values: Sequence[float]) -> float:
    """The mean without the smallest and the largest eighth of ``values``."""
    cut = len(values) // 8
    return statistics.mean(sorted(values)[cut : len(values) - cut])


class BucketAutotuner(ReducerObserver):
    """Drives the schedule above from ``reducer``'s step starts; subscribes itself.

    It changes the buckets only by asking ``reducer.request_bucket_limits``, at a step start,
    which the reducer applies before it arms that step.

    Args:
        reducer: the reducer to tune; its group decides together.
        device: where the collectives' tensors live (the parameters' device).
        last_bucket_bytes: the last bucket's limit, kept as configured.
    """

    def __init__(self, reducer: Reducer, device: torch.device, last_bucket_bytes: int) -> None:
        self._reducer = reducer
        self._group = reducer.group
        self._device = device
        self._clock = clock_for(device)
        self._last_bytes = last_bucket_bytes
        # The module's schedule, read now (not bound at import) so that it can be changed in one place.
        self._candidates = list(CANDIDATES_MB)
        self._warmup = WARMUP_STEPS
        self._window = WARMUP_STEPS + MEASURE_STEPS
        self._budget = TUNING_STEPS
        self._passes = MIN_PASSES
        self._distinct: list[float] | None = None  # candidates giving distinct buckets, first of each
        self._marks: list[list[Any]] = []  # step-start marks per window (candidate k in window k % distinct)
        self._window_start = 0
        self._chosen: float | None = None
        self._sweep: dict[float, float] = {}
        reducer.add_observer(self)

    @property
    def chosen_mb(self) -> float | None:
        """The size every rank adopted; None while tuning."""
        return self._chosen

    @property
    def sweep(self) -> dict[float, float]:
        """Per distinct candidate tried, the typical step time (ms) as the slowest rank saw it, once decided."""
        return dict(self._sweep)

    @property
    def tuning_steps(self) -> int:
        """Steps the schedule takes: a window per distinct candidate and pass (0 when there is only one)."""
        distinct = len(self._distinct or [])
        return self._passes * distinct * self._window if distinct > 1 else 0

    @override
    def step_started(self, step: int, plan: StepPlan) -> None:
        """Every rank sees the same steps, so every rank switches together."""
        if self._chosen is not None or step == 0:
            return  # step 0 runs before the ready-order rebuild
        mark = self._clock.mark()
        if self._distinct is None:
            self._distinct = self._distinct_candidates()
            if len(self._distinct) == 1:
                self._adopt(self._distinct[0])
                return
            self._passes = max(MIN_PASSES, self._budget // (len(self._distinct) * self._window))
        else:
            self._marks[-1].append(mark)
            if step - self._window_start < self._window:
                return
        if len(self._marks) < self._passes * len(self._distinct):
            candidate = self._distinct[len(self._marks) % len(self._distinct)]
            self._reducer.request_bucket_limits(megabytes_to_bytes("comm_buffer_size", candidate), self._last_bytes)
            self._marks.append([mark])
            self._window_start = step
            return
        self._decide()

    def _distinct_candidates(self) -> list[float]:
        """The first candidate of each distinct bucket partition (the same computation on every rank)."""
        distinct: dict[str, float] = {}
        for candidate in self._candidates:
            partition = self._reducer.partition(megabytes_to_bytes("comm_buffer_size", candidate), self._last_bytes)
            distinct.setdefault(repr(partition), candidate)
        return list(distinct.values())

    def _decide(self) -> None:
        assert self._distinct is not None
        steps: list[list[float]] = [[] for _ in self._distinct]
        for window, marks in enumerate(self._marks):
            measured = marks[self._warmup :]
            steps[window % len(self._distinct)] += [
                self._clock.elapsed_ms(a, b) for a, b in zip(measured, measured[1:])
            ]
        # Each candidate's typical step on this rank, then the slowest rank's (every rank waits for it).
        times = [_trimmed_mean(candidate_steps) for candidate_steps in steps]
        slowest = torch.tensor(times, dtype=torch.float64, device=self._device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self._group)
        # Every rank now holds the same times; rank 0's choice is broadcast all the same, so that
        # a tie broken differently on some rank could never split the job.
        choice = torch.tensor([int(torch.argmin(slowest))], device=self._device)  # first minimum: the smallest
        dist.broadcast(choice, src=dist.get_global_rank(self._group, 0), group=self._group)
        self._sweep = dict(zip(self._distinct, slowest.tolist()))
        self._adopt(self._distinct[int(choice.item())])

    def adopt(self, megabytes: float) -> None:
        """Stop tuning and use ``megabytes`` from the next step on: a size chosen before (a checkpoint's,
        which every rank loads alike; every rank of the group must adopt the same)."""
        self._chosen = megabytes
        self._reducer.request_bucket_limits(megabytes_to_bytes("comm_buffer_size", megabytes), self._last_bytes)

    def _adopt(self, megabytes: float) -> None:
        """``adopt`` the size this tuning chose, and say so on rank 0."""
        self.adopt(megabytes)
        limit = megabytes_to_bytes("comm_buffer_size", megabytes)
        if dist.get_rank() != 0:
            return
        if self._sweep:
            swept = ", ".join(f"{mb:g} MB {ms:.2f} ms" for mb, ms in self._sweep.items())
            detail = f"after {self.tuning_steps} tuning steps (typical step, slowest rank: {swept})"
        else:
            detail = f"without tuning: every candidate of {list(self._candidates)} MB gives the same buckets"
        buckets = len(self._reducer.partition(limit, self._last_bytes))
        print(f"[lit_dp] comm_buffer_size=auto chose {megabytes:g} MB {detail}; {buckets} bucket(s)", flush=True)
