"""Sharding stages 1 and 2 against unsharded lit_dp and torch DDP + ZeroRedundancyOptimizer, on 2 Gloo ranks.

    python -m benchmarks.sharding                                                   # the recorded run
    python -m benchmarks.sharding rounds=2 steps=1 warmup=1 models=[deep_mlp] memory_model=deep_mlp  # smoke

Every mode trains the same model with Adam, one iteration being ``zero_grad``, forward,
backward, ``step``:

- ``lit_dp``: ``lit_dp.DataParallel`` and a plain Adam (no sharding);
- ``zero`` / ``zero_view``: torch's ``DistributedDataParallel`` with ``ZeroRedundancyOptimizer``
  (its default, and ``parameters_as_bucket_view=True``): the nearest peer;
- ``stage1`` / ``stage2``: ``DataParallel(sharding_stage=N)`` with ``lit_dp.ShardedOptimizer``;
- ``stage1_overlap`` / ``stage2_overlap``: the same with ``sharding_overlap=True``, the
  parameter broadcasts left in flight at the end of ``step()`` and waited for, module by
  module, by the next forward.

The modes run in the same processes, interleaved in rounds whose order rotates
(``benchmarks.common.interleaved_times``); the tables give medians of the whole
iteration and of ``optimizer.step()`` alone (for the sharded modes it holds the local step and the
gather, or with overlap the local step and the gather's launch: their difference is the gather
``step()`` no longer waits for; the iterations' difference is how much of it the forward hid).

Memory: each of ``lit_dp``, ``zero``, ``stage1``, ``stage2`` trains ``memory_model`` in a fresh
pair of processes; per rank, the peak RSS (``ru_maxrss``; glibc is told to return freed large
tensors to the OS, as in the reducer's benchmark) and exact tensor bytes: the optimizer state
this rank holds and the gradient storage it keeps after a backward.
"""

from __future__ import annotations

import copy
import resource
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import (
    MODELS,
    benchmark_main,
    fixed_malloc_thresholds,
    init_gloo_rank,
    interleaved_times,
    run_ranks,
)

SPEED_MODES = ("lit_dp", "zero", "zero_view", "stage1", "stage1_overlap", "stage2", "stage2_overlap")
MEMORY_MODES = ("lit_dp", "zero", "stage1", "stage2")
MiB = 2**20


@dataclass
class ShardingBenchmarkConfig:
    world_size: int = 2
    steps: int = 5
    warmup: int = 3
    rounds: int = 10
    comm_buffer_size: float = 25
    last_comm_buffer_size: float = 1
    lr: float = 1e-3
    threads_per_rank: int = 1
    models: tuple[str, ...] = ("deep_mlp", "few_large", "many_small_norm")
    measure_memory: bool = True
    memory_model: str = "few_large"


def build(mode: str, base: nn.Module, config: ShardingBenchmarkConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The wrapped model and its optimizer for ``mode``."""
    import lit_dp

    model = copy.deepcopy(base)
    if mode.startswith("zero"):
        wrapped = DistributedDataParallel(model, bucket_cap_mb=config.comm_buffer_size)
        optimizer = ZeroRedundancyOptimizer(
            wrapped.parameters(),
            optimizer_class=torch.optim.Adam,
            lr=config.lr,
            parameters_as_bucket_view=mode == "zero_view",
        )
        return wrapped, optimizer
    stage = {"lit_dp": None, "stage1": 1, "stage2": 2}[mode.removesuffix("_overlap")]
    wrapped = lit_dp.DataParallel(
        model,
        comm_buffer_size=config.comm_buffer_size,
        last_comm_buffer_size=config.last_comm_buffer_size,
        sharding_stage=stage,
        sharding_overlap=mode.endswith("_overlap"),
    )
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=config.lr)
    if stage is not None:
        optimizer = lit_dp.ShardedOptimizer(optimizer, wrapped)
    return wrapped, optimizer


class Timer:
    """``interleaved_times``'s step function over each model's own optimizer; keeps ``step()`` times too."""

    def __init__(self, optimizers: dict[int, torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.step_times: dict[int, list[float]] = {key: [] for key in optimizers}

    def __call__(
        self, model: nn.Module, _unused: torch.optim.Optimizer, inputs: torch.Tensor, count: int
    ) -> list[float]:
        optimizer = self.optimizers[id(model)]
        times = []
        for _ in range(count):
            dist.barrier()  # align ranks so a step's time is not another rank's lag
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model(inputs).square().mean().backward()
            before_step = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            times.append(end - start)
            self.step_times[id(model)].append(end - before_step)
        return times


def _speed_worker(rank: int, config: ShardingBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    for name in config.models:
        builder, width, batch = MODELS[name]
        torch.manual_seed(0)
        base = builder()
        built = {mode: build(mode, base, config) for mode in SPEED_MODES}
        timer = Timer({id(model): optimizer for model, optimizer in built.values()})
        models = {mode: model for mode, (model, _) in built.items()}
        times = interleaved_times(models, torch.randn(batch, width), timer, config.warmup, config.rounds, config.steps)
        if rank == 0:
            row = {mode: statistics.median(samples) for mode, samples in times.items()}
            row["step"] = {mode: statistics.median(timer.step_times[id(models[mode])]) for mode in SPEED_MODES}
            row["megabytes"] = sum(p.numel() * p.element_size() for p in base.parameters()) / MiB
            results[name] = row  # one assignment: a managed dict does not see nested updates
        del built, models, timer
    lit_dp.destroy_parallel_env()


def _memory_worker(rank: int, config: ShardingBenchmarkConfig, mode: str, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    builder, width, batch = MODELS[config.memory_model]
    torch.manual_seed(0)
    model, optimizer = build(mode, builder(), config)
    inputs = torch.randn(batch, width)
    for _ in range(config.warmup + 1):
        optimizer.zero_grad(set_to_none=True)
        model(inputs).square().mean().backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model(inputs).square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    gradient_bytes = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}.values())
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    state = local.state.values()
    state_bytes = sum(v.nbytes for s in state for v in s.values() if isinstance(v, torch.Tensor))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    results[(mode, rank)] = (rss, state_bytes / MiB, gradient_bytes / MiB)
    lit_dp.destroy_parallel_env()


def run(config: ShardingBenchmarkConfig) -> tuple[dict, dict]:
    """(per model: median seconds per mode and of step(); per (mode, rank): RSS, state and gradient MiB)."""
    speed = run_ranks(_speed_worker, config.world_size, config)
    memory: dict = {}
    if config.measure_memory:
        # Every large tensor then goes back to the OS when freed, so peak RSS tracks the live tensors.
        with fixed_malloc_thresholds(64 * 1024):
            for mode in MEMORY_MODES:
                memory.update(run_ranks(_memory_worker, config.world_size, config, mode))
    return speed, memory


def report(speed: dict, memory: dict, config: ShardingBenchmarkConfig) -> str:
    sharded = [mode for mode in SPEED_MODES if mode.startswith("stage")]
    lines = [
        "Iteration (zero_grad, forward, backward, step), median ms; `/ ZeRO`: against the faster of zero, zero_view.",
        "",
        "| model | MB | " + " | ".join(SPEED_MODES) + " | " + " | ".join(f"{mode} / ZeRO" for mode in sharded) + " |",
        "|---" * (2 + len(SPEED_MODES) + len(sharded)) + "|",
    ]
    for name, row in speed.items():
        peer = min(row["zero"], row["zero_view"])
        times = " | ".join(f"{row[mode] * 1e3:.2f}" for mode in SPEED_MODES)
        ratios = " | ".join(f"{row[mode] / peer:.3f}" for mode in sharded)
        lines.append(f"| {name} | {row['megabytes']:.1f} | {times} | {ratios} |")
    lines += ["", "optimizer.step() alone, median ms (sharded: local step + gather, or + its launch with overlap):", ""]
    lines += ["| model | " + " | ".join(SPEED_MODES) + " |", "|---" * (len(SPEED_MODES) + 1) + "|"]
    for name, row in speed.items():
        lines.append(f"| {name} | " + " | ".join(f"{row['step'][mode] * 1e3:.2f}" for mode in SPEED_MODES) + " |")
    if not memory:
        return "\n".join(lines)
    lines += [
        "",
        (
            f"Memory per rank, {config.memory_model}, MiB: peak RSS; exact bytes of the optimizer state and of the "
            "gradients kept after backward."
        ),
        "",
        "| mode | "
        + " | ".join(f"rank {r} RSS | rank {r} state | rank {r} grads" for r in range(config.world_size))
        + " |",
        "|---" * (1 + 3 * config.world_size) + "|",
    ]
    for mode in MEMORY_MODES:
        cells = " | ".join(
            f"{rss:.0f} | {state:.1f} | {grads:.1f}"
            for rss, state, grads in (memory[(mode, r)] for r in range(config.world_size))
        )
        lines.append(f"| {mode} | {cells} |")
    return "\n".join(lines)


main = benchmark_main("sharding", ShardingBenchmarkConfig, lambda config: report(*run(config), config))


if __name__ == "__main__":
    main()
