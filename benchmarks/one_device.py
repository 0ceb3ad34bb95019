"""What one device pays for a process group of one rank: lit_dp and torch DDP against the bare model.

    python -m benchmarks.one_device
    python -m benchmarks.one_device device=cuda threads=8

Under ``"paddle_dp"`` and ``"ddp"`` a single device still gets a one-rank group and a wrapped
model (so code calling ``torch.distributed`` works and misuse raises as on many devices). This
times a training step three ways in one process, interleaved in rounds whose order rotates so
drift hits them alike: the bare model, ``DistributedDataParallel`` and ``lit_dp.DataParallel``,
both on the one-rank group (Gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import MODELS, MODES, benchmark_main, interleaved_times, train_step, wrap
from lit_dp import ParallelEnv, destroy_parallel_env, init_parallel_env


@dataclass
class OneDeviceBenchmarkConfig:
    """What to measure."""

    device: str = "cpu"  # cpu or cuda
    steps: int = 20  # timed steps per mode per round
    warmup: int = 5
    rounds: int = 10
    threads: int = 1  # CPU threads; 1 keeps the wrappers' Python cost visible next to the math
    models: tuple[str, ...] = ("digits_mlp", "many_small", "few_large")


def _time_steps(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        train_step(model, optimizer, inputs)
        if inputs.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def run(config: OneDeviceBenchmarkConfig) -> dict[str, dict[str, float]]:
    """Median step seconds per model and mode."""
    device = torch.device(config.device, 0) if config.device == "cuda" else torch.device(config.device)
    torch.set_num_threads(config.threads)
    owns_group = not dist.is_initialized()
    init_parallel_env("auto", parallel_env=ParallelEnv({}), one_process_group=True)
    results: dict[str, dict[str, float]] = {}
    try:
        for name in config.models:
            build, width, batch = MODELS[name]
            torch.manual_seed(0)
            base = build().to(device)
            models = {mode: wrap(mode, copy.deepcopy(base)) for mode in MODES}
            inputs = torch.randn(batch, width, device=device)
            times = interleaved_times(models, inputs, _time_steps, config.warmup, config.rounds, config.steps)
            results[name] = {mode: statistics.median(t) for mode, t in times.items()}
    finally:
        if owns_group:
            destroy_parallel_env()
    return results


def report(results: dict[str, dict[str, float]], config: OneDeviceBenchmarkConfig) -> str:
    lines = [
        f"| model ({config.device}) | bare (ms) | DDP (ms) | lit_dp (ms) | DDP / bare | lit_dp / bare | lit_dp / DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        bare, ddp, ours = row["none"], row["ddp"], row["lit_dp"]
        lines.append(
            f"| {name} | {bare * 1e3:.3f} | {ddp * 1e3:.3f} | {ours * 1e3:.3f} | {ddp / bare:.3f} "
            f"| {ours / bare:.3f} | {ours / ddp:.3f} |"
        )
    return "\n".join(lines)


main = benchmark_main("one_device", OneDeviceBenchmarkConfig, lambda config: report(run(config), config))


if __name__ == "__main__":
    main()
