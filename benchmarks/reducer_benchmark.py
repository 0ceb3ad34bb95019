"""Side-by-side step times of lit_dp, torch DDP and no synchronisation on 2 gloo processes.

The three modes run in the same processes, interleaved in short rounds whose order rotates,
so machine noise and drift hit them alike; the report gives medians and the lit_dp / DDP ratio. Peak memory is measured in
fresh process pairs, one per configuration, since peak RSS only grows.
"""

from __future__ import annotations

import copy
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass
class BenchmarkConfig:
    """What to measure."""

    world_size: int = 2
    steps: int = 10
    warmup: int = 5
    rounds: int = 12
    comm_buffer_size: float = 25
    last_comm_buffer_size: float = 1
    threads_per_rank: int = 1
    models: tuple[str, ...] = ("few_large", "many_small", "many_small_norm")
    measure_memory: bool = True


def few_large_tensors() -> nn.Module:
    """Three 2048x2048 layers: ~50 MB of fp32 gradients in 6 tensors."""
    return nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(3)))


def many_small_tensors() -> nn.Module:
    """150 small layers: 300 tensors of at most 4 KB."""
    layers: list[nn.Module] = []
    for _ in range(150):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers)


def many_small_norm() -> nn.Module:
    """200 x (Linear(64, 64) + LayerNorm(64)): 800 tensors, where per-parameter costs show."""
    layers: list[nn.Module] = []
    for _ in range(200):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64)]
    return nn.Sequential(*layers)


def digits_mlp() -> nn.Module:
    """The 3 x 1024 MLP that benchmarks/bench_training_sweep.py trains (64 inputs, 10 classes): 9 MB of gradients."""
    widths = [64, 1024, 1024, 1024]
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


def deep_mlp() -> nn.Module:
    """24 layers of 512 x 512 (1 MB of weights each, 24 MB in all): the bucket size sets how many
    all-reduces a step makes (about one per layer at 1 MB, two at 25 MB), so it matters here."""
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers)


# name: (builder, input width, batch per rank)
MODELS = {
    "few_large": (few_large_tensors, 2048, 8),
    "many_small": (many_small_tensors, 32, 64),
    "many_small_norm": (many_small_norm, 64, 32),
    "digits_mlp": (digits_mlp, 64, 32),
    "deep_mlp": (deep_mlp, 512, 32),
}
MODES = ("none", "ddp", "lit_dp")


def _wrap(mode: str, model: nn.Module, config: BenchmarkConfig, as_view: bool = False) -> nn.Module:
    import lit_dp

    if mode == "ddp":
        return DistributedDataParallel(
            model,
            bucket_cap_mb=config.comm_buffer_size,
            gradient_as_bucket_view=as_view,
        )
    if mode == "lit_dp":
        return lit_dp.DataParallel(
            model,
            comm_buffer_size=config.comm_buffer_size,
            last_comm_buffer_size=config.last_comm_buffer_size,
            gradient_as_bucket_view=as_view,
        )
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(inputs).square().mean().backward()
    optimizer.step()


def interleaved_times(
    models: dict[str, nn.Module],
    inputs: torch.Tensor,
    time_steps: Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, int], list[float]],
    warmup: int,
    rounds: int,
    steps: int,
) -> dict[str, list[float]]:
    """Each model's samples from ``time_steps``: all warmed up, then timed in ``rounds`` of
    ``steps`` each, in an order that rotates so no model always follows the same one (caches,
    allocator state) and drift hits them alike."""
    optimizers = {mode: torch.optim.SGD(m.parameters(), lr=1e-3) for mode, m in models.items()}
    modes = list(models)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for mode in modes:
        time_steps(models[mode], optimizers[mode], inputs, warmup)
    for round_index in range(rounds):
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            times[mode] += time_steps(models[mode], optimizers[mode], inputs, steps)
    return times


def _time_steps(model, optimizer, inputs, count) -> list[float]:
    times = []
    for _ in range(count):
        dist.barrier()  # align ranks so a step's time is not another rank's lag
        start = time.perf_counter()
        _step(model, optimizer, inputs)
        times.append(time.perf_counter() - start)
    return times


def _speed_worker(rank: int, config: BenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    for name in config.models:
        build, width, batch = MODELS[name]
        torch.manual_seed(0)
        base = build()
        models = {mode: _wrap(mode, copy.deepcopy(base), config) for mode in MODES}
        inputs = torch.randn(batch, width)
        times = interleaved_times(models, inputs, _time_steps, config.warmup, config.rounds, config.steps)
        if rank == 0:
            row = {mode: statistics.median(t) for mode, t in times.items()}
            row["buckets"] = len(models["lit_dp"].reducer.bucket_indices)
            row["tensors"] = len(list(base.parameters()))
            results[name] = row  # one assignment: a managed dict does not see nested updates
    lit_dp.destroy_parallel_env()


def _memory_worker(rank: int, config: BenchmarkConfig, port: int, mode: str, as_view: bool, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    torch.manual_seed(0)
    model = _wrap(mode, few_large_tensors(), config, as_view=as_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(8, 2048)
    for _ in range(config.warmup):
        _step(model, optimizer, inputs)
    if rank == 0:
        results[(mode, as_view)] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    lit_dp.destroy_parallel_env()


def init_gloo_rank(rank: int, world_size: int, port: int) -> None:
    """Join a Gloo group of ``world_size`` local processes through lit_dp's launcher variables."""
    import lit_dp
    from lit_dp.job.env import ParallelEnv

    environ = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PADDLE_DISTRI_BACKEND": "gloo",
    }
    lit_dp.init_parallel_env(parallel_env=ParallelEnv(environ))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(config: BenchmarkConfig) -> tuple[dict, dict]:
    """Returns (median step seconds per model and mode, peak RSS MiB per (mode, gradient views))."""
    with mp.Manager() as manager:
        speed = manager.dict()
        mp.spawn(_speed_worker, args=(config, free_port(), speed), nprocs=config.world_size)
        memory = manager.dict()
        if not config.measure_memory:
            return dict(speed), {}
        # A fixed mmap threshold makes glibc return every large tensor to the OS when freed, so
        # peak RSS tracks the peak of live tensors instead of the allocator's heap growth.
        previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
        try:
            for mode in ("ddp", "lit_dp"):
                for as_view in (False, True):
                    args = (config, free_port(), mode, as_view, memory)
                    mp.spawn(_memory_worker, args=args, nprocs=config.world_size)
        finally:
            if previous is None:
                del os.environ["MALLOC_MMAP_THRESHOLD_"]
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = previous
        return dict(speed), dict(memory)


def report(speed: dict, memory: dict) -> str:
    lines = [
        "| model | tensors | lit_dp buckets | no sync (ms) | DDP (ms) | lit_dp (ms) | lit_dp / DDP "
        "| DDP us/tensor | lit_dp us/tensor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in speed.items():
        # The cost of synchronisation per tensor and step: time over the no-sync floor, all-reduce included.
        per_tensor = {mode: (row[mode] - row["none"]) / row["tensors"] * 1e6 for mode in ("ddp", "lit_dp")}
        lines.append(
            f"| {name} | {row['tensors']} | {row['buckets']} | {row['none'] * 1e3:.2f} | {row['ddp'] * 1e3:.2f} "
            f"| {row['lit_dp'] * 1e3:.2f} | {row['lit_dp'] / row['ddp']:.3f} "
            f"| {per_tensor['ddp']:.2f} | {per_tensor['lit_dp']:.2f} |"
        )
    if not memory:
        return "\n".join(lines)
    lines += ["", "| peak RSS, rank 0, few_large (MiB) | gradients copied | gradient views |", "|---|---|---|"]
    for mode in ("ddp", "lit_dp"):
        lines.append(f"| {mode} | {memory[(mode, False)]:.0f} | {memory[(mode, True)]:.0f} |")
    return "\n".join(lines)
