"""How good is ``comm_buffer_size="auto"``? The fixed sizes swept side by side, next to the tuner's choices.

    python -m benchmarks.autotune                        # the reducer benchmark's models and deep_mlp
    python -m benchmarks.autotune threads=4 rounds=12 models=[deep_mlp]

On 2 gloo processes, per model: one ``DataParallel`` per distinct bucket partition of the
autotuner's schedule, timed interleaved in rounds whose order rotates (as in
``benchmarks.reducer``; each round times a block of consecutive steps, as
training runs them), gives the step time of every fixed size. Then
``trials`` fresh ``comm_buffer_size="auto"`` wrappers train until they have chosen; each
choice is scored by the sweep's time for that size against the best fixed size. Last, three
25 MB wrappers, the second with ``comm_stats=True``, alternate round by round on their own:
stats on against the mean of the two without is the overhead of the statistics, and the two
without against each other show the noise floor of that comparison.

The ranks run with glibc's malloc thresholds fixed (unless the environment sets them): by
default glibc decides from the process's history whether a freed block of several MB goes back
to the OS, so a 16 MB gradient likely costs page faults in some wrappers' steps and not in others'.
That moved two identical wrappers 10 to 15% apart; with fixed thresholds, within 3.3%.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.common import (
    MODELS,
    benchmark_main,
    cost_and_noise,
    block_of_steps,
    init_gloo_rank,
    interleaved_times,
    run_steady_ranks,
    train_step,
)


@dataclass
class AutotuneBenchmarkConfig:
    """What to measure."""

    models: tuple[str, ...] = ("few_large", "many_small", "digits_mlp", "deep_mlp")
    threads: int = 1  # torch threads per rank
    rounds: int = 8
    steps: int = 10  # timed steps per size per round
    warmup: int = 5
    trials: int = 3  # fresh autotuned runs per model

    def __post_init__(self) -> None:
        unknown = sorted(set(self.models) - set(MODELS))
        if unknown:
            raise ValueError(f"models={list(self.models)} is invalid: {unknown} unknown; expected some of {sorted(MODELS)}.")


def _interleaved_medians(
    wrappers: dict[str, torch.nn.Module], inputs: torch.Tensor, config: AutotuneBenchmarkConfig
) -> dict[str, float]:
    """Median over rounds (whose order rotates) of each wrapper's mean step time in ms."""
    times = interleaved_times(wrappers, inputs, block_of_steps, config.warmup, config.rounds, config.steps)
    return {mode: statistics.median(t) * 1e3 for mode, t in times.items()}


def _worker(rank: int, config: AutotuneBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp
    from lit_dp.observability.autotune import CANDIDATES_MB

    torch.set_num_threads(config.threads)
    init_gloo_rank(rank, 2, port)
    for name in config.models:
        build, width, batch = MODELS[name]
        torch.manual_seed(0)
        base = build()
        inputs = torch.randn(batch, width)
        # One wrapper per distinct partition (the first candidate of each, as the tuner does).
        wrappers: dict[str, torch.nn.Module] = {}
        seen: set[str] = set()
        for size in CANDIDATES_MB:
            wrapper = lit_dp.DataParallel(copy.deepcopy(base), comm_buffer_size=size)
            train_step(wrapper, torch.optim.SGD(wrapper.parameters(), lr=1e-3), inputs)  # the ready-order rebuild
            key = repr(wrapper.reducer.bucket_indices)
            if key not in seen:
                seen.add(key)
                wrappers[f"{size:g} MB"] = wrapper
        sweep = _interleaved_medians(wrappers, inputs, config)
        buckets = {mode: len(w.reducer.bucket_indices) for mode, w in wrappers.items()}
        del wrappers
        trials = []
        for _ in range(config.trials):
            tuned = lit_dp.DataParallel(copy.deepcopy(base), comm_buffer_size="auto")
            optimizer = torch.optim.SGD(tuned.parameters(), lr=1e-3)
            steps = 0
            while tuned.autotuner.chosen_mb is None:
                train_step(tuned, optimizer, inputs)
                steps += 1
            trials.append({"chosen": tuned.comm_buffer_size, "steps": steps, "sweep": tuned.autotuner.sweep})
        overhead = _interleaved_medians(
            {
                "off": lit_dp.DataParallel(copy.deepcopy(base), comm_buffer_size=25),
                "on": lit_dp.DataParallel(copy.deepcopy(base), comm_buffer_size=25, comm_stats=True),
                "off again": lit_dp.DataParallel(copy.deepcopy(base), comm_buffer_size=25),
            },
            inputs,
            config,
        )
        dist.barrier()
        if rank == 0:
            results[name] = {"median_ms": sweep, "trials": trials, "buckets": buckets, "stats_on_off": overhead}
    lit_dp.destroy_parallel_env()


def report(results: dict) -> str:
    lines = [
        "| model | fixed sizes: step ms (buckets) | best fixed | auto's choices (steps to decide) "
        "| auto / best | comm_stats on / off | off / off again |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        fixed = row["median_ms"]
        sweep = ", ".join(f"{mode} {ms:.2f} ({row['buckets'][mode]})" for mode, ms in fixed.items())
        best = min(fixed, key=fixed.get)
        choices, ratios = [], []
        for trial in row["trials"]:
            mode = f"{trial['chosen']:g} MB"  # the first size of its partition, as in the sweep
            choices.append(f"{trial['chosen']:g} MB ({trial['steps']})")
            ratios.append(f"{fixed[mode] / fixed[best]:.3f}")
        overhead, noise = cost_and_noise(row["stats_on_off"])
        lines.append(
            f"| {name} | {sweep} | {best} | {', '.join(choices)} | {', '.join(ratios)} | {overhead:.3f} | {noise:.3f} |"
        )
    return "\n".join(lines)


def run(config: AutotuneBenchmarkConfig) -> dict:
    """Per model: the fixed sizes' step times, the autotuned trials, the statistics' overhead."""
    return run_steady_ranks(_worker, config)


main = benchmark_main("autotune", AutotuneBenchmarkConfig, lambda config: report(run(config)))


if __name__ == "__main__":
    main()
