"""Per-step communication statistics of the reducer, measured on every rank.

For each synchronised step the reducer reports five moments to a ``CommObserver``: the step
starts (the forward armed the reducer), the first gradient is ready (backward is under way), a
bucket's all-reduce was launched, backward ended (the autograd engine ran the reducer's
end-of-backward callback: the last gradient is ready) and every bucket was reduced. From them:

- ``bytes``: gradient bytes all-reduced (the parameters' own bytes; the reducer's per-parameter
  flags are not counted);
- ``buckets``: buckets launched;
- ``time_ms``: communication time, the time during which at least one bucket's all-reduce was in
  flight (from its launch to its completion; overlapping all-reduces count once);
- ``exposed_ms``: the part of that time after backward ended, i.e. what communication added to
  the step once the last gradient was ready;
- ``overlap``: the share of communication time hidden under backward, ``1 - exposed / time``.

Clocks. On CPU, host time (``time.perf_counter``); a bucket completes when its all-reduce's
future runs its callback (Gloo runs it on its own thread the moment the collective finishes;
it may wait for the interpreter lock while the main thread runs Python). On CUDA every moment
is a ``torch.cuda.Event`` recorded on the current stream; a bucket's completion event is
recorded in its future's callback, which runs on a stream made to wait on the communicator's
stream, so the event fires when the all-reduce does. Nothing synchronises the host: events are
read lazily, once ``query()`` says they completed, when statistics are asked for or at the next
step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from lit_dp.autotune import BucketAutotuner
    from lit_dp.reducer import Reducer
    from lit_dp.trace import TraceWriter


@dataclass(frozen=True)
class CommStats:
    """The communication of one synchronised step on one rank (see the module docstring)."""

    step: int
    bytes: int
    buckets: int
    time_ms: float
    exposed_ms: float
    overlap: float

    def as_metrics(self) -> dict[str, float]:
        """The ``comm/*`` names the Lightning strategy logs."""
        return {
            "comm/bytes": float(self.bytes),
            "comm/buckets": float(self.buckets),
            "comm/time_ms": self.time_ms,
            "comm/exposed_ms": self.exposed_ms,
            "comm/overlap": self.overlap,
        }


@dataclass(frozen=True)
class BucketSpan:
    """One bucket's all-reduce in host seconds: launch (the collective was enqueued) to completion."""

    index: int
    bytes: int
    names: tuple[str, ...]
    launch: float
    end: float


@dataclass(frozen=True)
class StepTimeline:
    """One synchronised step's moments, in host seconds (``time.perf_counter``'s clock)."""

    step: int
    start: float
    backward_start: float
    backward_end: float
    reduced: float
    buckets: tuple[BucketSpan, ...]

    def stats(self) -> CommStats:
        spans = sorted((bucket.launch, bucket.end) for bucket in self.buckets)
        total = exposed = 0.0
        run_start, run_end = spans[0] if spans else (0.0, 0.0)
        for launch, end in [*spans[1:], (float("inf"), float("inf"))]:
            if launch > run_end:  # a gap: close the current run of overlapping all-reduces
                total += run_end - run_start
                exposed += max(0.0, run_end - max(run_start, self.backward_end))
                run_start, run_end = launch, end
            else:
                run_end = max(run_end, end)
        return CommStats(
            step=self.step,
            bytes=sum(bucket.bytes for bucket in self.buckets),
            buckets=len(self.buckets),
            time_ms=total * 1e3,
            exposed_ms=exposed * 1e3,
            overlap=1.0 - exposed / total if total > 0 else 1.0,
        )


class _HostClock:
    """Marks are ``time.perf_counter()`` floats."""

    def mark(self) -> float:
        return time.perf_counter()

    def done(self, mark: Any) -> bool:
        return mark is not None

    def to_host(self, mark: float, origin: Any, origin_host: float) -> float:
        return mark

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3


class _CudaClock:
    """Marks are CUDA events on the current stream; read only once complete (no host sync)."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, mark: Any) -> bool:
        return mark is not None and mark.query()

    def to_host(self, mark: torch.cuda.Event, origin: torch.cuda.Event, origin_host: float) -> float:
        # Device time, anchored at the host time the step started: spans line up with the host
        # clock at that moment; their lengths are the GPU's.
        return origin_host + origin.elapsed_time(mark) / 1e3

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # only the autotuner asks, once, when it decides
        return start.elapsed_time(end)


class _StepRecord:
    """The raw marks of one step; completion marks are filled in by the all-reduces' callbacks."""

    __slots__ = ("step", "start_host", "start", "backward_start", "backward_end", "reduced", "buckets")

    def __init__(self, step: int, start: Any) -> None:
        self.step = step
        self.start_host = time.perf_counter()
        self.start = start
        self.backward_start: Any = None
        self.backward_end: Any = None
        self.reduced: Any = None
        # (position, bytes, parameter indices, launch mark, one completion slot per collective)
        self.buckets: list[tuple[int, int, list[int], Any, list[Any]]] = []


class CommObserver:
    """Receives the reducer's moments; resolves them into ``CommStats``, a trace and autotune timings.

    Args:
        names: parameter names, indexed like the reducer's parameters (for the trace).
        device: the parameters' device; CUDA selects event timing.
        collect: record buckets and statistics (off when only the autotuner needs step times).
        trace: where traced steps go, if anywhere.
        tuner: the bucket-size autotuner, given each step's start.
    """

    def __init__(
        self,
        names: Sequence[str],
        device: torch.device,
        *,
        collect: bool = True,
        trace: TraceWriter | None = None,
        tuner: BucketAutotuner | None = None,
    ) -> None:
        self._names = list(names)
        self._clock: _HostClock | _CudaClock = _CudaClock() if device.type == "cuda" else _HostClock()
        self._collect = collect
        self._trace = trace
        self._tuner = tuner
        self._step = -1
        self._current: _StepRecord | None = None
        self._pending: deque[_StepRecord] = deque()
        self._last: CommStats | None = None
        self._totals = [0, 0.0, 0.0]  # steps, time_ms, exposed_ms (steps after the first)

    # The reducer's moments ------------------------------------------------------------------

    def step_started(self, reducer: Reducer) -> None:
        """The forward armed the reducer: a synchronised step begins (buckets may be rebuilt here)."""
        self._step += 1
        mark = self._clock.mark()
        if self._tuner is not None:
            self._tuner.step_started(reducer, self._step, mark, self._clock)
        if self._collect:
            self._resolve()
            self._current = _StepRecord(self._step, mark)

    def backward_started(self) -> None:
        """The first gradient of this backward is ready."""
        if self._current is not None:
            self._current.backward_start = self._clock.mark()

    def bucket_launched(self, position: int, bucket: Any) -> None:
        """``bucket`` (at ``position`` in launch order) has started its all-reduce(s)."""
        record = self._current
        if record is None:
            return
        works = getattr(bucket, "works", None)
        if works is None:  # a SparseBucket: its values (Gloo only) and its flag
            works = [work for work in (bucket.work, bucket.flag_work) if work is not None]
        futures = [work.get_future() for work in works]
        hook_future = getattr(bucket, "future", None)
        if hook_future is not None:  # a communication hook's: its collectives are the bucket's gradients
            futures.append(hook_future)
        if not futures:
            return  # a bucket of a one-rank group: nothing is sent
        nbytes = bucket.nbytes or _sparse_bytes(bucket)
        slots: list[Any] = [None] * len(futures)
        record.buckets.append((position, nbytes, bucket.indices, self._clock.mark(), slots))
        for slot, future in enumerate(futures):
            future.then(_completion_callback(slots, slot, self._clock.mark))

    def backward_ended(self) -> None:
        """The reducer's end-of-backward callback runs: the last gradient is ready."""
        if self._current is not None:
            self._current.backward_end = self._clock.mark()

    def buckets_reduced(self) -> None:
        """Every bucket of this step was waited for."""
        record = self._current
        if record is None:
            return
        record.reduced = self._clock.mark()
        self._pending.append(record)
        self._current = None
        if isinstance(self._clock, _HostClock):
            # Gloo has run every completion callback before wait() returned: resolve now, so a
            # trace ending at this step is written without waiting for another step.
            self._resolve()

    # Reading ---------------------------------------------------------------------------------

    def last(self) -> CommStats | None:
        """The latest step whose measurements are complete (no host synchronisation)."""
        self._resolve()
        return self._last

    def mean(self) -> dict[str, float]:
        """Mean ``time_ms`` and ``exposed_ms`` over the resolved steps after the first, and the
        ``overlap`` of their sums (the share of all communication time that was hidden)."""
        self._resolve()
        steps, time_ms, exposed_ms = self._totals
        if not steps:
            return {}
        overlap = 1.0 - exposed_ms / time_ms if time_ms > 0 else 1.0
        return {"time_ms": time_ms / steps, "exposed_ms": exposed_ms / steps, "overlap": overlap}

    def flush(self) -> None:
        """Resolve every finished step, waiting for the device if needed, and write the trace."""
        if self._pending and isinstance(self._clock, _CudaClock):
            torch.cuda.synchronize()
        self._resolve()
        if self._trace is not None:
            self._trace.write()

    def _resolve(self) -> None:
        clock = self._clock
        while self._pending:
            record = self._pending[0]
            marks = [record.start, record.backward_start, record.backward_end, record.reduced]
            marks += [bucket[3] for bucket in record.buckets]
            marks += [slot for bucket in record.buckets for slot in bucket[4]]
            if not all(clock.done(mark) for mark in marks):
                return
            self._pending.popleft()
            self._account(self._timeline(record))

    def _timeline(self, record: _StepRecord) -> StepTimeline:
        def host(mark: Any) -> float:
            return self._clock.to_host(mark, record.start, record.start_host)

        traced = self._trace is not None and self._trace.wants(record.step)
        spans = []
        for position, nbytes, indices, launch, slots in record.buckets:
            launched = host(launch)
            # A tiny all-reduce can finish before the launch mark is taken, right after it was enqueued.
            end = max(launched, max(host(slot) for slot in slots))
            names = tuple(self._names[i] for i in indices) if traced else ()  # only the trace shows them
            spans.append(BucketSpan(position, nbytes, names, launched, end))
        return StepTimeline(
            step=record.step,
            start=record.start_host,
            backward_start=host(record.backward_start),
            backward_end=host(record.backward_end),
            reduced=host(record.reduced),
            buckets=tuple(spans),
        )

    def _account(self, timeline: StepTimeline) -> None:
        stats = timeline.stats()
        self._last = stats
        if stats.step > 0:  # the first step runs in registration-order buckets, before the rebuild
            totals = self._totals
            totals[0] += 1
            totals[1] += stats.time_ms
            totals[2] += stats.exposed_ms
        if self._trace is not None:
            self._trace.add(timeline)


def check_trace_steps(option: str, steps: Any) -> tuple[int, int]:
    """The traced steps ``(start, stop)``, ``0 <= start < stop``; raises ``ValueError`` naming ``option``."""
    values = [] if isinstance(steps, (str, bytes)) else list(steps) if hasattr(steps, "__iter__") else []
    valid = (
        len(values) == 2
        and all(isinstance(value, int) and not isinstance(value, bool) for value in values)
        and 0 <= values[0] < values[1]
    )
    if not valid:
        raise ValueError(f"{option}={steps!r} is invalid: expected two integers (start, stop) with 0 <= start < stop.")
    start, stop = values
    return start, stop



def _completion_callback(
    slots: list[Any], slot: int, mark: Callable[[], Any]
) -> Callable[[torch.futures.Future], None]:
    def on_complete(_future: torch.futures.Future) -> None:
        slots[slot] = mark()

    return on_complete


def _sparse_bytes(bucket: Any) -> int:
    gradient = getattr(bucket, "gradient", None)
    if gradient is None:
        return 0
    return gradient.values().nbytes + gradient.indices().nbytes


class CommStatsMonitor(pl.Callback):
    """Logs ``PaddleDPStrategy``'s communication figures through the trainer's loggers (CSV, TensorBoard).

    The strategy installs it when ``comm_stats=True`` or ``comm_buffer_size="auto"``, so a user
    turns statistics on with one strategy option and no callback to remember. It follows
    Lightning's ``LearningRateMonitor``: on the steps the trainer writes its logs
    (``log_every_n_steps``) it logs rank 0's last-step ``comm/*`` figures, plus
    ``comm/exposed_ms_max``, the largest exposed time over ranks (one all-reduce of one number,
    on those steps only), and ``comm/tuned_buffer_mb`` once the autotuner has chosen. At each
    epoch end it logs the means so far over steps and ranks (``comm/*_mean``, also in
    ``trainer.callback_metrics``); when training ends, rank 0 prints its own.
    """

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not trainer._logger_connector.should_update_logs:
            return
        metrics = self._step_metrics(trainer)
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        means = {f"comm/{name}_mean": value for name, value in self._means(trainer).items()}
        tuned = getattr(trainer.strategy, "tuned_comm_buffer_size", None)
        if tuned is not None:
            means["comm/tuned_buffer_mb"] = float(tuned)  # the same on every rank
        if means:
            pl_module.log_dict(means, sync_dist=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        means = self._means(trainer)
        last = self._model_stats(trainer)
        parts = []
        if last is not None:
            parts.append(f"{last.bytes / 2**20:.3f} MB in {last.buckets} bucket{'s' * (last.buckets != 1)} per step")
        if means:
            parts.append(
                f"time {means['time_ms']:.3f} ms, exposed {means['exposed_ms']:.3f} ms, "
                f"overlap {means['overlap']:.2f} (rank 0, means over the steps after the first)"
            )
        tuned = getattr(strategy, "tuned_comm_buffer_size", None)
        if tuned is not None:
            parts.append(f"comm_buffer_size=auto -> {tuned:g} MB")
        if parts:
            rank_zero_info("[lit_dp] comm: " + "; ".join(parts))

    def _step_metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        strategy = trainer.strategy
        metrics: dict[str, float] = {}
        if getattr(strategy, "comm_stats", False):
            stats = self._model_stats(trainer)
            # Every rank takes part in the all-reduce, with -1 where no step is measured yet.
            # float64: rank 0's own value must not exceed the maximum by float32 rounding.
            value = stats.exposed_ms if stats is not None else -1.0
            exposed = torch.tensor([value], dtype=torch.float64, device=strategy.root_device)
            exposed_max = float(strategy.reduce(exposed, reduce_op="max").item())
            if stats is not None:
                metrics.update(stats.as_metrics())
                metrics["comm/exposed_ms_max"] = exposed_max
        tuned = getattr(strategy, "tuned_comm_buffer_size", None)
        if tuned is not None:
            metrics["comm/tuned_buffer_mb"] = float(tuned)
        return metrics

    @staticmethod
    def _model_stats(trainer: pl.Trainer) -> CommStats | None:
        read = getattr(trainer.strategy.model, "comm_stats", None)
        return read() if callable(read) else None

    @staticmethod
    def _means(trainer: pl.Trainer) -> dict[str, float]:
        read = getattr(trainer.strategy.model, "comm_stats_mean", None)
        return read() if callable(read) and getattr(trainer.strategy, "comm_stats", False) else {}
