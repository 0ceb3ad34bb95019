"""What a checkpoint costs each rank, in both formats, as the number of ranks grows (docs/checkpoints.md).

    python -m benchmarks.checkpoints
    python -m benchmarks.checkpoints devices=[2] width=1024

Each case fits the issue's model (``layers`` square ``width`` x ``width`` linear layers: 4 x 2048 is
64 MiB of fp32 parameters, 192 MiB with Adam's two moments) on ``devices`` CPU processes
(``start_method="spawn"``) and measures, per rank:

- the save: ``trainer.save_checkpoint`` after optimizer step ``save_at`` (between two DiLoCo syncs),
  ``saves`` times: each rank's peak resident memory during the save above where it was before it
  (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), rank 0's median time, the bytes
  written (all files, and the largest one);
- the read at resume: a second fit resumed from that checkpoint, the bytes each rank read from its
  ``setup`` to the end of its first step: through ``read()`` (``rchar`` of ``/proc/self/io``, less the
  same figure of the first fit, which read no checkpoint) and through a mapped file (the pages of the
  checkpoint's mappings that are resident, read or since written, ``Rss`` of ``/proc/self/smaps``,
  sampled every 50 ms: the full format is read mapped);
- the step time around an asynchronous save: the resumed fit saves with ``async_save=True`` every
  ``async_every`` steps; rank 0's steps that end while a write is in flight against its steps that
  end with none, interleaved in time (medians).

Cases: torch DDP (Lightning's ``"ddp"``, its own checkpoint: rank 0 writes one file) as the peer, and
lit_dp's data parallelism, ZeRO-2 (``sharding_stage=2``) and DiLoCo between syncs (K=4 after one
warm-up step), each with ``state_dict_type="full"`` and ``"sharded"``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import benchmark_main

MODES = {
    "data parallel": {},
    "ZeRO-2": {"sharding_stage": 2},
    "DiLoCo between syncs": {"local_sgd_steps": 4, "local_sgd_warmup_steps": 1, "local_sgd_outer": "nesterov"},
}


@dataclass
class CheckpointsBenchmarkConfig:
    """What to measure."""

    devices: tuple[int, ...] = (2, 4)
    width: int = 2048
    layers: int = 4
    save_at: int = 6  # the optimizer step after which the checkpoints are saved (between DiLoCo's syncs of 5 and 9)
    saves: int = 2  # rank 0's median time of these many saves; each rank's largest peak
    steps: int = 30  # optimizer steps of the resumed fit, around its asynchronous saves
    async_every: int = 8  # the resumed fit's asynchronous saves, every these many steps


def _resident_mib(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def _reset_peak() -> None:
    """The process's peak resident memory (VmHWM) starts again from its current one."""
    Path("/proc/self/clear_refs").write_text("5")


def _size(path: Path) -> tuple[int, int]:
    """All bytes of a checkpoint (a file, or a folder's files) and its largest file's."""
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    sizes = [p.stat().st_size for p in files]
    return sum(sizes), max(sizes)


class _Model(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch, batch_idx):
        (inputs,) = batch
        return self.net(inputs).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class _Reads(threading.Thread):
    """This process's reads while it runs: its ``read()`` bytes, and the peak of the resident pages of its mappings
    of ``checkpoint`` (a file or a folder's files), which a mapped read brings in."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__(daemon=True)
        self._checkpoint = checkpoint
        self._done = threading.Event()
        self._rchar = _rchar()
        self.peak_mapped = 0.0

    def run(self) -> None:
        while not self._done.wait(0.05):
            self.peak_mapped = max(self.peak_mapped, self._mapped())

    def _mapped(self) -> float:
        """MiB resident in this process's mappings of the checkpoint (``/proc/self/smaps``)."""
        kib, inside = 0, False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = self._checkpoint in line
            elif inside and line.startswith("Rss:"):
                kib += int(line.split()[1])
        return kib / 1024

    def stop(self) -> tuple[float, float]:
        """MiB read through ``read()`` and through the checkpoint's mappings since the start."""
        self._done.set()
        self.join()
        return (_rchar() - self._rchar) / 2**20, max(self.peak_mapped, self._mapped())


def _rchar() -> int:
    return int(re.search(r"rchar:\s+(\d+)", Path("/proc/self/io").read_text()).group(1))  # type: ignore[union-attr]


class _Probe(pl.Callback):
    """One fit's measurements on each rank, written to ``<folder>/<tag>-rank<r>.json``: the bytes read from setup to
    the first step's end, the timed saves (``save_at``), and each step's time with whether a save was in flight."""

    def __init__(self, folder: str, tag: str, path: str, save_at: int | None, saves: int, async_every: int | None) -> None:
        self.folder, self.tag, self.path = folder, tag, path
        self.save_at, self.saves, self.async_every = save_at, saves, async_every
        self.report: dict[str, Any] = {"steps": []}
        self._started = 0.0
        self._reads: _Reads | None = None

    def setup(self, trainer, pl_module, stage):
        self._reads = _Reads(self.path)
        self._reads.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        elapsed = time.perf_counter() - self._started
        in_flight = getattr(getattr(trainer.strategy, "_checkpointing", None), "_in_flight", None)
        self.report["steps"].append((trainer.global_step, elapsed, bool(in_flight is not None and in_flight.in_flight)))
        if self._reads is not None:
            self.report["read"], self._reads = self._reads.stop(), None
        if trainer.global_step == self.save_at:
            extras, seconds = [], []
            for _ in range(self.saves):
                before = _resident_mib("VmRSS")
                _reset_peak()
                start = time.perf_counter()
                trainer.save_checkpoint(self.path)
                seconds.append(time.perf_counter() - start)
                extras.append(_resident_mib("VmHWM") - before)
            self.report["save_extra"], self.report["save_seconds"] = max(extras), statistics.median(seconds)
        if self.async_every and trainer.global_step % self.async_every == 4:
            start = time.perf_counter()
            trainer.save_checkpoint(self.path + ".async")
            self.report.setdefault("async_call_seconds", []).append(time.perf_counter() - start)
        Path(self.folder, f"{self.tag}-rank{trainer.global_rank}.json").write_text(json.dumps(self.report))


def _fit(config: CheckpointsBenchmarkConfig, devices: int, folder: Path, tag: str, strategy: Any, steps: int,
         ckpt_path: Path | None = None, save_at: int | None = None, async_every: int | None = None) -> None:  # fmt: skip
    data = TensorDataset(torch.randn(8 * steps * devices, config.width))
    probe = _Probe(str(folder), tag, str(folder / "checkpoint.ckpt"), save_at, config.saves, async_every)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe], default_root_dir=folder,
    )  # fmt: skip
    trainer.fit(_Model(config.width, config.layers), DataLoader(data, batch_size=8), ckpt_path=ckpt_path)


def _reports(folder: Path, tag: str, devices: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"{tag}-rank{rank}.json").read_text()) for rank in range(devices)]


def _case(config: CheckpointsBenchmarkConfig, devices: int, mode: str | None, state_dict_type: str) -> dict[str, Any]:
    """One row: the saving fit, then the fit resumed from its checkpoint (with an asynchronous save)."""
    from lightning.pytorch.strategies import DDPStrategy

    import lit_dp

    def strategy(**more: Any) -> Any:
        if mode is None:  # the peer: Lightning's DDP
            return DDPStrategy(start_method="spawn")
        return lit_dp.PaddleDPStrategy(start_method="spawn", state_dict_type=state_dict_type, **MODES[mode], **more)

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as name:
        folder = Path(name)
        _fit(config, devices, folder, "save", strategy(), config.save_at + 1, save_at=config.save_at)
        saved = _reports(folder, "save", devices)
        total, largest = _size(folder / "checkpoint.ckpt")
        resumed_steps = config.save_at + config.steps
        more = {} if mode is None else {"async_save": True}
        _fit(config, devices, folder, "resume", strategy(**more), resumed_steps, ckpt_path=folder / "checkpoint.ckpt",
             async_every=None if mode is None else config.async_every)  # fmt: skip
        resumed = _reports(folder, "resume", devices)
    steps = resumed[0]["steps"][2:]  # the first two: the resume's own first steps
    during = [seconds for _, seconds, in_flight in steps if in_flight]
    without = [seconds for _, seconds, in_flight in steps if not in_flight]
    return {
        "save_extra": [report["save_extra"] for report in saved],
        "save_seconds": saved[0]["save_seconds"],
        "total": total / 2**20,
        "largest": largest / 2**20,
        # read() bytes beyond the fit that read no checkpoint, and the checkpoint's mapped pages.
        "read": [r["read"][0] - s["read"][0] + r["read"][1] for r, s in zip(resumed, saved)],
        "step_ms": 1000 * statistics.median(without) if without else float("nan"),
        "step_during_ms": 1000 * statistics.median(during) if during else float("nan"),
        "steps_during": len(during),
        "async_call_ms": 1000 * statistics.median(resumed[0].get("async_call_seconds", [float("nan")])),
    }


def run_and_report(config: CheckpointsBenchmarkConfig) -> str:
    state = config.layers * (config.width**2 + config.width) * 4 * 3 / 2**20  # parameters and Adam's two moments
    lines = [
        f"{config.layers} x {config.width} MLP, Adam: {state:.0f} MiB of model and optimizer state per rank; CPU ranks; "
        f"saved after step {config.save_at} (rank 0's median of {config.saves} saves); MiB are resident memory "
        f"(peak above the level before), bytes on disk or bytes read; {os.getloadavg()[0]:.1f} load average at the end",
        "",
        "| ranks | case | format | rank 0 extra at save | other ranks' largest | save s | written | largest file | read at resume, rank 0 / largest | step ms: no save / async save in flight (steps) | async save call ms (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = [(None, "full")] + [(mode, kind) for mode in MODES for kind in ("full", "sharded")]
    for devices in config.devices:
        for mode, kind in cases:
            row = _case(config, devices, mode, kind)
            others = max(row["save_extra"][1:], default=float("nan"))
            read = f"{row['read'][0]:.0f} / {max(row['read']):.0f}"
            during = f"{row['step_ms']:.0f} / {row['step_during_ms']:.0f} ({row['steps_during']})" if mode else "-"
            lines.append(
                f"| {devices} | {mode or 'torch DDP (Lightning)'} | {kind} | {row['save_extra'][0]:.0f} | {others:.0f} | "
                f"{row['save_seconds']:.2f} | {row['total']:.2f} | {row['largest']:.2f} | {read} | {during} | "
                f"{row['async_call_ms']:.0f} |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines)


main = benchmark_main("checkpoints", CheckpointsBenchmarkConfig, run_and_report)

if __name__ == "__main__":
    main()
