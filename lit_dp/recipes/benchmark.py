"""Throughput of strategies and bucket sizes, swept with Hydra multirun, reported as a table and a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lit_dp.recipes.train import train

RESULT_FILE = "result.json"


def benchmark_job(cfg: DictConfig) -> float:
    """One point of the sweep: train briefly, record samples/s next to the job's outputs."""
    metrics = train(cfg)
    hydra = HydraConfig.get()
    result = {
        "strategy": hydra.runtime.choices["strategy"],
        "comm_buffer_size": cfg.strategy.comm_buffer_size,
        "samples_per_sec": metrics["samples_per_sec"],
    }
    (Path(hydra.runtime.output_dir) / RESULT_FILE).write_text(json.dumps(result))
    return result["samples_per_sec"]


class ThroughputReport(Callback):
    """At the end of a multirun: ``throughput.md`` and ``throughput.png`` in the sweep folder."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = [json.loads(path.read_text()) for path in sorted(sweep_dir.glob(f"*/{RESULT_FILE}"))]
        if not rows:
            return
        write_report(rows, sweep_dir)


def write_report(rows: list[dict[str, Any]], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r["strategy"], r["comm_buffer_size"]))
    table = ["| strategy | comm_buffer_size (MB) | samples/s |", "|---|---|---|"]
    table += [f"| {r['strategy']} | {r['comm_buffer_size']:g} | {r['samples_per_sec']:.0f} |" for r in rows]
    (out_dir / "throughput.md").write_text("\n".join(table) + "\n")

    sizes = sorted({r["comm_buffer_size"] for r in rows})
    strategies = sorted({r["strategy"] for r in rows})
    width = 0.8 / len(strategies)
    figure, axes = plt.subplots(figsize=(6, 4))
    for offset, strategy in enumerate(strategies):
        by_size = {r["comm_buffer_size"]: r["samples_per_sec"] for r in rows if r["strategy"] == strategy}
        positions = [i + offset * width for i, size in enumerate(sizes) if size in by_size]
        axes.bar(positions, [by_size[s] for s in sizes if s in by_size], width=width, label=strategy)
    axes.set_xticks([i + width * (len(strategies) - 1) / 2 for i in range(len(sizes))], [f"{s:g}" for s in sizes])
    axes.set_xlabel("comm_buffer_size (MB)")
    axes.set_ylabel("samples / s (all ranks)")
    axes.set_title("Training throughput")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out_dir / "throughput.png", dpi=120)
    plt.close(figure)
