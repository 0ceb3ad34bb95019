"""Throughput and exposed communication of strategies and bucket sizes, swept with Hydra multirun.

    python -m benchmarks.training_sweep -m strategy=paddle_dp,ddp strategy.comm_buffer_size=1,5,25
    python -m benchmarks.training_sweep -m strategy.comm_buffer_size=1,2,5,10,25,50,100,auto

Each job trains the recipes' wide MLP briefly (the recipe config groups of ``conf/``, found
through the config's search path; run from the repository root).

Each job records samples/s and, for ``paddle_dp`` (whose recipes turn ``comm_stats`` on), the
mean communication and exposed time per step; the sweep folder gets a table, a throughput plot
and a plot of exposed time against bucket size. ``strategy.comm_buffer_size=auto`` is one more
point of the sweep: it is drawn at the size it chose.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lit_dp_recipes.config import register_configs
from lit_dp_recipes.train import train

RESULT_FILE = "result.json"


def benchmark_job(cfg: DictConfig) -> float:
    """One point of the sweep: train briefly, record samples/s and communication next to the job's outputs."""
    metrics = train(cfg)
    hydra = HydraConfig.get()
    result = {
        "strategy": hydra.runtime.choices["strategy"],
        "comm_buffer_size": cfg.strategy.comm_buffer_size,
        "samples_per_sec": metrics["samples_per_sec"],
        "exposed_ms": metrics.get("comm/exposed_ms_mean"),
        "comm_time_ms": metrics.get("comm/time_ms_mean"),
        "tuned_buffer_mb": metrics.get("comm/tuned_buffer_mb"),
    }
    (Path(hydra.runtime.output_dir) / RESULT_FILE).write_text(json.dumps(result))
    return result["samples_per_sec"]


class ThroughputReport(Callback):
    """At the end of a multirun: ``throughput.md``, ``throughput.png`` and ``exposed.png`` in the sweep folder."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [json.loads(path.read_text()) for path in sorted(sweep_dir.glob(f"*/{RESULT_FILE}"))]
        if not rows:
            return
        write_report(rows, sweep_dir)


def _size_key(row: dict[str, Any]) -> float:
    size = row["comm_buffer_size"]
    return math.inf if isinstance(size, str) else float(size)


def _size_label(row: dict[str, Any]) -> str:
    size = row["comm_buffer_size"]
    if isinstance(size, str):
        tuned = row.get("tuned_buffer_mb")
        return f"{size} ({tuned:g})" if tuned is not None else size
    return f"{size:g}"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def write_report(rows: list[dict[str, Any]], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r["strategy"], _size_key(r)))
    table = [
        "| strategy | comm_buffer_size (MB) | samples/s | exposed ms/step | comm ms/step |",
        "|---|---|---|---|---|",
    ]
    table += [
        f"| {r['strategy']} | {_size_label(r)} | {r['samples_per_sec']:.0f} | {_ms(r.get('exposed_ms'))} "
        f"| {_ms(r.get('comm_time_ms'))} |"
        for r in rows
    ]
    (out_dir / "throughput.md").write_text("\n".join(table) + "\n")

    labels = list(dict.fromkeys(_size_label(r) for r in sorted(rows, key=_size_key)))
    strategies = sorted({r["strategy"] for r in rows})
    width = 0.8 / len(strategies)
    figure, axes = plt.subplots(figsize=(6, 4))
    for offset, strategy in enumerate(strategies):
        by_size = {_size_label(r): r["samples_per_sec"] for r in rows if r["strategy"] == strategy}
        positions = [i + offset * width for i, label in enumerate(labels) if label in by_size]
        axes.bar(positions, [by_size[label] for label in labels if label in by_size], width=width, label=strategy)
    axes.set_xticks([i + width * (len(strategies) - 1) / 2 for i in range(len(labels))], labels)
    axes.set_xlabel("comm_buffer_size (MB)")
    axes.set_ylabel("samples / s (all ranks)")
    axes.set_title("Training throughput")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out_dir / "throughput.png", dpi=120)
    plt.close(figure)

    measured = [r for r in rows if r.get("exposed_ms") is not None]
    if measured:
        _plot_exposed(measured, out_dir / "exposed.png")


def _plot_exposed(rows: list[dict[str, Any]], path: Path) -> None:
    """Exposed and total communication time per step against the bucket size (log scale)."""
    import matplotlib.pyplot as plt

    fixed = [r for r in rows if not isinstance(r["comm_buffer_size"], str)]
    figure, axes = plt.subplots(figsize=(6, 4))
    for strategy in sorted({r["strategy"] for r in fixed}):
        points = sorted(
            (float(r["comm_buffer_size"]), r["exposed_ms"], r["comm_time_ms"]) for r in fixed if r["strategy"] == strategy
        )
        sizes = [p[0] for p in points]
        axes.plot(sizes, [p[1] for p in points], "o-", label=f"{strategy}: exposed")
        axes.plot(sizes, [p[2] for p in points], "s--", alpha=0.6, label=f"{strategy}: communication")
    for r in rows:
        if isinstance(r["comm_buffer_size"], str) and r.get("tuned_buffer_mb") is not None:
            label = f"{r['strategy']}: auto (run mean, tuning included)"
            axes.plot([r["tuned_buffer_mb"]], [r["exposed_ms"]], "r*", markersize=14, label=label)
    axes.set_xscale("log")
    tuned = {r["tuned_buffer_mb"] for r in rows if r.get("tuned_buffer_mb")}
    sizes = sorted({float(r["comm_buffer_size"]) for r in fixed} | tuned)
    axes.set_xticks(sizes, [f"{size:g}" for size in sizes])
    axes.minorticks_off()
    axes.set_xlabel("comm_buffer_size (MB)")
    axes.set_ylabel("ms per step (mean over steps and ranks)")
    axes.set_title("Exposed communication against bucket size")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@hydra.main(config_path="conf", config_name="training_sweep", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return benchmark_job(cfg)


if __name__ == "__main__":
    register_configs()
    main()
