"""What does the hang watchdog cost per step? ``hang_timeout`` on against off, interleaved.

    python -m benchmarks.watchdog                          # the reducer benchmark's models
    python -m benchmarks.watchdog rounds=30 steps=20 models=[many_small_norm]

On 2 gloo processes, per model, three ``DataParallel`` wrappers of the same module train side
by side in rounds whose order rotates (``benchmarks.common.interleaved_times``, each sample a
block of consecutive steps, as training runs them): two with the watchdog off, one with it on
(``hang_timeout=300``: its observer events, the waits made in slices, the thread polling the
store). On against the mean of the two offs is the watchdog's cost; off against off is the
noise floor that comparison must beat.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

import torch

from benchmarks.common import (
    MODELS,
    benchmark_main,
    cost_and_noise,
    block_of_steps,
    init_gloo_rank,
    interleaved_times,
    run_steady_ranks,
)

WRAPPERS = ("off", "on", "off again")


@dataclass
class WatchdogBenchmarkConfig:
    """What to measure."""

    models: tuple[str, ...] = ("few_large", "many_small", "many_small_norm")
    threads: int = 1  # torch threads per rank
    rounds: int = 20
    steps: int = 20  # consecutive steps per sample
    warmup: int = 5


def _worker(rank: int, config: WatchdogBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads)
    init_gloo_rank(rank, 2, port)
    for name in config.models:
        build, width, batch = MODELS[name]
        torch.manual_seed(0)
        base = build()
        models = {
            wrapper: lit_dp.DataParallel(copy.deepcopy(base), hang_timeout=300.0 if wrapper == "on" else None)
            for wrapper in WRAPPERS
        }
        inputs = torch.randn(batch, width)
        times = interleaved_times(models, inputs, block_of_steps, config.warmup, config.rounds, config.steps)
        if rank == 0:
            results[name] = {wrapper: statistics.median(samples) * 1e3 for wrapper, samples in times.items()}
    lit_dp.destroy_parallel_env()


def report(results: dict) -> str:
    lines = [
        "| model | off (ms) | on (ms) | off again (ms) | on / mean(off) | off / off again (noise) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        cost, noise = cost_and_noise(row)
        lines.append(
            f"| {name} | {row['off']:.3f} | {row['on']:.3f} | {row['off again']:.3f} | {cost:.3f} | {noise:.3f} |"
        )
    return "\n".join(lines)


def run(config: WatchdogBenchmarkConfig) -> dict:
    """Per model: the median step time of each wrapper, ms."""
    return run_steady_ranks(_worker, config)


main = benchmark_main("watchdog", WatchdogBenchmarkConfig, lambda config: report(run(config)))


if __name__ == "__main__":
    main()
