"""The run's communication profile: each bucket's bytes, ready moment, launch and end, per step, on disk.

Every run with ``comm_stats`` (or ``forecast.ranks``) keeps, on every rank, the last
``kept_steps(buckets)`` synchronised steps of its current bucket layout, as the communication statistics
resolve them (``lit_dp.observability.stats``: the timeline of each step is handed to this
recorder as to the trace writer). Per step, in ms:

- ``backward_start_ms``: from the step's start (the forward armed the reducer) to its first gradient;
- ``backward_end_ms``, ``reduced_ms``: from the first gradient to the end of backward, and to the
  moment every bucket was waited for;
- ``host_work_ms``: the reducer's own work on the main thread for a step, its bucket launches, waits
  and write-back left out (``Reducer.host_work_ms``): what a LocalSGD local step does not do;
- ``period_ms``: from the step's start to the next synchronised step's (None for the last step,
  or when the next was not synchronised: LocalSGD's local phase);
- per bucket, in launch order: its bytes, and from the first gradient, the moment its last
  gradient was ready, its launch (its collectives enqueued) and its end (the last completed); and
  whether that end is only a bound (``end_bounded``: on CPU, seen done at a look before backward ended,
  ``lit_dp.observability.stats``), absent from files written before lit_dp told it.

With the profile, also per parameter, in registration order: the median over the kept steps of its
gradient's ready moment, in ms after the step's first gradient (``gradient_ready_ms``).

Kept per step it is a few floats per bucket; a layout change (the first step's rebuild in
ready order, ``comm_buffer_size="auto"``'s trials) starts the record afresh, so the steps kept
all share the buckets written beside them. The strategies write it when training ends, one file
per rank (``lit_dp_profile.rank{R}.json``) in the Trainer's log folder (the recipes' run folder
holds it under ``csv/version_N``); ``python -m lit_dp.forecast RUN_FOLDER`` reads it
(docs/forecast.md). A hand-written loop reads ``DataParallel.comm_profile`` and writes it with
``record().write(folder)``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lit_dp.observability.stats import StepTimeline

FORMAT = "lit_dp communication profile"
VERSION = 1
# Steps kept: a few seconds of a fast step, whose median moves from one second to the next (the
# digits recipe's 4 ms step: 7 runs of 1 s, 230 steps, had medians of 3.9 to 5.1 ms here; 6 runs
# of 4 s, 920 steps, 3.8 to 4.4); fewer for a layout of many buckets, so that a rank keeps at most
# KEPT_BUCKET_TIMES bucket records (what 200 steps of 250 buckets kept before: a few MB on disk).
KEPT_STEPS = 1000
MIN_KEPT_STEPS = 200
KEPT_BUCKET_TIMES = 50_000
FILE_GLOB = "lit_dp_profile.rank*.json"


def kept_steps(buckets: int) -> int:
    """How many steps a layout of ``buckets`` buckets keeps."""
    return max(MIN_KEPT_STEPS, min(KEPT_STEPS, KEPT_BUCKET_TIMES // max(1, buckets)))


def file_name(rank: int) -> str:
    return f"lit_dp_profile.rank{rank}.json"


@dataclass(frozen=True)
class BucketTimes:
    """One bucket of one step: its bytes, and in ms from the step's first gradient its ready moment
    (its launch where it was never ready in backward), launch and end."""

    bytes: int
    ready_ms: float
    launch_ms: float
    end_ms: float
    end_bounded: bool = False


@dataclass(frozen=True)
class StepRecord:
    """One synchronised step (see the module docstring for the moments)."""

    step: int
    period_ms: float | None
    backward_start_ms: float
    backward_end_ms: float
    reduced_ms: float
    buckets: tuple[BucketTimes, ...]
    host_work_ms: float | None = None  # None in profiles written before lit_dp timed it


@dataclass(frozen=True)
class Profile:
    """One rank's profile of a run: who measured it, the layout its steps share, the steps.

    ``parameter_bytes``: each trainable parameter's gradient bytes, in the reducer's (registration)
    order; ``bucket_indices``: the parameters of each bucket in launch order, so their
    concatenation is the order gradients became ready. ``settings``: the options that shape
    communication (bucket sizes, compression, sharding, LocalSGD). ``extra``: what the front door
    adds when it writes the file (the step clock's last window, LocalSGD's traffic).
    """

    rank: int
    world_size: int
    backend: str
    device: str
    parameter_bytes: tuple[int, ...]
    bucket_indices: tuple[tuple[int, ...], ...]
    settings: Mapping[str, Any]
    host: Mapping[str, Any]
    steps: tuple[StepRecord, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Per parameter (registration order), the median over the steps of its gradient's ready moment, in
    # ms after the step's first gradient; None where never timed (before lit_dp timed it, or never ready).
    gradient_ready_ms: tuple[float | None, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["steps"] = [
            {
                **{k: v for k, v in asdict(step).items() if k != "buckets"},
                "buckets": [list(asdict(b).values()) for b in step.buckets],
            }
            for step in self.steps
        ]
        return {"format": FORMAT, "version": VERSION, **record}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "the profile") -> Profile:
        """The profile ``data`` holds; a ``ValueError`` naming ``source`` for anything else."""
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(
                f"{source} is not a lit_dp communication profile of version {VERSION} "
                f"(format={data.get('format')!r}, version={data.get('version')!r})"
            )
        try:
            steps = tuple(
                StepRecord(
                    step=int(step["step"]),
                    period_ms=None if step["period_ms"] is None else float(step["period_ms"]),
                    backward_start_ms=float(step["backward_start_ms"]),
                    backward_end_ms=float(step["backward_end_ms"]),
                    reduced_ms=float(step["reduced_ms"]),
                    buckets=tuple(
                        BucketTimes(int(b[0]), float(b[1]), float(b[2]), float(b[3]), _end_bounded(b))
                        for b in step["buckets"]
                    ),
                    host_work_ms=None if step.get("host_work_ms") is None else float(step["host_work_ms"]),
                )
                for step in data["steps"]
            )
            return cls(
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                backend=str(data["backend"]),
                device=str(data["device"]),
                parameter_bytes=tuple(int(b) for b in data["parameter_bytes"]),
                bucket_indices=tuple(tuple(int(i) for i in bucket) for bucket in data["bucket_indices"]),
                settings=dict(data["settings"]),
                host=dict(data["host"]),
                steps=steps,
                extra=dict(data.get("extra") or {}),
                gradient_ready_ms=_optional_floats(data.get("gradient_ready_ms")),
            )
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ValueError(f"{source} is damaged: {type(error).__name__}: {error}") from None

    def write(self, directory: str | os.PathLike) -> Path:
        """Write ``lit_dp_profile.rank{R}.json`` in ``directory`` (made if needed); returns its path."""
        path = Path(directory) / file_name(self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.to_json()))
        temporary.replace(path)  # a reader never sees half a file
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is damaged: {error}") from None
        return cls.from_json(data, str(path))

    def with_extra(self, **extra: Any) -> Profile:
        return replace(self, extra={**self.extra, **extra})


class CommProfile:
    """Records the steps of one model's reducer (a sink of ``CommObserver``'s timelines).

    Args:
        parameter_bytes: each trainable parameter's gradient bytes, in the reducer's order.
        rank, world_size, backend, device: who measures, among how many, on what.
        settings: the options that shape communication, as written to the file.
    """

    def __init__(
        self,
        parameter_bytes: Sequence[int],
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        settings: Mapping[str, Any],
    ) -> None:
        self._parameter_bytes = tuple(parameter_bytes)
        self._who = (rank, world_size, backend, str(device))
        self._settings = dict(settings)
        # Each step as resolved, with the one that followed it (its start gives the period); turned
        # into records only when asked, so that a step costs an append.
        self._steps: deque[tuple[StepTimeline, StepTimeline | None]] = deque(maxlen=kept_steps(1))
        self._layout: tuple[tuple[int, ...], ...] = ()
        self._latest: StepTimeline | None = None  # until the next step's start gives its period

    def add(self, timeline: StepTimeline) -> None:
        """A step's timeline, resolved (in step order)."""
        layout = tuple(bucket.indices for bucket in timeline.buckets)
        latest, self._latest = self._latest, timeline
        if layout != self._layout:  # another layout: its steps alone describe what runs from now on
            self._layout = layout
            self._steps = deque(maxlen=kept_steps(len(layout)))
        elif latest is not None:
            self._steps.append((latest, timeline))

    def record(self) -> Profile:
        """The steps kept so far, the latest one included (its period unknown)."""
        steps = [_record(timeline, following) for timeline, following in self._steps]
        if self._latest is not None:
            steps.append(_record(self._latest, None))
        rank, world_size, backend, device = self._who
        timelines = [timeline for timeline, _ in self._steps] + ([self._latest] if self._latest is not None else [])
        return Profile(
            rank=rank,
            world_size=world_size,
            backend=backend,
            device=device,
            parameter_bytes=self._parameter_bytes,
            bucket_indices=self._layout,
            settings=self._settings,
            host={
                "cpus": os.cpu_count(),
                "threads": torch.get_num_threads(),
                "machine": platform.node(),
                "torch": torch.__version__,
            },
            steps=tuple(steps),
            gradient_ready_ms=_median_ready(timelines, len(self._parameter_bytes)),
        )


def _median_ready(timelines: Sequence[StepTimeline], parameters: int) -> tuple[float | None, ...] | None:
    """Each parameter's median ready moment over the steps that timed it; None if none did."""
    timed = [timeline.gradients_ready_ms for timeline in timelines if timeline.gradients_ready_ms is not None]
    if not timed:
        return None
    medians: list[float | None] = []
    for index in range(parameters):
        moments = [ready[index] for ready in timed if index < len(ready) and ready[index] is not None]
        medians.append(round(statistics.median(moments), 4) if moments else None)
    return tuple(medians)


def _end_bounded(bucket: Sequence[Any]) -> bool:
    """A written bucket's fifth element; a file written before lit_dp told it has four, every end measured."""
    if len(bucket) < 5:
        return False
    if not isinstance(bucket[4], bool):
        raise TypeError(f"a bucket's end_bounded is {bucket[4]!r}, expected true or false")
    return bucket[4]


def _optional_floats(values: Any) -> tuple[float | None, ...] | None:
    return None if values is None else tuple(None if value is None else float(value) for value in values)


def _record(timeline: StepTimeline, following: StepTimeline | None) -> StepRecord:
    origin = timeline.backward_start

    def ms(moment: float) -> float:
        return round((moment - origin) * 1e3, 4)

    consecutive = following is not None and following.step == timeline.step + 1
    return StepRecord(
        step=timeline.step,
        period_ms=round((following.start - timeline.start) * 1e3, 4) if consecutive else None,  # type: ignore[union-attr]
        backward_start_ms=round((timeline.backward_start - timeline.start) * 1e3, 4),
        backward_end_ms=ms(timeline.backward_end),
        reduced_ms=ms(timeline.reduced),
        buckets=tuple(
            BucketTimes(
                bucket.bytes,
                ms(bucket.launch if bucket.ready is None else bucket.ready),
                ms(bucket.launch),
                ms(bucket.end),
                bucket.end_bounded,
            )
            for bucket in timeline.buckets
        ),
        host_work_ms=None if timeline.host_work_ms is None else round(timeline.host_work_ms, 4),
    )
