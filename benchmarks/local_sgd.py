"""LocalSGD against plain data parallelism: bytes communicated, step time and digits accuracy.

    python -m benchmarks.local_sgd
    python -m benchmarks.local_sgd epochs=8 warmup_steps=20 plot=docs/local_sgd.png

Every mode trains the same 3 x 1024 MLP (``benchmarks.common.digits_mlp``) on the same digits
shards for the same number of epochs in the same 2 gloo processes; modes take turns in rounds
whose order rotates, so machine drift hits them alike. Bytes are counted at the collectives
(``all_reduce`` and ``broadcast`` payloads of rank 0, per optimizer step); step time is the mean
of barrier-aligned steps (a mean, so the periodic averages count); accuracy is the final (averaged) model's on the
validation split.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import benchmark_main, digits_mlp, init_gloo_rank, rotated, run_ranks
from lit_dp_recipes.digits import DigitsDataModule


@dataclass
class LocalSGDBenchmarkConfig:
    """What to measure."""

    world_size: int = 2
    local_steps: tuple[int, ...] = (1, 2, 4, 8, 16)
    warmup_steps: int = 0
    epochs: int = 4
    batch_size: int = 32  # per rank
    lr: float = 1e-3
    rounds: int = 3
    threads_per_rank: int = 1
    plot: str | None = None  # a PNG path for the plot


def _counting(collective: Callable[..., Any], counter: list[int]) -> Callable[..., Any]:
    def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter[0] += tensor.numel() * tensor.element_size()
        return collective(tensor, *args, **kwargs)

    return wrapper


def _train(mode: int | None, config: LocalSGDBenchmarkConfig, data: DigitsDataModule, rank: int) -> dict[str, Any]:
    """One mode: ``None`` is plain data parallelism, an integer K is LocalSGD with that period."""
    import lit_dp

    torch.manual_seed(0)
    model = lit_dp.DataParallel(digits_mlp())
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    local_sgd = None if mode is None else lit_dp.LocalSGD(model, mode, config.warmup_steps)
    images, labels = data.train_set.tensors
    images, labels = images[rank :: config.world_size], labels[rank :: config.world_size]
    sent = [0]
    times: list[float] = []
    averaged: list[bool] = []
    steps = 0
    with (
        mock.patch.object(dist, "all_reduce", _counting(dist.all_reduce, sent)),
        mock.patch.object(dist, "broadcast", _counting(dist.broadcast, sent)),
    ):
        for epoch in range(config.epochs):
            order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
            for start in range(0, len(order) - config.batch_size + 1, config.batch_size):
                batch = order[start : start + config.batch_size]
                dist.barrier()  # align ranks so a step's time is not another rank's lag
                began = time.perf_counter()
                loss = F.cross_entropy(model(images[batch]), labels[batch])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                averaged.append(local_sgd.step() if local_sgd is not None else True)
                times.append(time.perf_counter() - began)
                steps += 1
        if local_sgd is not None:
            local_sgd.finish()
    val_images, val_labels = data.val_set.tensors
    with torch.no_grad():
        accuracy = (model(val_images).argmax(dim=1) == val_labels).float().mean().item()
    return {"bytes_per_step": sent[0] / steps, "times": times, "averaged": averaged, "accuracy": accuracy, "steps": steps}


def _worker(rank: int, config: LocalSGDBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    data = DigitsDataModule()
    data.setup()
    modes: list[int | None] = [None, *config.local_steps]
    rows: dict[int | None, dict[str, Any]] = {}
    for round_index in range(config.rounds):
        for mode in rotated(modes, round_index):
            outcome = _train(mode, config, data, rank)
            row = rows.setdefault(mode, {**outcome, "times": [], "averaged": []})
            row["times"] += outcome["times"]
            row["averaged"] += outcome["averaged"]
            assert row["accuracy"] == outcome["accuracy"], "a repeated run reached a different accuracy"
    if rank == 0:
        results.update({mode: _summary(row) for mode, row in rows.items()})
    lit_dp.destroy_parallel_env()


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    """Mean step time, and medians of the steps that communicated (DP: all) and of those that did not."""
    syncing = [t for t, synced in zip(row["times"], row["averaged"]) if synced]
    local = [t for t, synced in zip(row["times"], row["averaged"]) if not synced]
    return {
        "bytes_per_step": row["bytes_per_step"],
        "accuracy": row["accuracy"],
        "step_s": statistics.fmean(row["times"]),
        "sync_step_s": statistics.median(syncing) if syncing else float("nan"),
        "local_step_s": statistics.median(local) if local else float("nan"),
    }


def run(config: LocalSGDBenchmarkConfig) -> dict[int | None, dict[str, Any]]:
    """Per mode (None: plain data parallelism; K: LocalSGD): bytes per step, mean step seconds, accuracy."""
    return run_ranks(_worker, config.world_size, config)


def report(results: dict[int | None, dict[str, Any]], config: LocalSGDBenchmarkConfig) -> str:
    baseline = results[None]
    lines = [
        f"| mode | MB sent per step | vs DP | mean step (ms) | vs DP | median step with communication (ms) "
        f"| median local step (ms) | val accuracy after {config.epochs} epochs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, row in sorted(results.items(), key=lambda item: -1 if item[0] is None else item[0]):
        name = "data parallel" if mode is None else f"LocalSGD K={mode}"
        lines.append(
            f"| {name} | {row['bytes_per_step'] / 2**20:.2f} | {row['bytes_per_step'] / baseline['bytes_per_step']:.3f} "
            f"| {row['step_s'] * 1e3:.2f} | {row['step_s'] / baseline['step_s']:.3f} | {row['sync_step_s'] * 1e3:.2f} "
            f"| {row['local_step_s'] * 1e3:.2f} | {row['accuracy']:.4f} |"
        )
    if config.plot:
        _plot(results, Path(config.plot))
    return "\n".join(lines)


def _plot(results: dict[int | None, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(mode for mode in results if mode is not None)
    baseline = results[None]
    panels = (
        ("bytes_per_step", 1 / 2**20, "MB sent per step (rank 0)"),
        ("step_s", 1e3, "mean step (ms)"),
        ("accuracy", 1.0, "val accuracy"),
    )
    figure, axes = plt.subplots(1, len(panels), figsize=(12, 3.6))
    for axis, (key, scale, label) in zip(axes, panels):
        axis.plot(ks, [results[k][key] * scale for k in ks], "o-", label="LocalSGD")
        axis.axhline(baseline[key] * scale, color="gray", linestyle="--", label="data parallel")
        axis.set_xscale("log", base=2)
        axis.set_xticks(ks, [str(k) for k in ks])
        axis.set_xlabel("K (local steps between averages)")
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle("LocalSGD vs data parallelism, digits 3x1024 MLP, 2 gloo processes")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


main = benchmark_main("local_sgd", LocalSGDBenchmarkConfig, lambda config: report(run(config), config))


if __name__ == "__main__":
    main()
