"""What the benchmarks share: ranks on Gloo, the models, the wrappers, one training step, interleaved timing.

Every benchmark compares lit_dp with its peer in one run: the modes run in the same processes,
in rounds whose order rotates, so machine noise and drift hit them alike, and the reports give
medians and ratios (``interleaved_times``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

Config = TypeVar("Config")
Result = TypeVar("Result")
Named = TypeVar("Named")
# The modes compared: no synchronisation (the floor), torch DDP (the yardstick), lit_dp.
MODES = ("none", "ddp", "lit_dp")
CONFIGS = Path(__file__).resolve().parent / "conf"


def check_timing_from(timing_from: int, local_steps: int, max_steps: int) -> None:
    """The first step a LocalSGD benchmark times: a sync step (a multiple of ``local_steps``) before the last."""
    if timing_from % local_steps or not 0 <= timing_from < max_steps:
        raise ValueError(
            f"timing_from={timing_from} is invalid: expected a multiple of local_steps={local_steps} below max_steps={max_steps}."
        )


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
    """The 3 x 1024 MLP of the training sweep (64 inputs, 10 classes): 9 MB of gradients."""
    widths = [64, 1024, 1024, 1024]
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


def wide_mlp() -> nn.Module:
    """12 x Linear(1024, 1024): 12.6M parameters (50 MB of gradients) in 24 tensors, each weight
    4 MB (all-reduced in place by lit_dp on CPU, copied into buckets by DDP)."""
    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(12)))


def deep_mlp() -> nn.Module:
    """24 layers of 512 x 512 (1 MB of weights each, 24 MB in all): the bucket size sets how many
    all-reduces a step makes (about one per layer at 1 MB, two at 25 MB), so it matters here."""
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers)


# name: (builder, input width, batch per rank)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, int]] = {
    "few_large": (few_large_tensors, 2048, 8),
    "many_small": (many_small_tensors, 32, 64),
    "many_small_norm": (many_small_norm, 64, 32),
    "wide_mlp": (wide_mlp, 1024, 32),
    "digits_mlp": (digits_mlp, 64, 32),
    "deep_mlp": (deep_mlp, 512, 32),
}


def wrap(
    mode: str,
    model: nn.Module,
    comm_buffer_size: float = 25,
    group: dist.ProcessGroup | None = None,
    **lit_dp_options: Any,
) -> nn.Module:
    """``model`` as ``mode`` runs it: bare (``none``), in torch DDP, or in ``lit_dp.DataParallel``.

    ``lit_dp_options`` go to DataParallel; ``gradient_as_bucket_view`` goes to DDP as well.
    """
    import lit_dp

    if mode == "ddp":
        device = next(model.parameters()).device
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=comm_buffer_size,
            gradient_as_bucket_view=lit_dp_options.get("gradient_as_bucket_view", False),
            process_group=group,
        )
    if mode == "lit_dp":
        return lit_dp.DataParallel(model, process_group=group, comm_buffer_size=comm_buffer_size, **lit_dp_options)
    if mode != "none":
        raise ValueError(f"mode={mode!r} is invalid: expected one of {', '.join(MODES)}.")
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    """One step of the models above on a squared-output loss."""
    optimizer.zero_grad(set_to_none=True)
    model(inputs).square().mean().backward()
    optimizer.step()


def barrier_aligned_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, count: int
) -> list[float]:
    """Seconds of each of ``count`` steps, the ranks aligned by a barrier before each, so a step's
    time is not another rank's lag."""
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        train_step(model, optimizer, inputs)
        times.append(time.perf_counter() - start)
    return times


def block_of_steps(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, count: int) -> list[float]:
    """One sample: seconds per step over ``count`` consecutive steps, as training runs them (no barrier
    between them); the block ends when the slowest rank is done."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        train_step(model, optimizer, inputs)
    dist.barrier()
    return [(time.perf_counter() - start) / count]


def rotated(names: Sequence[Named], round_index: int) -> list[Named]:
    """``names`` in round ``round_index``'s order: rotated by one each round, so that no name always
    follows the same one (caches, allocator state) and drift hits them alike."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


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
        for mode in rotated(modes, round_index):
            times[mode] += time_steps(models[mode], optimizers[mode], inputs, steps)
    return times


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The lighthouse's flags for the fault-tolerance benchmarks, all on one machine: a quorum every
# 10 ms, a join wait of 0.5 s, a replica group dead after 1 s without a heartbeat.
LIGHTHOUSE_FLAGS = ("--quorum_tick_ms", "10", "--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1000")


def start_lighthouse(folder: Path, min_replicas: int, flags: Sequence[str]) -> tuple[subprocess.Popen, str]:
    """A ``torchft_lighthouse`` on a free port, its output in ``folder/lighthouse.log``; the process
    and the address for ``TORCHFT_LIGHTHOUSE``."""
    port = free_port()
    command = ["torchft_lighthouse", "--min_replicas", str(min_replicas), *flags, "--bind", f"[::]:{port}"]
    with (folder / "lighthouse.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://{socket.gethostname()}:{port}"


def init_gloo_rank(rank: int, world_size: int, port: int) -> None:
    """Join a Gloo group of ``world_size`` local processes through lit_dp's launcher variables."""
    import lit_dp

    environ = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PADDLE_DISTRI_BACKEND": "gloo",
    }
    lit_dp.init_parallel_env(parallel_env=lit_dp.ParallelEnv(environ))


def run_ranks(worker: Callable[..., None], world_size: int, *args: Any) -> dict:
    """Spawn ``worker(rank, *args, port, results)`` on ``world_size`` ranks; what they put in ``results``."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(*args, free_port(), results), nprocs=world_size)
        return dict(results)


@contextmanager
def fixed_malloc_thresholds(mmap_bytes: int, trim_bytes: int | None = None) -> Iterator[None]:
    """Fix glibc's malloc thresholds for the processes started inside (read at their start).

    By default glibc decides from a process's history whether a freed block of several MB goes
    back to the OS, so a large gradient may cost page faults in some wrappers' steps and not in
    others', and peak RSS tracks the heap's growth rather than the live tensors. A setting the
    environment already has wins.
    """
    wanted = {"MALLOC_MMAP_THRESHOLD_": str(mmap_bytes)}
    if trim_bytes is not None:
        wanted["MALLOC_TRIM_THRESHOLD_"] = str(trim_bytes)
    added = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            del os.environ[name]


def cost_and_noise(times: dict[str, float]) -> tuple[float, float]:
    """For a feature timed "off", "on", "off again" side by side: on against the mean of the two
    offs (its cost), and off against off again (the noise floor that cost must beat)."""
    return times["on"] / ((times["off"] + times["off again"]) / 2), times["off"] / times["off again"]


def run_steady_ranks(worker: Callable[..., Any], config: Any, world_size: int = 2) -> dict:
    """``run_ranks`` for interleaved timing of identical wrappers: glibc keeps freed blocks up to
    32 MB and trims only past 4 GB, so a large gradient costs the same page faults in every
    wrapper's step (with glibc's history-driven default two identical wrappers differed by 10 to 15%)."""
    with fixed_malloc_thresholds(32 * 2**20, trim_bytes=4 * 2**30):
        return run_ranks(worker, world_size, config)


# Running recipes/gpt.py under torchrun, as the fault-tolerance benchmarks do (ft_groups, ft_diloco).
ROOT = Path(__file__).resolve().parents[1]


class StepClock(pl.Callback):
    """The wall clock at the end of each training step, by ``trainer.global_step``, written as JSON
    to ``path`` by the trainer's rank 0 when training ends."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.times: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        self.times[trainer.global_step] = time.monotonic()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.times))


def final_metrics(output: str, label: str) -> dict[str, float]:
    """The figures of a recipe's ``[lit_dp] final`` line (its last) in ``output``."""
    lines = [line for line in output.splitlines() if line.startswith("[lit_dp] final ")]
    if not lines:
        raise RuntimeError(f"{label}: no '[lit_dp] final' line in its output:\n{output[-3000:]}")
    return {key: float(value) for key, value in re.findall(r"(\S+?)=([-\d.]+)", lines[-1])}


def environment(**variables: str) -> dict[str, str]:
    """The environment of a recipe's ranks under a benchmark, with ``variables``."""
    return {
        **os.environ,
        # The ranks share the cores; RUST_LOG: torchft's Rust side logs every quorum at INFO otherwise.
        "OMP_NUM_THREADS": "1",
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
        # benchmarks.common.StepClock (and the callbacks a benchmark adds) must import in the recipe's processes.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **variables,
    }


def torchrun(ranks: int) -> list[str]:
    """``torchrun --standalone --nproc-per-node=ranks``, as this Python runs it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]


def run_all(commands: list[tuple[list[str], dict[str, str], Path]], timeout: float, label: str) -> None:
    """Start every torchrun (argv, environment, log) at once and wait for all to exit 0; one that still
    runs at the end (a failure, the timeout) gets SIGTERM, which torchrun passes on to its workers
    (each in a session of its own, out of reach of a signal to torchrun's process group), then SIGKILL."""
    launchers = []
    try:
        for argv, env, log in commands:
            with log.open("w") as out:
                launchers.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for launcher, (argv, _, log) in zip(launchers, commands):
            try:
                launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"{label}: {' '.join(argv)} did not end within {timeout:.0f} s; its output ends:\n"
                    + log.read_text(errors="replace")[-3000:]
                ) from None
            if launcher.returncode != 0:
                raise RuntimeError(
                    f"{label}: {' '.join(argv)} exited {launcher.returncode}; its output ends:\n"
                    + log.read_text(errors="replace")[-3000:]
                )
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.terminate()
                try:
                    launcher.wait(timeout=60)  # torchrun's own grace for its workers is 30 s
                except subprocess.TimeoutExpired:
                    launcher.kill()
                    launcher.wait()


def benchmark_main(config_name: str, config_cls: type[Config], run_and_report: Callable[[Config], str]) -> Callable[[], None]:
    """A script's entry point: its Hydra config ``benchmarks/conf/<config_name>.yaml`` as
    ``config_cls``, measured and printed by ``run_and_report``."""
    import hydra

    @hydra.main(config_path=str(CONFIGS), config_name=config_name, version_base="1.3")
    def main(cfg: Any) -> None:
        print(run_and_report(config_from(config_cls, cfg)))

    return main


def in_runs_folder(folder: str | None, run: Callable[[Path], Result]) -> Result:
    """``run(root)`` with its recipe runs in ``folder`` (made if missing; a benchmark reuses the runs it finds
    finished there), or in a temporary folder, removed afterwards, when ``folder`` is None."""
    if folder is not None:
        root = Path(folder).resolve()
        root.mkdir(parents=True, exist_ok=True)
        return run(root)
    with tempfile.TemporaryDirectory() as temporary:
        return run(Path(temporary))


def config_from(cls: type[Config], cfg: Any) -> Config:
    """A benchmark's dataclass config from its Hydra config (lists become tuples where the field is one)."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(cfg, resolve=True)
    fields = {field.name: field for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kept = {name: value for name, value in values.items() if name in fields}
    for name, value in kept.items():
        if isinstance(value, list) and "tuple" in str(fields[name].type):
            kept[name] = tuple(value)
    return cls(**kept)
