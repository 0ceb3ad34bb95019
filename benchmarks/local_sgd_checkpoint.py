"""What keeping every rank's state costs a LocalSGD checkpoint: bytes on disk and time to save.

    python -m benchmarks.local_sgd_checkpoint
    python -m benchmarks.local_sgd_checkpoint width=2048 devices=3

Between LocalSGD syncs every rank holds its own model and inner optimizer state, so the Trainer's
checkpoint gathers them to rank 0, which writes them in the one file (``lit_dp.strategies.local_sgd``).
Each mode fits the same MLP (``layers`` square ``width`` x ``width`` linear layers, AdamW) on
random data with ``devices`` CPU processes (``paddle_dp_spawn``) and saves a checkpoint
``saves`` times after optimizer step ``save_at`` (mid-period for K=4):

- ``data parallel``: no LocalSGD, rank 0's state is the job's;
- ``DiLoCo K=4``: ``local_sgd_steps=4, local_sgd_outer="nesterov"``: the schedule, the snapshot
  and the outer momentum, and the other ranks' model and optimizer states.

Reported: the file's bytes, and the median time of ``trainer.save_checkpoint`` on rank 0 (which
gathers, then writes while the others wait).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import benchmark_main


@dataclass
class CheckpointBenchmarkConfig:
    """What to measure."""

    devices: int = 2
    width: int = 1024
    layers: int = 4
    save_at: int = 6  # mid-period for K=4, after the local phase started
    saves: int = 5


class _Model(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch, batch_idx):
        (inputs,) = batch
        return self.net(inputs).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _TimedSaves(pl.Callback):
    """Saves ``count`` checkpoints after step ``at`` and writes rank 0's median save time to ``report``."""

    def __init__(self, at: int, count: int, path: str, report: str) -> None:
        self._at, self._count, self._path, self._report = at, count, path, report

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._at:
            return
        times = []
        for _ in range(self._count):
            start = time.perf_counter()
            trainer.save_checkpoint(self._path)
            times.append(time.perf_counter() - start)
        if trainer.is_global_zero:
            Path(self._report).write_text(str(statistics.median(times)))


def _measure(config: CheckpointBenchmarkConfig, folder: Path, options: dict) -> tuple[int, float]:
    import lit_dp

    path, report = folder / "mid.ckpt", folder / "seconds.txt"
    data = TensorDataset(torch.randn(8 * (config.save_at + 1), config.width))
    trainer = pl.Trainer(
        strategy=lit_dp.PaddleDPStrategy(start_method="spawn", **options),
        accelerator="cpu",
        devices=config.devices,
        max_steps=config.save_at + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_TimedSaves(config.save_at, config.saves, str(path), str(report))],
        default_root_dir=folder,
    )
    trainer.fit(_Model(config.width, config.layers), DataLoader(data, batch_size=8))
    return path.stat().st_size, float(report.read_text())


def run_and_report(config: CheckpointBenchmarkConfig) -> str:
    modes = {"data parallel": {}, "DiLoCo K=4": {"local_sgd_steps": 4, "local_sgd_outer": "nesterov"}}
    parameters = config.layers * (config.width**2 + config.width) * 4
    lines = [
        f"{config.layers} x {config.width} MLP ({parameters / 2**20:.1f} MiB of fp32 parameters), AdamW, "
        f"{config.devices} CPU ranks; a checkpoint after step {config.save_at}, median of {config.saves} saves",
        "",
        "| mode | checkpoint MiB | vs DP | save (s) | vs DP |",
        "|---|---|---|---|---|",
    ]
    results = {}
    for name, options in modes.items():
        with tempfile.TemporaryDirectory() as folder:
            results[name] = _measure(config, Path(folder), options)
    base_bytes, base_seconds = results["data parallel"]
    for name, (nbytes, seconds) in results.items():
        lines.append(
            f"| {name} | {nbytes / 2**20:.1f} | {nbytes / base_bytes:.2f} | {seconds:.3f} | {seconds / base_seconds:.2f} |"
        )
    return "\n".join(lines)


main = benchmark_main("local_sgd_checkpoint", CheckpointBenchmarkConfig, run_and_report)

if __name__ == "__main__":
    main()
