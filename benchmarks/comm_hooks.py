"""Gradient compression side by side: bytes all-reduced, step time and what training reaches.

    python -m benchmarks.comm_hooks
    python -m benchmarks.comm_hooks steps=100 tasks=[digits] modes=[fp32,powersgd_1]

Prints a Markdown table: bytes all-reduced per step, median step time, and the digits accuracy
and the charlm validation loss each mode reaches after the same steps.

Every mode trains its own copy of the same model on the same batches in the same 2 gloo
processes; the modes take turns step by step (the order rotating), so machine drift hits them
alike. Bytes are the payload of every ``all_reduce`` a step issues (gradients, PowerSGD's P and
Q, the per-parameter flags), counted per rank.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common import benchmark_main, init_gloo_rank, rotated, run_ranks

# fp32: no hook; allreduce_hook: torch's plain hook, i.e. the cost of the hook path itself.
MODES = ("fp32", "allreduce_hook", "bf16", "powersgd_1", "powersgd_4")


@dataclass
class CommHookBenchmarkConfig:
    """What to measure."""

    world_size: int = 2
    steps: int = 100  # training steps per task and mode
    powersgd_start_iter: int = 10  # PowerSGD's plain warm-up; step times count only later steps
    tasks: tuple[str, ...] = ("digits", "charlm")
    modes: tuple[str, ...] = MODES
    batch_per_rank: int = 32
    threads_per_rank: int = 1


class _AllReduceBytes:
    """Counts the bytes passed to ``torch.distributed.all_reduce`` (hooks call it from Gloo's threads too)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._original = dist.all_reduce

    def __enter__(self) -> _AllReduceBytes:
        def counting(tensor, *args, **kwargs):
            with self._lock:
                self.count += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def _wrap(mode: str, model: nn.Module, start_iter: int) -> nn.Module:
    import lit_dp
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as powersgd

    if mode == "bf16":
        return lit_dp.DataParallel(model, comm_dtype="bf16")
    wrapped = lit_dp.DataParallel(model)
    if mode == "allreduce_hook":
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    if mode.startswith("powersgd_"):
        rank = int(mode.split("_")[1])
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter)
        wrapped.register_comm_hook(state, powersgd.powerSGD_hook)
    return wrapped


def _digits(config: CommHookBenchmarkConfig):
    """The 3 x 1024 MLP of the training sweep on the digits; metric: validation accuracy."""
    from lit_dp_recipes.digits import DigitsDataModule, MLPClassifier

    data = DigitsDataModule()
    data.setup()
    images, labels = data.train_set.tensors
    val_images, val_labels = data.val_set.tensors

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        net = MLPClassifier(hidden_sizes=(1024, 1024, 1024)).net
        return net, torch.optim.Adam(net.parameters(), lr=1e-3)

    def batch(indices: torch.Tensor):
        return images[indices], labels[indices]

    def loss(model: nn.Module, inputs, targets) -> torch.Tensor:
        return F.cross_entropy(model(inputs), targets)

    def evaluate(model: nn.Module) -> float:
        return (model(val_images).argmax(1) == val_labels).float().mean().item()

    return build, len(labels), batch, loss, evaluate


def _charlm(config: CommHookBenchmarkConfig):
    """The charlm recipe's model (2 x 128 GPT) on the stdlib text; metric: validation loss (nats)."""
    from lit_dp_recipes.gpt import GPT
    from lit_dp_recipes.token_data import TokenDataModule

    data = TokenDataModule()
    data.setup()
    every = max(1, len(data.val_set) // 256)  # 256 windows spread over the validation text
    val_pairs = [data.val_set[i] for i in range(0, len(data.val_set), every)]
    val_inputs, val_targets = torch.stack([p[0] for p in val_pairs]), torch.stack([p[1] for p in val_pairs])

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = GPT()
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def batch(indices: torch.Tensor):
        pairs = [data.train_set[int(i)] for i in indices]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def loss(model: nn.Module, inputs, targets) -> torch.Tensor:
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    def evaluate(model: nn.Module) -> float:
        return loss(model, val_inputs, val_targets).item()

    return build, len(data.train_set), batch, loss, evaluate


TASKS = {"digits": _digits, "charlm": _charlm}


def _worker(rank: int, config: CommHookBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    for task in config.tasks:
        build, size, batch, loss, evaluate = TASKS[task](config)
        models, optimizers = {}, {}
        for mode in config.modes:
            torch.manual_seed(0)
            model, optimizers[mode] = build()
            models[mode] = _wrap(mode, model, config.powersgd_start_iter)
        times: dict[str, list[float]] = {mode: [] for mode in config.modes}
        sent: dict[str, int] = {}
        generator = torch.Generator().manual_seed(1)
        for step in range(config.steps):
            chosen = torch.randint(size, (config.world_size * config.batch_per_rank,), generator=generator)
            inputs, targets = batch(chosen[rank :: config.world_size])
            for mode in rotated(config.modes, step):
                dist.barrier()  # align ranks so a step's time is not another rank's lag
                with _AllReduceBytes() as counter:
                    start = time.perf_counter()
                    optimizers[mode].zero_grad(set_to_none=True)
                    loss(models[mode], inputs, targets).backward()
                    optimizers[mode].step()
                    elapsed = time.perf_counter() - start
                if step >= config.powersgd_start_iter:
                    times[mode].append(elapsed)
                    sent[mode] = counter.count
        if rank == 0:
            with torch.no_grad():
                metrics = {mode: evaluate(models[mode].module.eval()) for mode in config.modes}
            results[task] = {
                mode: {"ms": statistics.median(times[mode]) * 1e3, "bytes": sent[mode], "metric": metrics[mode]}
                for mode in config.modes
            }
    lit_dp.destroy_parallel_env()


def run(config: CommHookBenchmarkConfig) -> dict:
    """Per task and mode: median step ms, bytes all-reduced per step and rank, final metric."""
    if config.steps <= config.powersgd_start_iter:
        raise ValueError(
            f"steps={config.steps} is invalid with powersgd_start_iter={config.powersgd_start_iter}: "
            "expected more steps than the warm-up."
        )
    return run_ranks(_worker, config.world_size, config)


def report(results: dict, config: CommHookBenchmarkConfig) -> str:
    metric = {"digits": "val accuracy", "charlm": "val loss (nats)"}
    lines = [
        "| task | mode | all-reduced per step (KiB) | vs fp32 | step (ms) | vs fp32 | "
        f"metric after {config.steps} steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, rows in results.items():
        base = rows.get("fp32")
        for mode, row in rows.items():
            bytes_ratio = f"{row['bytes'] / base['bytes']:.3f}" if base else "-"
            time_ratio = f"{row['ms'] / base['ms']:.2f}" if base else "-"
            value = row["metric"]
            shown = f"{value:.3f}" if math.isfinite(value) else str(value)
            lines.append(
                f"| {task} | {mode} | {row['bytes'] / 1024:.1f} | {bytes_ratio} | {row['ms']:.1f} | {time_ratio} "
                f"| {metric[task]} {shown} |"
            )
    return "\n".join(lines)


main = benchmark_main("comm_hooks", CommHookBenchmarkConfig, lambda config: report(run(config), config))


if __name__ == "__main__":
    main()
