"""What the forecast takes from a run: its profiles read from the run folder, and the model's parameters fitted to them.

A run with ``comm_stats`` leaves one profile per rank (``lit_dp.observability.profile``). From
the steps it kept, medians per step and per bucket (ms, from the step's first gradient unless
said otherwise):

- the step's parts: the forward (the step's start to its first gradient), the backward *without*
  the host's bucket launches (each launch's time on the main thread taken out of the gradients
  that became ready after it), the write-back after the last bucket ended, and the rest of the
  period (optimizer step, data, logging); one rank's compute is forward + backward + the rest;
- when each parameter's gradient is ready in that launch-free backward: a bucket's last member
  at the bucket's ready moment, the others spread over the time since the previous bucket's in
  proportion to their bytes (gradients arrive about as fast as their layers' backward runs);
- the host's cost of launching each bucket (copying it into its buffer, enqueuing the
  collective), and over the run, fitted as a fixed part plus a part per byte;
- the link: each bucket's time on it (from its launch, or the previous bucket's end if later,
  to its end); and a latency plus bytes over a bandwidth with a ring's ``2(N-1)/N``, fitted to
  the all-reduces the run timed when it ended (``lit_dp.observability.link_probe``: the link's
  own figures, of sizes that spread), or where it has none to the buckets' times;
- the main thread's idle wait for the link after its last launch, and what an idle wait of each
  length adds to the host work after it, probed when the run ended
  (``lit_dp.observability.resume_probe``; ``ResumeCost``).

Each step is kept in these parts (``StepSample``), so that the model re-times every one the
profile kept and reports the median.

The rank whose own compute is the longest is the one taken: the others wait for it, so its
buckets' times are the link's, not a wait for a slower peer.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from lit_dp.observability.profile import FILE_GLOB, Profile, StepRecord

# Steps after a layout change that are left out when more remain: the first steps in new
# buffers allocate memory and warm caches.
SETTLING_STEPS = 2
ENOUGH_STEPS = 10
MB = 2**20
# How far bucket sizes must spread for a latency and a bandwidth to be told apart.
SPREAD = 1.5
WHAT_TO_RUN = "python recipes/digits.py (the recipes keep strategy.comm_stats=true), or any run with comm_stats=True on 2 or more ranks"


class NoRunError(ValueError):
    """The folder holds no usable profile; the message is one line that says what to run first."""


def find_profiles(folder: str | os.PathLike) -> list[Path]:
    """The profiles of the newest run under ``folder`` (a run folder, a log folder, or one profile file)."""
    path = Path(folder)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise NoRunError(
            f"{folder}: no such run folder; run training first, e.g. {WHAT_TO_RUN}, then pass its folder (outputs/<task>/<time>)."
        )
    found = sorted(path.rglob(FILE_GLOB))
    if not found:
        raise NoRunError(
            f"{folder}: no lit_dp profile ({FILE_GLOB}) in it; it is written when training ends with comm_stats on: run "
            f"{WHAT_TO_RUN}, then pass its folder."
        )
    newest = max({p.parent for p in found}, key=lambda parent: max(p.stat().st_mtime for p in parent.glob(FILE_GLOB)))
    return sorted(newest.glob(FILE_GLOB))


def load_profiles(folder: str | os.PathLike) -> list[Profile]:
    """Every rank's profile of the newest run under ``folder``; ``NoRunError`` (one line) when there is none."""
    profiles = []
    for path in find_profiles(folder):
        try:
            profiles.append(Profile.read(path))
        except ValueError as error:
            raise NoRunError(f"{error}; run training again with comm_stats on, e.g. {WHAT_TO_RUN}.") from None
    return profiles


@dataclass(frozen=True)
class FittedLink:
    """The run's link as fitted: a latency per hop (s) and a bandwidth (bytes/s); ``note`` says how."""

    latency_s: float
    bandwidth: float
    note: str


@dataclass(frozen=True)
class ResumeCost:
    """What an idle wait of ``idle_ms`` added to the host work after it (``extra_ms``), as the run's
    host probed it when the run ended; none where it was not probed."""

    idle_ms: tuple[float, ...] = ()
    extra_ms: tuple[float, ...] = ()

    @property
    def probed(self) -> bool:
        return bool(self.idle_ms)

    def after(self, idle_ms: float) -> float:
        """The extra host time (ms) after an idle wait of ``idle_ms``: linear between the probed waits
        (from nothing after no wait), the longest's beyond it."""
        idle_ms = max(0.0, idle_ms)
        previous_idle = previous_extra = 0.0
        for idle, extra in zip(self.idle_ms, self.extra_ms):
            if idle_ms <= idle:
                return previous_extra + (extra - previous_extra) * (idle_ms - previous_idle) / (idle - previous_idle)
            previous_idle, previous_extra = idle, extra
        return previous_extra


@dataclass(frozen=True)
class StepSample:
    """One kept step of the run, in parts (ms): what the model re-times under another setting."""

    period_ms: float
    forward_ms: float
    backward_ms: float  # without the host's bucket launches
    rest_ms: float  # the period's part after the buckets were reduced: optimizer step, data, logging
    writeback_ms: float  # after the last bucket ended, until the averages were in place
    exposed_ms: float  # as measured: the end of backward to every bucket reduced
    idle_ms: float  # the main thread's wait for the link, after backward and its last launch
    parameter_ready_ms: tuple[float, ...]  # in the order gradients became ready, in the launch-free backward
    launch_ms: tuple[float, ...]  # the host's cost of each of the run's bucket launches
    link_ms: tuple[float, ...]  # each of the run's buckets' time on the link
    link_bounded: tuple[bool, ...]  # whether that time is only a bound (the bucket seen done in backward)
    host_work_ms: float  # the reducer's own host work, inside the compute (0 where the run did not time it)

    @property
    def compute_ms(self) -> float:
        """One rank's compute: the step without any communication or bucket launch."""
        return self.forward_ms + self.backward_ms + self.rest_ms

    @property
    def local_compute_ms(self) -> float:
        """The compute of a step that keeps its gradients local (LocalSGD's): without the reducer's work."""
        return max(0.0, self.compute_ms - self.host_work_ms)


@dataclass(frozen=True)
class Measured:
    """One rank's run, reduced to the cost model's parameters: its steps in parts, and the fits.

    Figures are medians over ``samples`` (ms); the model re-times every sample and takes the
    median of its predictions, so that a step that was slow in one part stays slow in the others.
    """

    rank: int
    ranks: int
    backend: str
    device: str
    samples: tuple[StepSample, ...]
    launch_ms: float  # the host's cost of a bucket launch: a fixed part ...
    launch_ms_per_mb: float  # ... and a part per MB (0 where the run's bucket sizes could not tell them apart)
    link: FittedLink
    parameter_bytes: tuple[int, ...]  # in the order gradients became ready
    bucket_sizes: tuple[tuple[int, ...], ...]  # the run's buckets, as positions in that order
    settings: dict[str, Any]
    optimizer_ms: float | None  # the optimizer step (the step clock's last window), if known
    local_sgd: dict[str, Any]  # LocalSGD's traffic, if the run had it
    resume: ResumeCost  # what an idle wait adds to the host work after it
    host_work_timed: bool  # whether the profile holds the reducer's host work per step

    def median(self, part: str) -> float:
        """The median of a ``StepSample`` figure over the samples (``compute_ms``, ``period_ms``, ...)."""
        return statistics.median(getattr(sample, part) for sample in self.samples)

    @property
    def steps(self) -> int:
        return len(self.samples)

    @property
    def compute_ms(self) -> float:
        return self.median("compute_ms")

    @property
    def period_ms(self) -> float:
        return self.median("period_ms")

    @property
    def model_bytes(self) -> int:
        return sum(self.parameter_bytes)

    def launch_cost_ms(self, nbytes: float) -> float:
        """The fitted host cost of launching a bucket of ``nbytes``."""
        return self.launch_ms + self.launch_ms_per_mb * nbytes / MB


def measure(profiles: Profile | Sequence[Profile]) -> Measured:
    """The cost model's parameters from a run's profiles (one per rank, or one); the rank with the
    longest own compute is taken. ``NoRunError`` for a profile without synchronised steps."""
    profiles = [profiles] if isinstance(profiles, Profile) else list(profiles)
    if not profiles:
        raise NoRunError(f"no profile given; run training first, e.g. {WHAT_TO_RUN}.")
    measured = [_measure(profile) for profile in profiles]
    return max(measured, key=lambda m: m.compute_ms)


def _steps(profile: Profile) -> list[StepRecord]:
    steps = [step for step in profile.steps if step.period_ms is not None and step.buckets]
    if len(steps) > ENOUGH_STEPS:
        steps = steps[SETTLING_STEPS:]
    if not steps:
        raise NoRunError(
            f"the profile of rank {profile.rank} holds no synchronised step with its successor (a run of one rank, "
            "or LocalSGD without local_sgd.warmup_steps, synchronises no gradients): run data parallelism on 2 or more "
            f"ranks first, e.g. {WHAT_TO_RUN}."
        )
    return steps


def _sample(
    step: StepRecord,
    buckets: Sequence[Sequence[int]],
    parameter_bytes: Sequence[int],
    shape: Sequence[float | None] | None,
) -> StepSample:
    host, ready, link, bounded = [], [], [], []
    main_free = 0.0  # when the main thread finished the previous launch
    link_free = 0.0
    launched_in_backward = 0.0  # host time spent launching so far, in backward
    for bucket in step.buckets:
        cost = max(0.0, bucket.launch_ms - max(bucket.ready_ms, main_free))
        ready.append(bucket.ready_ms - launched_in_backward)
        if bucket.launch_ms <= step.backward_end_ms:
            launched_in_backward += cost
        host.append(cost)
        main_free = bucket.launch_ms
        # A completion is marked when it is seen (on CPU at the training thread's next moment, on CUDA by
        # its callback once that has the interpreter): it can come after the step's wait for it returned,
        # which bounds when the collective really ended.
        end = min(bucket.end_ms, step.reduced_ms)
        link.append(max(0.0, end - max(bucket.launch_ms, link_free)))
        bounded.append(bucket.end_bounded)
        link_free = max(link_free, end)
    last_end = link_free
    waited_from = max(step.backward_end_ms, main_free)
    return StepSample(
        period_ms=step.period_ms,  # type: ignore[arg-type]
        forward_ms=step.backward_start_ms,
        backward_ms=step.backward_end_ms - launched_in_backward,
        rest_ms=max(0.0, step.period_ms - step.backward_start_ms - step.reduced_ms),  # type: ignore[operator]
        writeback_ms=max(0.0, step.reduced_ms - max(step.backward_end_ms, last_end)),
        exposed_ms=step.reduced_ms - step.backward_end_ms,
        idle_ms=max(0.0, last_end - waited_from),
        parameter_ready_ms=tuple(_spread(buckets, parameter_bytes, ready, shape)),
        launch_ms=tuple(host),
        link_ms=tuple(link),
        link_bounded=tuple(bounded),
        host_work_ms=step.host_work_ms or 0.0,
    )


def _measure(profile: Profile) -> Measured:
    steps = _steps(profile)
    # A bucket's members are kept in forward order: backward readies them last to first, so the
    # ready order is each bucket's members reversed, the buckets in launch order (and the forward
    # order, which buckets are cut from, that order reversed).
    buckets = [tuple(reversed(bucket)) for bucket in profile.bucket_indices]
    shape = profile.gradient_ready_ms
    samples = [_sample(step, buckets, profile.parameter_bytes, shape) for step in steps]
    median = statistics.median
    sizes = [bucket.bytes for bucket in steps[0].buckets]
    host = [median(sample.launch_ms[b] for sample in samples) for b in range(len(sizes))]
    link = [median(sample.link_ms[b] for sample in samples) for b in range(len(sizes))]
    launch_ms, launch_per_byte = _fit_line(sizes, host)
    order = [i for bucket in buckets for i in bucket]
    return Measured(
        rank=profile.rank,
        ranks=profile.world_size,
        backend=profile.backend,
        device=profile.device,
        samples=tuple(samples),
        launch_ms=launch_ms,
        launch_ms_per_mb=launch_per_byte * MB,
        link=_fit_link(sizes, link, profile.world_size, _probe(profile)),
        parameter_bytes=tuple(profile.parameter_bytes[i] for i in order),
        bucket_sizes=_positions(buckets),
        settings=dict(profile.settings),
        optimizer_ms=_optimizer_ms(profile),
        local_sgd=dict(profile.extra.get("local_sgd") or {}),
        resume=_resume(profile),
        host_work_timed=all(step.host_work_ms is not None for step in steps),
    )


def _probe(profile: Profile) -> Mapping[str, Any] | None:
    """The link probe the profile holds (``lit_dp.observability.link_probe``), checked; None without one."""
    probe = profile.extra.get("link_probe")
    if probe is None:
        return None
    sizes, times = (probe.get("bytes"), probe.get("ms")) if isinstance(probe, Mapping) else (None, None)
    numbers = isinstance(sizes, list) and isinstance(times, list) and len(sizes) == len(times) >= 2
    if not numbers or not all(isinstance(v, (int, float)) and v > 0 for v in [*sizes, *times]):
        raise NoRunError(
            f"the profile of rank {profile.rank} is damaged: extra.link_probe={probe!r} is invalid, expected "
            f"{{'bytes': [...], 'ms': [...]}} of 2 or more positive numbers each; run training again, e.g. {WHAT_TO_RUN}."
        )
    return probe


def _resume(profile: Profile) -> ResumeCost:
    """The resume probe the profile holds (``lit_dp.observability.resume_probe``), checked; none without one."""
    probe = profile.extra.get("resume_probe")
    if probe is None:
        return ResumeCost()
    idle, extra = (probe.get("idle_ms"), probe.get("extra_ms")) if isinstance(probe, Mapping) else (None, None)
    numbers = isinstance(idle, list) and isinstance(extra, list) and len(idle) == len(extra) >= 1
    numbers = numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in [*idle, *extra])
    if not numbers or idle != sorted(set(idle)) or not idle[0] > 0:
        raise NoRunError(
            f"the profile of rank {profile.rank} is damaged: extra.resume_probe={probe!r} is invalid, expected "
            f"{{'idle_ms': [...], 'extra_ms': [...]}}: increasing positive waits, and what each added (0 or more); run "
            f"training again, e.g. {WHAT_TO_RUN}."
        )
    return ResumeCost(tuple(float(v) for v in idle), tuple(float(v) for v in extra))


def _spread(
    buckets: Sequence[Sequence[int]],
    parameter_bytes: Sequence[int],
    ready: Sequence[float],
    shape: Sequence[float | None] | None = None,
) -> list[float]:
    """Each parameter's ready moment in this step, in ready order: a bucket's last at the bucket's, the
    others between it and the previous bucket's (the first bucket's since 0, the backward's start) as
    the run's median ready moments place them (``shape``, the profile's ``gradient_ready_ms``), or,
    where the run did not time them, in proportion to their bytes."""
    moments, previous, previous_shape = [], 0.0, 0.0
    for members, moment in zip(buckets, ready):
        moment = max(moment, previous)
        timed = shape is not None and all(shape[i] is not None for i in members)
        if timed:
            # The bucket's members as the run's medians place them between the two buckets' moments.
            last = max(shape[i] for i in members)  # type: ignore[type-var, index]
            span = last - previous_shape
            placed = 0.0
            for i in members:
                fraction = (shape[i] - previous_shape) / span if span > 0 else 1.0  # type: ignore[operator, index]
                placed = max(placed, min(1.0, max(0.0, fraction)))  # in ready order, never earlier
                moments.append(previous + (moment - previous) * placed)
            moments[-1] = moment
            previous_shape = last
        else:
            total = sum(parameter_bytes[i] for i in members) or 1
            done = 0
            for i in members:
                done += parameter_bytes[i]
                moments.append(previous + (moment - previous) * done / total)
        previous = moment
    return moments


def _positions(buckets: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    positions, start = [], 0
    for members in buckets:
        positions.append(tuple(range(start, start + len(members))))
        start += len(members)
    return tuple(positions)


def _fit_line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """``times ~ fixed + per_byte * sizes``, both at least 0; where the sizes do not spread, all fixed."""
    if len(sizes) < 2 or max(sizes) < SPREAD * max(1, min(sizes)):
        return statistics.median(times), 0.0
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(times) / n
    var = sum((s - mean_s) ** 2 for s in sizes)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, times)) / var
    fixed = mean_t - slope * mean_s
    if slope < 0:
        return mean_t, 0.0
    if fixed < 0:
        return 0.0, sum(s * t for s, t in zip(sizes, times)) / sum(s * s for s in sizes)
    return fixed, slope


def _fit_median_line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """``times ~ fixed + per_byte * sizes`` through the medians of the pairwise slopes and of the
    intercepts they leave (Theil-Sen): one size slowed throughout its probe (Gloo on loopback took 1 MB
    in 0.7 to 7.8 ms within one) moves the line no more than the others allow."""
    slopes = [(tb - ta) / (sb - sa) for (sa, ta), (sb, tb) in combinations(zip(sizes, times), 2) if sb != sa]
    if not slopes:
        return statistics.median(times), 0.0
    per_byte = max(0.0, statistics.median(slopes))
    return max(0.0, statistics.median(t - per_byte * s for s, t in zip(sizes, times))), per_byte


def ring_share(ranks: int) -> float:
    """Of a payload, what each rank sends in a ring all-reduce: ``2(N-1)/N``."""
    return 2 * (ranks - 1) / ranks


def _fit_link(
    sizes: Sequence[int], times_ms: Sequence[float], ranks: int, probe: Mapping[str, Any] | None = None
) -> FittedLink:
    hops = 2 * (ranks - 1)
    share = ring_share(ranks)
    if probe:
        fixed_ms, per_byte_ms = _fit_median_line(probe["bytes"], probe["ms"])
        if per_byte_ms > 0:
            probed = ", ".join(f"{nbytes / MB:g}" for nbytes in probe["bytes"])
            note = f"fitted to all-reduces of {probed} MB timed when the run ended"
            return FittedLink(fixed_ms / 1e3 / hops, share / (per_byte_ms / 1e3), note)
    if len(sizes) >= 2 and max(sizes) >= SPREAD * max(1, min(sizes)):
        fixed_ms, per_byte_ms = _fit_line(sizes, times_ms)
        if per_byte_ms > 0:
            note = f"fitted to {len(sizes)} bucket sizes of the run"
            return FittedLink(fixed_ms / 1e3 / hops, share / (per_byte_ms / 1e3), note)
    # One size (or no trend): its whole time is taken as bytes over bandwidth.
    total_bytes, total_ms = sum(sizes), sum(times_ms)
    bandwidth = share * total_bytes / (total_ms / 1e3) if total_ms > 0 else float("inf")
    note = "one bucket size in the run: its time taken as bytes over bandwidth, no latency (--latency sets one)"
    return FittedLink(0.0, bandwidth, note)


def _optimizer_ms(profile: Profile) -> float | None:
    window = profile.extra.get("window") or {}
    value = window.get("optimizer_ms")
    return float(value) if value is not None else None
