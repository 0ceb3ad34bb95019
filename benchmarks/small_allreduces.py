"""What do a step's small all-reduces cost the host? The same bytes in one all-reduce and in buckets.

    python -m benchmarks.small_allreduces                     # the digits recipe's 3 buckets at 0.02 MB
    python -m benchmarks.small_allreduces floats=[25000] tries=100

On 2 gloo processes, the gradients of ``floats`` (one entry per bucket) all-reduced four ways,
each way ``tries`` times after a barrier, in ``rounds`` rounds whose order rotates:

- **one**: one all-reduce of every bucket's floats together (a bucket large enough for all);
- **waited one by one**: each bucket's all-reduce started once the previous one completed;
- **launched back to back**: every bucket's all-reduce started, then each waited for (a
  reducer's buckets when backward has ended);
- **behind host work**: the same, with ``host_work_ms`` of host work between the launches and the
  wait (a reducer's buckets launched during backward, the rest of backward after them).

Per way the median over the tries of every round, its 90th percentile (a Gloo all-reduce is slow
now and then on its own: the median hides how often), and what each all-reduce beyond the first
adds: ``(way - one) / (buckets - 1)`` at the median, the host work left out of the way behind it
(what the all-reduces took beyond it). The forecast (docs/forecast.md) takes a bucket to cost its
latency and bytes on the link as the link probe fits them (all-reduces of 32 KB to 8 MB, each
timed alone); this measures what a burst of small ones costs beyond that.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.common import benchmark_main, init_gloo_rank, rotated, run_ranks

WAYS = ("one", "waited one by one", "launched back to back", "behind host work")


@dataclass
class SmallAllReducesBenchmarkConfig:
    """What to measure."""

    floats: tuple[int, ...] = (1418, 16512, 8192)  # per bucket: the digits recipe's buckets at comm_buffer_size=0.02
    host_work_ms: float = 0.4  # between the launches and the wait, in "behind host work"
    tries: int = 300
    rounds: int = 2
    warmup: int = 20  # tries left out of each way's median, per round


def _busy(milliseconds: float) -> None:
    until = time.perf_counter() + milliseconds / 1e3
    while time.perf_counter() < until:
        pass


def _ways(config: SmallAllReducesBenchmarkConfig) -> dict[str, Callable[[], None]]:
    whole = torch.ones(sum(config.floats))
    buckets = [torch.ones(count) for count in config.floats]

    def one_by_one() -> None:
        for bucket in buckets:
            dist.all_reduce(bucket)

    def back_to_back(host_work_ms: float) -> None:
        works = [dist.all_reduce(bucket, async_op=True) for bucket in buckets]
        _busy(host_work_ms)
        for work in works:
            work.wait()

    return {
        "one": lambda: dist.all_reduce(whole),
        "waited one by one": one_by_one,
        "launched back to back": lambda: back_to_back(0.0),
        "behind host work": lambda: back_to_back(config.host_work_ms),
    }


def _worker(rank: int, config: SmallAllReducesBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(1)
    init_gloo_rank(rank, 2, port)
    ways = _ways(config)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_number in range(config.rounds):
        for way in rotated(WAYS, round_number):
            taken = []
            for _ in range(config.warmup + config.tries):
                dist.barrier()
                began = time.perf_counter()
                ways[way]()
                taken.append((time.perf_counter() - began) * 1e3)
            times[way] += taken[config.warmup :]
    if rank == 0:
        results.update({way: (statistics.median(samples), _percentile(samples, 0.9)) for way, samples in times.items()})
    lit_dp.destroy_parallel_env()


def _percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[round(share * (len(ordered) - 1))]


def report(results: dict, config: SmallAllReducesBenchmarkConfig) -> str:
    sizes = ", ".join(f"{count * 4 / 1024:.1f}" for count in config.floats)
    lines = [
        f"{len(config.floats)} buckets of {sizes} KB (fp32) on 2 gloo ranks; {config.tries} tries x {config.rounds} rounds",
        "",
        "| way | median (ms) | 90th percentile (ms) | added per all-reduce beyond the first, host work left out (ms) |",
        "|---|---|---|---|",
    ]
    extra = max(1, len(config.floats) - 1)
    one = results["one"][0]
    for way in WAYS:
        median, slow = results[way]
        host = config.host_work_ms if way == "behind host work" else 0.0
        added = "" if way == "one" else f"{(median - host - one) / extra:.3f}"
        lines.append(f"| {way} | {median:.3f} | {slow:.3f} | {added} |")
    return "\n".join(lines)


def run(config: SmallAllReducesBenchmarkConfig) -> dict:
    """Per way: the median time (ms) to all-reduce every bucket, and its 90th percentile."""
    if not config.floats or any(count < 1 for count in config.floats):
        raise ValueError(f"floats={list(config.floats)!r} is invalid: expected one count of 1 or more floats per bucket.")
    for name, least, kinds in (("tries", 1, int), ("rounds", 1, int), ("warmup", 0, int), ("host_work_ms", 0, (int, float))):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, kinds) or value < least:
            what = "a whole number" if kinds is int else "a number"
            raise ValueError(f"{name}={value!r} is invalid: expected {what} of {least} or more.")
    return run_ranks(_worker, 2, config)


main = benchmark_main(
    "small_allreduces", SmallAllReducesBenchmarkConfig, lambda config: report(run(config), config)
)


if __name__ == "__main__":
    main()
