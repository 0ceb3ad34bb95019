"""lit_dp's reducer against torch DDP and no synchronisation: step times and peak memory on 2 Gloo processes.

    python -m benchmarks.reducer
    python -m benchmarks.reducer steps=50 rounds=5 comm_buffer_size=5 models=[digits_mlp]

Prints Markdown tables: per model, median step times of no synchronisation, torch DDP, lit_dp
with its defaults (the hang watchdog, the straggler report and the replica-consistency check
on) and lit_dp with nothing watching (``hang_timeout=None``, both checks off), side by side in
the same processes; lit_dp / DDP for both, what watching costs (defaults / unwatched), and the
cost of synchronisation per tensor and step; then peak RSS of rank 0 with and without gradient
views, measured in fresh process pairs (peak RSS only grows).

The speed ranks run with glibc's malloc thresholds fixed (``steady_malloc``): by default glibc
decides from a process's history whether a freed gradient of a few MB goes back to the OS, and
a step that gets it back page-faults on every byte of it (one wrapper measured 33 faults per
step in one process and 9,251 in the next, on the wide MLP), so step times measured the heap's
history more than the wrappers.
"""

from __future__ import annotations

import copy
import resource
import statistics
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from benchmarks.common import (
    MODELS,
    MODES,
    barrier_aligned_steps,
    benchmark_main,
    few_large_tensors,
    fixed_malloc_thresholds,
    init_gloo_rank,
    interleaved_times,
    run_ranks,
    train_step,
    wrap,
)

UNWATCHED = "lit_dp unwatched"
# lit_dp with nothing watching its steps: the baseline that the defaults' watching is measured against.
WATCHING_OFF = {"hang_timeout": None, "straggler_every_n_steps": None, "consistency_every_n_steps": None}
SPEED_MODES = (*MODES, UNWATCHED)


@dataclass
class ReducerBenchmarkConfig:
    """What to measure."""

    world_size: int = 2
    steps: int = 10  # timed steps per mode per round
    warmup: int = 5
    rounds: int = 12  # modes alternate round by round, so drift hits them alike
    comm_buffer_size: float = 25
    last_comm_buffer_size: float = 1
    threads_per_rank: int = 1  # 2 ranks on 2 cores
    models: tuple[str, ...] = ("wide_mlp", "few_large", "many_small", "many_small_norm")
    measure_memory: bool = True  # peak RSS of fresh process pairs, with and without gradient views
    steady_malloc: bool = True  # glibc keeps freed blocks (see the module docstring)


def _wrap(mode: str, model: torch.nn.Module, config: ReducerBenchmarkConfig, as_view: bool = False) -> torch.nn.Module:
    if mode not in ("lit_dp", UNWATCHED):
        return wrap(mode, model, config.comm_buffer_size, gradient_as_bucket_view=as_view)
    watching = WATCHING_OFF if mode == UNWATCHED else {}
    return wrap(
        "lit_dp",
        model,
        config.comm_buffer_size,
        last_comm_buffer_size=config.last_comm_buffer_size,
        gradient_as_bucket_view=as_view,
        **watching,
    )


def _speed_worker(rank: int, config: ReducerBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    for name in config.models:
        build, width, batch = MODELS[name]
        torch.manual_seed(0)
        base = build()
        models = {mode: _wrap(mode, copy.deepcopy(base), config) for mode in SPEED_MODES}
        inputs = torch.randn(batch, width)
        times = interleaved_times(models, inputs, barrier_aligned_steps, config.warmup, config.rounds, config.steps)
        if rank == 0:
            row = {mode: statistics.median(t) for mode, t in times.items()}
            row["buckets"] = len(models["lit_dp"].reducer.bucket_indices)
            row["tensors"] = len(list(base.parameters()))
            results[name] = row  # one assignment: a managed dict does not see nested updates
    lit_dp.destroy_parallel_env()


def _memory_worker(
    rank: int, config: ReducerBenchmarkConfig, mode: str, as_view: bool, port: int, results: dict
) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    torch.manual_seed(0)
    model = _wrap(mode, few_large_tensors(), config, as_view=as_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(8, 2048)
    for _ in range(config.warmup):
        train_step(model, optimizer, inputs)
    if rank == 0:
        results["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    lit_dp.destroy_parallel_env()


def run(config: ReducerBenchmarkConfig) -> tuple[dict, dict]:
    """Returns (median step seconds per model and mode, peak RSS MiB per (mode, gradient views))."""
    # Freed blocks up to 32 MB are kept and the heap is never trimmed: after warm-up no step page-faults.
    steady = fixed_malloc_thresholds(32 * 2**20, trim_bytes=4 * 2**30) if config.steady_malloc else nullcontext()
    with steady:
        speed = run_ranks(_speed_worker, config.world_size, config)
    memory = {}
    if config.measure_memory:
        # Every large tensor then goes back to the OS when freed, so peak RSS tracks the live tensors.
        with fixed_malloc_thresholds(64 * 1024):
            for mode in ("ddp", "lit_dp"):
                for as_view in (False, True):
                    peak = run_ranks(_memory_worker, config.world_size, config, mode, as_view)
                    memory[(mode, as_view)] = peak["peak_mib"]
    return speed, memory


def report(speed: dict, memory: dict) -> str:
    lines = [
        "| model | tensors | lit_dp buckets | no sync (ms) | DDP (ms) | lit_dp (ms) | lit_dp unwatched (ms) "
        "| lit_dp / DDP | unwatched / DDP | lit_dp / unwatched | DDP us/tensor | lit_dp us/tensor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in speed.items():
        # The cost of synchronisation per tensor and step: time over the no-sync floor, all-reduce included.
        per_tensor = {mode: (row[mode] - row["none"]) / row["tensors"] * 1e6 for mode in ("ddp", "lit_dp")}
        lines.append(
            f"| {name} | {row['tensors']} | {row['buckets']} | {row['none'] * 1e3:.2f} | {row['ddp'] * 1e3:.2f} "
            f"| {row['lit_dp'] * 1e3:.2f} | {row[UNWATCHED] * 1e3:.2f} | {row['lit_dp'] / row['ddp']:.3f} "
            f"| {row[UNWATCHED] / row['ddp']:.3f} | {row['lit_dp'] / row[UNWATCHED]:.3f} "
            f"| {per_tensor['ddp']:.2f} | {per_tensor['lit_dp']:.2f} |"
        )
    if not memory:
        return "\n".join(lines)
    lines += ["", "| peak RSS, rank 0, few_large (MiB) | gradients copied | gradient views |", "|---|---|---|"]
    for mode in ("ddp", "lit_dp"):
        lines.append(f"| {mode} | {memory[(mode, False)]:.0f} | {memory[(mode, True)]:.0f} |")
    return "\n".join(lines)


main = benchmark_main("reducer", ReducerBenchmarkConfig, lambda config: report(*run(config)))


if __name__ == "__main__":
    main()
