"""The cost model: each setting's step at N ranks over a link, from one run's measurements.

Data parallelism, per step (``Measured`` has the run's parts, ``Link`` the collectives' times):

1. backward runs as in the run, without launches; a bucket is ready when its last gradient is
   (the buckets are cut from the gradients in the order they became ready, with lit_dp's own
   rule, ``lit_dp.gradients.layout.launch_order``);
2. the main thread then launches it: a fixed cost plus a cost per byte (and a cast per byte for
   a ``comm_dtype``), which delays the rest of backward by as much;
3. the link carries one bucket at a time, in launch order: a bucket starts when it is launched
   and the previous one has ended, and takes the link's time for its bytes at N ranks;
4. the step is forward + backward (with the launches) + what the link still holds after backward
   + the run's write-back + the rest (optimizer, data, logging), all as measured, + what the host
   work after the wait for the link costs more (or less) after this wait than after the run's
   (the resume probe's figures, ``ResumeCost``).

ZeRO adds the parameters' gather after the optimizer step (not overlapped) and takes ``1 - 1/N``
of the optimizer step away where the run measured it; stage 2 reduce-scatters the buckets. LocalSGD
and DiLoCo take one rank's compute per step, plus every ``K/F`` steps a sync of ``P/F`` bytes (in
its dtype) that nothing overlaps but ``sync_delay`` inner steps, and the host's passes over those
bytes (the deltas, the outer step), each at the cost per byte of the run's write-back; a local
step runs no reducer and waits for no link, so the reducer's own host work (the profile's
``host_work_ms``) and the resume after the run's wait are taken out of its compute.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_dp.forecast.link import Link
from lit_dp.forecast.run import Measured, StepSample, load_profiles, measure, ring_share
from lit_dp.gradients.layout import launch_order
from lit_dp.observability.profile import CommProfile, Profile
from lit_dp.options.comm_hooks import compressions
from lit_dp.options.core import DEFAULT_BUCKET_MB
from lit_dp.options.forecast import parse_bandwidth, parse_latency
from lit_dp.options.local_sgd import SYNC_DTYPES

MB = 2**20
# Bucket sizes (MB) tried for the best one.
CANDIDATE_BUCKET_MB = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)
LOCAL_SGD_K = (4, 16)
DILOCO_K = (16, 64)
STREAMING = (16, 4, 1)  # K, fragments, sync_delay
# The host's passes over a sync's bytes, each as costly per byte as the run's write-back of the
# averaged gradients: the deltas into the buckets and the average written back (averaging); plus
# the outer momentum and Nesterov step (DiLoCo).
SYNC_PASSES = {"average": 4, "nesterov": 6}
DILOCO_QUALITY = (
    "the quality cost (loss at equal steps) is not predicted; measured on the GPT recipe: "
    "docs/local_sgd.md#diloco-on-the-gpt-recipe"
)


def wire_bits(dtype: str) -> int:
    """The bits a value travels in under the dtype named ``dtype`` (``fp32``, ``bf16``, ``int8``, ``int4``):
    the number its name ends with, so a sync dtype added to lit_dp is forecast without a change here."""
    match = re.search(r"(\d+)$", dtype)
    if match is None:
        raise ValueError(f"dtype {dtype!r}: expected a name ending in its bits, e.g. bf16 or int8")
    return int(match.group(1))


@dataclass(frozen=True)
class Prediction:
    """One setting at ``ranks`` ranks over one link (ms per step; bytes each rank sends per step)."""

    setting: str
    options: Mapping[str, Any]  # what to set, as lit_dp's options spell it (local_sgd.steps)
    ranks: int
    step_ms: float
    exposed_ms: float  # communication the step waits for after backward (and a sync's, per step)
    bytes_per_step: float
    compute_ms: float  # one rank's compute per step, without communication
    exact: bool  # the same averaged gradients as data parallelism every step
    note: str = ""  # what the prediction leaves out (DiLoCo's quality)

    @property
    def cost(self) -> float:
        """The step relative to one rank's compute: 1.00 costs nothing for communication."""
        return self.step_ms / self.compute_ms if self.compute_ms > 0 else math.inf


@dataclass(frozen=True)
class Scenario:
    """Every setting at one number of ranks over one link."""

    ranks: int
    link: Link
    rows: tuple[Prediction, ...]

    @property
    def fastest(self) -> Prediction:
        return min(self.rows, key=lambda row: row.step_ms)

    @property
    def fastest_exact(self) -> Prediction:
        """The fastest setting that keeps data parallelism's gradients (bucket size, ZeRO)."""
        return min((row for row in self.rows if row.exact), key=lambda row: row.step_ms)


@dataclass(frozen=True)
class Forecast:
    """``predict``'s result: what was measured, and a scenario per (ranks, link) asked."""

    measured: Measured
    scenarios: tuple[Scenario, ...]
    notes: tuple[str, ...] = field(default=())


Stats = Profile | Sequence[Profile] | CommProfile | Measured | str | os.PathLike


def predict(
    stats: Stats,
    ranks: int | Sequence[int] | None = None,
    bandwidth: str | float | Sequence[str | float] | None = None,
    latency: str | float | None = None,
    ranks_per_node: int | None = None,
    inter_node: str | float | None = None,
    bucket_sizes: Sequence[float] = (),
    local_steps: Sequence[int] = (),
) -> Forecast:
    """What each setting would cost at ``ranks`` ranks over ``bandwidth``, from a run's measurements.

    Args:
        stats: the run: its folder (or a profile file), its profiles (``Profile``: one, or one per
            rank), a model's ``DataParallel.comm_profile``, or ``measure``'s result.
        ranks: numbers of ranks; None: the run's own.
        bandwidth: links as written (``"10Gbit"``, ``"1.25GB/s"``) or bytes/s; None: the run's own, fitted.
        latency: per hop (``"20us"`` or seconds); None: the run's own, fitted.
        ranks_per_node, inter_node: two levels: ranks per node share ``bandwidth``, nodes meet over
            ``inter_node`` (adds rows for replica groups per node).
        bucket_sizes: ``comm_buffer_size`` values (MB) to add a data-parallel row for each.
        local_steps: periods K to add DiLoCo rows for, beside ``DILOCO_K``'s.
    """
    measured = stats if isinstance(stats, Measured) else measure(_profiles(stats))
    ranks_list = [measured.ranks] if ranks is None else [ranks] if isinstance(ranks, int) else list(ranks)
    for count in ranks_list:
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise ValueError(f"ranks={ranks!r} is invalid: expected numbers of ranks, each at least 2.")
    if (ranks_per_node is None) != (inter_node is None):
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r} with inter_node={inter_node!r} is invalid: expected both (two levels) or neither."
        )
    if ranks_per_node is not None and (
        isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
    ):
        raise ValueError(f"ranks_per_node={ranks_per_node!r} is invalid: expected a positive integer.")
    fitted = measured.link
    hop = fitted.latency_s if latency is None else _latency(latency)
    between = None if inter_node is None else _bandwidth("inter_node", inter_node)
    asked = bandwidth if isinstance(bandwidth, (list, tuple)) else [bandwidth]
    links = [
        Link(
            fitted.bandwidth if value is None else _bandwidth("bandwidth", value),
            hop,
            ranks_per_node,
            between,
            measured=value is None,
        )
        for value in asked
    ]
    for size in bucket_sizes:
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"bucket_sizes={list(bucket_sizes)!r} is invalid: expected positive sizes in MB.")
    for k in local_steps:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"local_steps={list(local_steps)!r} is invalid: expected periods K, each at least 1.")
    periods = tuple(sorted({*DILOCO_K, *local_steps}))
    scenarios = tuple(
        Scenario(count, link, tuple(_rows(measured, count, link, bucket_sizes, periods)))
        for count in ranks_list
        for link in links
    )
    notes = [f"the run's link: {fitted.note}"]
    if not measured.resume.probed:
        notes.append("the host's resume after a wait was not probed: each step's host work is kept as the run measured it")
    if not measured.host_work_timed:
        notes.append(
            "the reducer's own host work was not timed (a profile written before lit_dp timed it): "
            "a LocalSGD or DiLoCo local step is taken to do it"
        )
    if measured.optimizer_ms is None:
        notes.append("the optimizer step was not measured (no straggler window): ZeRO's saving on it is left out")
    return Forecast(measured, scenarios, tuple(notes))


def _profiles(stats: Stats) -> list[Profile]:
    if isinstance(stats, CommProfile):
        return [stats.record()]
    if isinstance(stats, Profile):
        return [stats]
    if isinstance(stats, (str, os.PathLike)):
        return load_profiles(stats)
    return list(stats)


def _bandwidth(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return parse_bandwidth(name, value)


def _latency(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return parse_latency("latency", value)


# -- the settings ------------------------------------------------------------------------------------


class _Timing:
    """How one sample of the run re-times: its host launch costs and, over the run's own link, its
    link's pace, each as a factor on the fitted figures (a step slow to launch or to communicate in
    the run stays so under another setting). Over a told link, what the sample's collectives took
    beyond the run's typical step (``typical_link_ms``: a peer late, the host's threads busy) is the
    host's, not the link's: it is added to the told link's time, as ``link_extra_ms``."""

    def __init__(self, m: Measured, sample: StepSample, link: Link, typical_link_ms: float) -> None:
        sizes = [sum(m.parameter_bytes[i] for i in bucket) for bucket in m.bucket_sizes]
        fitted_launch = sum(m.launch_cost_ms(size) for size in sizes)
        self.launch_factor = sum(sample.launch_ms) / fitted_launch if fitted_launch > 0 else 1.0
        self.link_factor = 1.0
        self.link_extra_ms = 0.0
        if link.measured:
            run_link = Link(link.bandwidth, link.latency)
            # A bucket seen done only at a look during backward ran for some unknown part of its
            # time (GPT's first bucket seemed to take until backward ended, 12 to 22 times the
            # probe's line): the pace is the measured buckets', the probe's line where none was.
            timed = [b for b, bounded in enumerate(sample.link_bounded) if not bounded]
            fitted_link = sum(run_link.allreduce_ms(sizes[b], m.ranks) for b in timed)
            if fitted_link > 0:
                self.link_factor = sum(sample.link_ms[b] for b in timed) / fitted_link
        else:
            self.link_extra_ms = sum(sample.link_ms) - typical_link_ms


def _median_of(
    m: Measured, link: Link, step: Callable[[StepSample, _Timing], tuple[float, float]]
) -> tuple[float, float]:
    """The medians of (step, exposed) re-timed for every sample of the run."""
    typical_link_ms = statistics.median(sum(sample.link_ms) for sample in m.samples)
    results = [step(sample, _Timing(m, sample, link, typical_link_ms)) for sample in m.samples]
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def _rows(
    m: Measured, ranks: int, link: Link, bucket_sizes: Sequence[float] = (), diloco_k: Sequence[int] = DILOCO_K
) -> list[Prediction]:
    gradient_bits = int(m.settings.get("gradient_bits") or 32)
    run_bits = _run_wire_bits(m.settings, gradient_bits)
    last_mb = float(m.settings.get("last_comm_buffer_size") or 1.0)

    def dp(
        buckets: Sequence[Sequence[int]], name: str, options: dict, bits: int = run_bits, exact: bool = True
    ) -> Prediction:
        cast = 0.0 if bits == run_bits else 2 * _ms_per_mb(m)  # to the dtype and back, per MB
        wire = bits / gradient_bits
        # Where nothing changes (the run's buckets, ranks, link and dtype) each bucket takes its own time.
        as_run = buckets is m.bucket_sizes and link.measured and ranks == m.ranks and bits == run_bits
        step, exposed = _median_of(
            m,
            link,
            lambda sample, timing: _dp_step(
                m, sample, timing, buckets, lambda s: link.allreduce_ms(s, ranks), wire, cast, as_run=as_run
            ),
        )
        sent = ring_share(ranks) * m.model_bytes * wire
        return Prediction(name, options, ranks, step, exposed, sent, m.compute_ms, exact)

    rows = [dp(m.bucket_sizes, f"data parallelism, the run's buckets ({_sizes(m)})", {})]
    tried = {mb: _buckets(m, mb, min(last_mb, mb)) for mb in CANDIDATE_BUCKET_MB}
    best_mb = min(tried, key=lambda mb: dp(tried[mb], "", {}).step_ms)
    best = _size_options(best_mb, last_mb)
    rows.append(dp(tried[best_mb], f"data parallelism, buckets of {best_mb:g} MB (the best)", best))
    for mb in bucket_sizes:
        asked = _buckets(m, mb, min(last_mb, mb))
        rows.append(dp(asked, f"data parallelism, buckets of {mb:g} MB", _size_options(float(mb), last_mb)))
    for name in compressions():
        bits = wire_bits(name)
        if bits < run_bits:
            options = {**best, "comm_dtype": name}
            rows.append(
                dp(tried[best_mb], f"data parallelism, {best_mb:g} MB, gradients in {name}", options, bits, exact=False)
            )
    rows += [_zero(m, ranks, link, stage, run_bits / gradient_bits) for stage in (1, 2)]
    for k in LOCAL_SGD_K:
        rows.append(_local(m, ranks, link, k, 1, 0, "average", gradient_bits, None))
    for k in diloco_k:
        for dtype in ["fp32", *SYNC_DTYPES]:
            rows.append(_local(m, ranks, link, k, 1, 0, "nesterov", gradient_bits, dtype))
    k, fragments, delay = STREAMING
    rows.append(_local(m, ranks, link, k, fragments, delay, "nesterov", gradient_bits, "fp32"))
    if link.nodes(ranks) > 1:
        rows += _per_node(m, ranks, link, run_bits / gradient_bits)
    return rows


def _size_options(bucket_mb: float, last_mb: float) -> dict[str, float]:
    """The options for buckets of ``bucket_mb``: the last bucket's limit too where it is larger (it would
    hold the first layers' gradients up to its own limit)."""
    if bucket_mb < last_mb:
        return {"comm_buffer_size": bucket_mb, "last_comm_buffer_size": bucket_mb}
    return {"comm_buffer_size": bucket_mb}


def _run_wire_bits(settings: Mapping[str, Any], gradient_bits: int) -> int:
    """The bits the run's gradients travelled in: its ``comm_dtype``, or a named compression hook's."""
    dtype = settings.get("comm_dtype")
    if dtype:
        return wire_bits(dtype)
    hook = str(settings.get("comm_hook") or "")
    for name in compressions():
        if hook.startswith(f"{name}_compress"):
            return wire_bits(name)
    return gradient_bits


def _sizes(m: Measured) -> str:
    mb = [sum(m.parameter_bytes[i] for i in bucket) / MB for bucket in m.bucket_sizes]
    shown = ", ".join(f"{size:.3g}" for size in mb[:4]) + (", ..." if len(mb) > 4 else "")
    return f"{len(mb)} of {shown} MB"


def _buckets(m: Measured, bucket_mb: float, last_mb: float) -> Sequence[Sequence[int]]:
    """The buckets lit_dp would cut with these limits, as positions in ready order, in launch order;
    the run's own (the same object) where they are the run's, so that they are re-timed as they ran."""
    tensors = [torch.empty(nbytes, dtype=torch.uint8, device="meta") for nbytes in m.parameter_bytes]
    forward = list(reversed(range(len(tensors))))
    limits = (max(1, int(last_mb * MB)), max(1, int(bucket_mb * MB)))
    cut = launch_order(tensors, [False] * len(tensors), forward, limits)  # type: ignore[arg-type]
    same = [sorted(bucket) for bucket in cut] == [sorted(bucket) for bucket in m.bucket_sizes]
    return m.bucket_sizes if same else cut


def _dp_step(
    m: Measured,
    sample: StepSample,
    timing: _Timing,
    buckets: Sequence[Sequence[int]],
    collective_ms: Callable[[float], float],
    wire: float,
    cast_ms_per_mb: float,
    as_run: bool = False,
) -> tuple[float, float]:
    """(step, exposed) of one sample with these buckets (see the module docstring); ``as_run``: the
    run's own buckets on its own link, each taking the time it took."""
    own = buckets is m.bucket_sizes
    shift = main_free = link_free = 0.0
    for position, members in enumerate(buckets):
        nbytes = sum(m.parameter_bytes[i] for i in members)
        ready = max(sample.parameter_ready_ms[i] for i in members)
        launch = sample.launch_ms[position] if own else m.launch_cost_ms(nbytes) * timing.launch_factor
        cost = launch + cast_ms_per_mb * nbytes / MB
        launched = max(ready + shift, main_free) + cost
        if ready <= sample.backward_ms:
            shift += cost
        main_free = launched
        if as_run:
            on_link = sample.link_ms[position]
        else:
            on_link = collective_ms(nbytes * wire) * timing.link_factor
            if position == 0:  # the host's delay of this step (a late peer holds up its first collective)
                on_link = max(0.0, on_link + timing.link_extra_ms)
        link_free = max(launched, link_free) + on_link
    backward_end = sample.backward_ms + shift
    exposed = max(0.0, link_free - backward_end) + sample.writeback_ms
    # The host work after the wait for the link costs what this wait adds, not what the run's did.
    resumed = 0.0 if as_run else m.resume.after(link_free - max(backward_end, main_free)) - m.resume.after(sample.idle_ms)
    return sample.forward_ms + backward_end + exposed + sample.rest_ms + resumed, exposed


def _zero(m: Measured, ranks: int, link: Link, stage: int, wire: float) -> Prediction:
    model = m.model_bytes * wire
    if stage == 1:
        collective = lambda s: link.allreduce_ms(s, ranks)  # noqa: E731
    else:  # each bucket reduced to its owners, and its flags all-reduced on their own
        collective = lambda s: link.half_ms(s, ranks) + link.allreduce_ms(0, ranks)  # noqa: E731
    gather = link.half_ms(model, ranks)  # the owners' updated parameters, to every rank
    saved = (1 - 1 / ranks) * m.optimizer_ms if m.optimizer_ms is not None else 0.0
    step, exposed = _median_of(
        m, link, lambda sample, timing: _dp_step(m, sample, timing, m.bucket_sizes, collective, wire, 0.0)
    )
    gradients = ring_share(ranks) if stage == 1 else (ranks - 1) / ranks
    return Prediction(
        f"ZeRO-{stage} (sharding.stage={stage})",
        {"sharding.stage": stage},
        ranks,
        step + gather - saved,
        exposed + gather,
        (gradients + (ranks - 1) / ranks) * model,
        m.compute_ms,
        exact=True,
    )


def _local(
    m: Measured,
    ranks: int,
    link: Link,
    k: int,
    fragments: int,
    delay: int,
    outer: str,
    gradient_bits: int,
    dtype: str | None,
) -> Prediction:
    """LocalSGD (``outer="average"``) or DiLoCo, every K steps in ``fragments`` fragments, applied ``delay`` steps late."""
    bits = gradient_bits if dtype in (None, "fp32") else wire_bits(dtype)
    fragment = m.model_bytes / fragments
    wire = fragment * bits / gradient_bits
    size = m.settings.get("comm_buffer_size")
    bucket = (
        float(size) if isinstance(size, (int, float)) else DEFAULT_BUCKET_MB
    )  # LocalSGD's buckets: comm_buffer_size's
    pieces = max(1, math.ceil(wire / (bucket * MB)))
    on_link = link.allreduce_ms(8, ranks) + pieces * link.allreduce_ms(wire / pieces, ranks)
    host = SYNC_PASSES[outer] * fragment / MB * _ms_per_mb(m)

    def step(sample: StepSample, timing: _Timing) -> tuple[float, float]:
        wait = max(0.0, on_link * timing.link_factor - delay * sample.local_compute_ms)
        exposed = (wait + host * timing.launch_factor) * fragments / k
        # A local step runs no reducer and waits for no link: its host work is the run's without the
        # reducer's and without the resume after the run's wait; the host work after a sync's wait
        # pays that wait's.
        resumed = m.resume.after(wait) * fragments / k - m.resume.after(sample.idle_ms)
        return sample.local_compute_ms + exposed + resumed, exposed

    step_ms, exposed_ms = _median_of(m, link, step)
    options: dict[str, Any] = {"local_sgd.steps": k}
    if outer != "average":
        options["local_sgd.outer"] = outer
    if dtype not in (None, "fp32"):
        options["local_sgd.sync_dtype"] = dtype
    if fragments > 1:
        options["local_sgd.fragments"] = fragments
    if delay:
        options["local_sgd.sync_delay"] = delay
    if outer == "average":
        name = f"LocalSGD, averaging every {k} steps"
    else:
        streaming = f", {fragments} fragments, sync_delay={delay}" if fragments > 1 else ""
        name = f"DiLoCo K={k}{streaming}, syncs in {dtype}"
    return Prediction(
        name,
        options,
        ranks,
        step_ms,
        exposed_ms,
        ring_share(ranks) * m.model_bytes * bits / gradient_bits / k,
        m.compute_ms,
        exact=False,
        note=DILOCO_QUALITY,
    )


def _per_node(m: Measured, ranks: int, link: Link, wire: float) -> list[Prediction]:
    """Replica groups per node (torchft): the hierarchical all-reduce every step, or DiLoCo across the groups."""
    per_node = link.ranks_per_node or ranks
    nodes = link.nodes(ranks)
    options = {"fault_tolerance": "torchft"}
    step, exposed = _median_of(
        m,
        link,
        lambda sample, timing: _dp_step(
            m, sample, timing, m.bucket_sizes, lambda s: link.hierarchical_ms(s, ranks), wire, 0.0
        ),
    )
    rows = [
        Prediction(
            f"replica groups of {per_node} ranks, one per node (hierarchical all-reduce)",
            options,
            ranks,
            step,
            exposed,
            link.hierarchical_bytes(m.model_bytes * wire, ranks),
            m.compute_ms,
            exact=True,
        )
    ]
    inside = Link(link.bandwidth, link.latency)
    across = Link(link.inter_node or link.bandwidth, link.latency)
    k = DILOCO_K[0]
    sync = across.allreduce_ms(m.model_bytes / per_node, nodes) + SYNC_PASSES[
        "nesterov"
    ] * m.model_bytes / MB * _ms_per_mb(m)
    step, exposed = _median_of(
        m,
        link,
        lambda sample, timing: _dp_step(
            m, sample, timing, m.bucket_sizes, lambda s: inside.allreduce_ms(s, per_node), wire, 0.0
        ),
    )
    rows.append(
        Prediction(
            f"DiLoCo K={k} across replica groups of {per_node} ranks per node",
            {**options, "local_sgd.steps": k, "local_sgd.outer": "nesterov"},
            ranks,
            step + sync / k,
            exposed + sync / k,
            ring_share(per_node) * m.model_bytes + ring_share(nodes) * m.model_bytes / per_node / k,
            m.compute_ms,
            exact=False,
            note=DILOCO_QUALITY,
        )
    )
    return rows


def _ms_per_mb(m: Measured) -> float:
    """The host's cost of one pass over a MB of gradients: the run's write-back, which copies every
    averaged gradient into ``.grad`` once (a bucket launch's per-byte part can hold the collective
    itself, where the ranks share cores and its thread takes the launching one's)."""
    return m.median("writeback_ms") / max(m.model_bytes / MB, 1e-9)
