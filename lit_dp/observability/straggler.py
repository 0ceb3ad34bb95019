"""Which rank is slow, by how much, and where its time goes: the straggler report (``straggler.every_n_steps``).

Every ``every_n_steps`` synchronised steps (a window) each rank reads its own ``StepTimes`` from
the step clock (``lit_dp.observability.step_clock``: data wait, compute, exposed wait, optimizer
step, ms per step) and the ranks exchange them in one all-gather of 9 numbers each, started
without waiting and read when the step's buckets are done (``lit_dp.observability.exchange``).
Every rank then judges the window alike (``judge``):

- a rank's *own* time per step is data + compute + optimizer; its exposed wait is time spent
  waiting for the others (a straggler's own time is long and its wait short, the others' the
  reverse, whichever collective they meet it at: the buckets, ``sync_dist``, a buffer broadcast);
- the slowest rank is the one with the most own time; its **lag** is that minus the median own
  time of the other ranks, and its **cause** is ``data`` or ``compute`` (the optimizer step
  included), whichever exceeds the others' median by more;
- it **lags** in that window when the lag is at least ``LAG_SHARE`` of the step *and* at least
  ``LAG_MS``: the floor keeps a few milliseconds of scheduling noise from counting on a short
  step, where they are a large share of it; the share keeps a lag that hardly slows a long step
  from counting;
- after ``ALARM_WINDOWS`` windows in a row in which the same rank lags for the same cause, the
  group's first rank prints a ``[lit_dp] straggler:`` line naming it, its lag and the cause. One
  slow window (a collection pause, a checkpoint, another job's burst) never does.

Only ranks that took every step of the window with a batch of their own are compared: a rank
that ran out of data (Join's shadow, the Trainer's replay of uneven inputs) is idle, not fast.
The first window starts at step 1: step 0 rebuilds the buckets and warms up. Why these
thresholds, and what they missed and caught on this project's machines: docs/observability.md.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from typing_extensions import override

from lit_dp.gradients.events import ReducerObserver
from lit_dp.gradients.plan import StepPlan
from lit_dp.gradients.waiting import Waiter
from lit_dp.observability.exchange import Exchange
from lit_dp.observability.step_clock import StepClock, StepTimes

log = logging.getLogger(__name__)

# A lag counts when it is at least this share of the step and at least LAG_MS. In 165 windows of
# 10 steps of healthy runs (2 and 3 Gloo ranks, steps of 2 to 9 ms, on this project's 2-core
# machine while other jobs loaded it 4 to 7 times over) the largest lag was 5.6 ms and the
# largest share 0.61 (of a 2 ms step): the share alone would raise false alarms on short steps,
# the floor is twice the worst lag seen; a lag over both costs the job a quarter of its time.
LAG_SHARE = 0.25
LAG_MS = 10.0
# Windows in a row in which the same rank lagged for the same cause before the line is printed:
# noise lags now one rank, now the other, for either cause; a fault, always the same. With
# windows of 5 steps, 2 of 177 healthy windows passed both thresholds (12.7 ms, 0.53 of a
# 10 ms step, under a load of 5), never two in a row.
ALARM_WINDOWS = 3
CAUSES = ("data", "compute")


@dataclass(frozen=True)
class WindowReport:
    """One window as every rank judged it (ms per step)."""

    first_step: int  # the synchronised steps the window covers, first and last
    last_step: int
    ranks: tuple[int, ...]  # global ranks, in the group's order
    times: tuple[StepTimes, ...]  # each rank's, same order
    slowest: int | None  # the global rank with the most own time; None with fewer than 2 ranks to compare
    lag_ms: float  # its own time minus the median of the others'
    step_ms: float  # the median step time
    data_lag_ms: float  # its data wait minus the others' median
    compute_lag_ms: float  # its compute and optimizer step minus the others' median
    cause: str  # "data" or "compute"
    lagging: bool  # the lag passes both thresholds in this window

    @property
    def lag_share(self) -> float:
        return self.lag_ms / self.step_ms if self.step_ms > 0 else 0.0

    def times_of(self, rank: int) -> StepTimes:
        return self.times[self.ranks.index(rank)]

    def others(self, field: str) -> float:
        """The median of ``field`` over the compared ranks but the slowest."""
        others = [times for rank, times in zip(self.ranks, self.times) if rank != self.slowest and _compared(times)]
        return _median([getattr(times, field) for times in others])

    def as_metrics(self) -> dict[str, float]:
        """The ``straggler/*`` names the Trainer's loggers get."""
        if self.slowest is None:
            return {}
        slowest = self.times_of(self.slowest)
        metrics = {
            "straggler/slowest_rank": float(self.slowest),
            "straggler/lag_ms": self.lag_ms,
            "straggler/lag_share": self.lag_share,
            "straggler/lagging": float(self.lagging),
            "straggler/step_ms": self.step_ms,
            "straggler/data_lag_ms": self.data_lag_ms,
            "straggler/compute_lag_ms": self.compute_lag_ms,
        }
        for field in ("data_ms", "compute_ms", "exposed_ms", "optimizer_ms"):
            metrics[f"straggler/slowest_{field}"] = getattr(slowest, field)
            metrics[f"straggler/others_{field}"] = self.others(field)
        return metrics

    def describe(self) -> str:
        """The lag and where the slowest rank's time went, against the others' medians."""
        slowest = self.times_of(self.slowest)
        return (
            f"rank {self.slowest} lags the others by {self.lag_ms:.1f} ms per step ({self.lag_share:.0%} of the "
            f"{self.step_ms:.1f} ms step): {self.cause} (data wait {slowest.data_ms:.1f} ms per step against "
            f"{self.others('data_ms'):.1f} ms on the others, compute {slowest.compute_ms:.1f} against "
            f"{self.others('compute_ms'):.1f} ms, optimizer step {slowest.optimizer_ms:.1f} against "
            f"{self.others('optimizer_ms'):.1f} ms; the others waited {self.others('exposed_ms'):.1f} ms per step "
            "in collectives)"
        )


def judge(ranks: Sequence[int], times: Sequence[StepTimes]) -> WindowReport:
    """The window's verdict from every rank's times (see the module docstring)."""
    compared = [(rank, t) for rank, t in zip(ranks, times) if _compared(t)]
    verdict = dict(slowest=None, lag_ms=0.0, step_ms=0.0, data_lag_ms=0.0, compute_lag_ms=0.0, cause="", lagging=False)
    if len(compared) >= 2:
        slowest, mine = max(compared, key=lambda item: (_own(item[1]), -item[0]))
        others = [t for rank, t in compared if rank != slowest]
        step_ms = _median([t.step_ms for _, t in compared])
        lag = _own(mine) - _median([_own(t) for t in others])
        data_lag = mine.data_ms - _median([t.data_ms for t in others])
        compute_lag = _busy(mine) - _median([_busy(t) for t in others])
        verdict = dict(
            slowest=slowest,
            lag_ms=lag,
            step_ms=step_ms,
            data_lag_ms=data_lag,
            compute_lag_ms=compute_lag,
            cause=CAUSES[0] if data_lag >= compute_lag else CAUSES[1],
            lagging=lag >= LAG_MS and lag >= LAG_SHARE * step_ms,
        )
    first_step, last_step = times[0].first_step, times[0].last_step  # the same on every rank
    return WindowReport(first_step=first_step, last_step=last_step, ranks=tuple(ranks), times=tuple(times), **verdict)


def _compared(times: StepTimes) -> bool:
    return times.steps > 0 and times.with_batch == times.steps


def _own(times: StepTimes) -> float:
    return times.data_ms + times.compute_ms + times.optimizer_ms


def _busy(times: StepTimes) -> float:
    return times.compute_ms + times.optimizer_ms


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


class Streak:
    """Consecutive windows in which the same rank lagged for the same cause; ``see`` says when the
    line is due: once per streak, when it reaches ``windows`` windows."""

    def __init__(self, windows: int = ALARM_WINDOWS) -> None:
        self.windows = windows
        self.reports: list[WindowReport] = []
        self._told = False

    def see(self, report: WindowReport) -> bool:
        """Count ``report``; whether the line is due now."""
        last = self.reports[-1] if self.reports else None
        if not report.lagging or (last is not None and (last.slowest, last.cause) != (report.slowest, report.cause)):
            self.reports, self._told = [], False
        if not report.lagging:
            return False
        self.reports.append(report)
        due = len(self.reports) >= self.windows and not self._told
        self._told = self._told or due
        return due


class StragglerReport(ReducerObserver):
    """Closes a window every ``every_n_steps`` synchronised steps, exchanges and judges it.

    ``last`` is the latest window judged; ``windows`` counts them; ``lagged`` counts the windows
    in which some rank lagged; ``alarms`` the streaks that raised the line (on every rank; the
    group's first prints it). Subscribe it after ``clock``.
    """

    def __init__(
        self, clock: StepClock, group: dist.ProcessGroup, waiter: Waiter, device: torch.device, every_n_steps: int
    ) -> None:
        self._clock = clock
        self._group = group
        self._device = device
        self._every = every_n_steps
        self._ranks = tuple(dist.get_process_group_ranks(group))
        self._first_rank = group.rank() == 0
        self._exchange = Exchange(group, waiter, "the straggler report's exchange", self._judge)
        self._opened_at: int | None = None  # the step the running window started at (None before the first)
        self.last: WindowReport | None = None
        self.windows = 0
        self.lagged = 0
        self.alarms = 0
        self.worst: WindowReport | None = None  # the window with the largest lag
        self._streak = Streak()

    @property
    def every_n_steps(self) -> int:
        return self._every

    @override
    def step_started(self, step: int, plan: StepPlan) -> None:
        self._exchange.poll()
        if step == 0 or (self._opened_at is not None and step % self._every):
            return
        times = self._clock.close_window()
        self._opened_at = step
        if times is not None:
            self._exchange.start(torch.tensor(times.as_row(), dtype=torch.float64, device=self._device), None)

    @override
    def step_ended(self, step: int) -> None:
        self._exchange.poll()

    def _judge(self, _tag: None, rows: torch.Tensor) -> None:
        report = judge(self._ranks, [StepTimes.from_row(row) for row in rows.tolist()])
        self.last = report
        self.windows += 1
        if report.slowest is not None and (self.worst is None or report.lag_ms > self.worst.lag_ms):
            self.worst = report
        log.debug("lit_dp straggler report: steps %d-%d: %s", report.first_step, report.last_step, report)
        self.lagged += report.lagging
        if self._streak.see(report):
            self.alarms += 1
            if self._first_rank:
                print(f"[lit_dp] straggler: {self.alarm()}", flush=True)

    def alarm(self) -> str:
        """The line for the current streak: the latest window, and how long the rank has lagged."""
        reports = self._streak.reports
        return (
            f"{reports[-1].describe()}; {len(reports)} windows of {self._every} steps in a row "
            f"(steps {reports[0].first_step}-{reports[-1].last_step})"
        )

    def summary(self) -> str | None:
        """One line over every window so far (the Trainer prints it when training ends): ``summarize``."""
        return summarize(self.windows, self.lagged, self.worst, self._every)


def summarize(windows: int, lagged: int, worst: WindowReport | None, every_n_steps: int) -> str | None:
    """The run's straggler line: ``windows`` judged, ``lagged`` of them with a rank lagging, the
    ``worst``. None before the first window closes: a run that short has nothing to compare.

    Without a lagging window the line says so and no more: the largest lag below the thresholds
    is noise, and read as an alarm (the ``straggler/*`` metrics keep it).
    """
    if not windows:
        return None
    judged = f"{windows} window{'s' * (windows != 1)} of {every_n_steps} step{'s' * (every_n_steps != 1)}"
    if not lagged or worst is None:
        return f"no rank lagged in {judged}"
    return (
        f"{lagged} of {judged} had a rank lagging; the largest lag: rank {worst.slowest}, {worst.lag_ms:.1f} ms "
        f"per step ({worst.lag_share:.0%} of the step, {worst.cause}) in the window ending at step {worst.last_step}"
    )
