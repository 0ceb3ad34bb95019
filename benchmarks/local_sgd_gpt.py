"""Data parallelism, LocalSGD averaging and DiLoCo on the GPT recipe at one number of tokens.

    python -m benchmarks.local_sgd_gpt
    python -m benchmarks.local_sgd_gpt devices=3
    python -m benchmarks.local_sgd_gpt local_steps=[16] max_steps=160 sync_dtypes=[]
    python -m benchmarks.local_sgd_gpt local_steps=[16] fragments=[4] average=false sync_dtypes=[]
    python -m benchmarks.local_sgd_gpt local_steps=[16] average=false sync_dtypes=[bf16,int8,int4] error_feedback=[true,false]

Each mode is one run of ``recipes/gpt.py`` as a user types it (its default small GPT on the
stdlib bytes, ``devices`` CPU processes, the same seed, batch and schedule), in a folder of its
own, with ``strategy.comm_stats=true``:

- ``data parallel``: the recipe as it is;
- ``average K``: ``strategy.local_sgd.steps=K`` (LocalSGD as before, ``outer=average``);
- ``nesterov K``: also ``strategy.local_sgd.outer=nesterov`` with its defaults (DiLoCo);
- ``nesterov+D K``: also ``strategy.local_sgd.sync_dtype=D``, for each D of ``sync_dtypes`` (bf16 by
  default), with error feedback at its default for D; with ``error_feedback`` one mode per value
  given instead, ``nesterov+D EF K`` (``strategy.local_sgd.error_feedback=true``) and
  ``nesterov+D no EF K`` (``false``);
- ``nesterov F=f K``: streaming DiLoCo, also ``strategy.local_sgd.fragments=f`` (each of ``fragments``).

``max_steps`` is a multiple of every K, and the recipe validates once, at the end
(``trainer.val_check_interval=max_steps``): after the last optimizer step's average, so every
mode's validation loss is that of one synchronised model. Read from the recipe's output: the
validation loss and tokens/s of its ``[lit_dp] final`` line, the bytes per step of its
``[lit_dp] comm:`` line (data parallelism: the gradient bytes all-reduced per step; LocalSGD:
the bytes of its averages per local step, from rank 0's ``LocalSGD.traffic``), and the largest
single sync (data parallelism: a step's gradients; LocalSGD: a whole-model average, or with
fragments one fragment); with ``warmup_steps`` (W, for every LocalSGD mode alike) the bytes per
step count the W data-parallel steps too. Wall time: the whole command, start-up and validation included. For each
DiLoCo mode, with averaging at its K: the fraction of averaging's gap to data parallelism it closes,
``(average - DiLoCo) / (average - data parallel)`` in validation loss (1: as data parallelism; 0: as
averaging; below 0: worse than averaging). With ``sync_dtypes``, a second table sets each DiLoCo mode
in a wire format against DiLoCo in fp32 at its K: its validation loss above fp32's (in %), and its
bytes per step over fp32's (both count the warm-up's data-parallel steps alike).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import benchmark_main

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LocalSGDGPTConfig:
    """What to run (the recipe's own defaults for everything else)."""

    devices: int = 2
    max_steps: int = 320  # a multiple of every K: the last step averages, then the one validation runs
    local_steps: tuple[int, ...] = (16, 64)
    sync_dtypes: tuple[str, ...] = ("bf16",)  # also DiLoCo with the deltas sent in each of these formats
    error_feedback: tuple[bool, ...] = ()  # per format, one mode per value; (): each format's default
    average: bool = True  # also LocalSGD's plain averaging at every K
    fragments: tuple[int, ...] = ()  # also streaming DiLoCo with each of these numbers of fragments
    extra: tuple[str, ...] = ()  # more recipe overrides for every mode, e.g. experiment=gpt_tiny
    # W: every LocalSGD mode's data-parallel steps before its local phase (local_sgd.warmup_steps).
    warmup_steps: int = 0


def _modes(config: LocalSGDGPTConfig) -> list[tuple[str, list[str]]]:
    modes: list[tuple[str, list[str]]] = [("data parallel", [])]
    for k in config.local_steps:
        if (config.max_steps - config.warmup_steps) % k or config.max_steps <= config.warmup_steps:
            raise ValueError(
                f"max_steps={config.max_steps} is invalid with local_steps K={k} and warmup_steps={config.warmup_steps}: "
                "expected warmup_steps plus a multiple of every K (the last step syncs)."
            )
        period = [f"strategy.local_sgd.steps={k}"]
        if config.warmup_steps:
            period.append(f"strategy.local_sgd.warmup_steps={config.warmup_steps}")
        if config.average:
            modes.append((f"average K={k}", period))
        modes.append((f"nesterov K={k}", [*period, "strategy.local_sgd.outer=nesterov"]))
        for dtype in config.sync_dtypes:
            quantized = [*period, "strategy.local_sgd.outer=nesterov", f"strategy.local_sgd.sync_dtype={dtype}"]
            if not config.error_feedback:
                modes.append((f"nesterov+{dtype} K={k}", quantized))
            for feedback in config.error_feedback:
                name = f"nesterov+{dtype} {'EF' if feedback else 'no EF'} K={k}"
                modes.append((name, [*quantized, f"strategy.local_sgd.error_feedback={feedback}"]))
        for fragments in config.fragments:
            streaming = [*period, "strategy.local_sgd.outer=nesterov", f"strategy.local_sgd.fragments={fragments}"]
            modes.append((f"nesterov F={fragments} K={k}", streaming))
    return modes


def run_mode(overrides: list[str], config: LocalSGDGPTConfig, folder: str) -> dict[str, float]:
    command = [
        sys.executable,
        str(ROOT / "recipes" / "gpt.py"),
        f"trainer.devices={config.devices}",
        f"trainer.max_steps={config.max_steps}",
        f"trainer.val_check_interval={config.max_steps}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "strategy.comm_stats=true",
        f"hydra.run.dir={folder}",
        *config.extra,
        *overrides,
    ]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    began = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    wall = time.monotonic() - began
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{output[-4000:]}")
    final = next(line for line in output.splitlines() if line.startswith("[lit_dp] final "))
    metrics = {key: float(value) for key, value in re.findall(r"(\w+)=([-\d.]+)", final)}
    comm = next(line for line in output.splitlines() if line.startswith("[lit_dp] comm: "))
    local = re.search(r"([\d.]+) MB per local step", comm)
    data_parallel = re.search(r"([\d.]+) MB in \d+ buckets? per step", comm)
    sent = local if local is not None else data_parallel
    # The largest sync: a fragment's (fragments > 1), a whole-model average's, or a data-parallel step's.
    peak = re.search(r"at most ([\d.]+) MB", comm) or re.search(r"averages of ([\d.]+) MB", comm) or data_parallel
    assert sent is not None and peak is not None, comm
    row = {
        "val_loss": metrics["val_loss"],
        "tokens_per_sec": metrics["tokens_per_sec"],
        "mb_per_step": float(sent.group(1)),
        "mb_per_sync": float(peak.group(1)),
        "wall_s": wall,
    }
    # LocalSGD's syncs before the fit's final one, rank 0's: their number, mean bytes, time in flight and exposed.
    syncs = re.search(
        r"(\d+) (?:fragment syncs|averages) of ([\d.]+) MB.*time ([\d.]+) ms, exposed ([\d.]+) ms each", comm
    )
    if syncs is not None:
        row |= dict(zip(("syncs", "mb_mean_per_sync", "sync_time_ms", "sync_exposed_ms"), map(float, syncs.groups())))
    return row


def run(config: LocalSGDGPTConfig) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as folder:
        results = {
            name: run_mode(overrides, config, f"{folder}/{index}")
            for index, (name, overrides) in enumerate(_modes(config))
        }
    return with_warmup_traffic(results, config)


def with_warmup_traffic(results: dict[str, dict[str, float]], config: LocalSGDGPTConfig) -> dict[str, dict[str, float]]:
    """Each LocalSGD mode's bytes per step over the whole run: the recipe counts them per local step, and
    the W data-parallel steps before send a data-parallel step's gradients each."""
    data_parallel = results["data parallel"]["mb_per_step"]
    local = config.max_steps - config.warmup_steps
    for name, row in results.items():
        if name != "data parallel":
            row["mb_per_step"] = (config.warmup_steps * data_parallel + local * row["mb_per_step"]) / config.max_steps
    return results


def gap_closed(results: dict[str, dict[str, float]], name: str) -> float | None:
    """The fraction of averaging's gap to data parallelism (in validation loss) that a DiLoCo mode closes at
    its K: ``(average - mode) / (average - data parallel)``; None for the other modes, without averaging or without a gap."""
    match = re.fullmatch(r"nesterov.* K=(\d+)", name)
    average = results.get(f"average K={match.group(1)}") if match else None
    gap = average["val_loss"] - results["data parallel"]["val_loss"] if average is not None else 0.0
    if not gap:  # no averaging at this K, or no gap to close
        return None
    return (average["val_loss"] - results[name]["val_loss"]) / gap


def _warmup(config: LocalSGDGPTConfig) -> str:
    return f", LocalSGD after {config.warmup_steps} data-parallel steps" if config.warmup_steps else ""


def report(results: dict[str, dict[str, float]], config: LocalSGDGPTConfig) -> str:
    baseline = results["data parallel"]
    lines = [
        f"| mode ({config.devices} CPU ranks, {config.max_steps} steps{_warmup(config)}) | val loss | above DP's | of averaging's gap closed "
        "| MB sent per step | vs DP | MB per sync, at most | wall (s) | vs DP | tokens/s | vs DP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        above = f"{row['val_loss'] - baseline['val_loss']:.4f}" if row is not baseline else ""
        closed = gap_closed(results, name)
        lines.append(
            f"| {name} | {row['val_loss']:.4f} | {above} | {'' if closed is None else f'{closed:.2f}'} "
            f"| {row['mb_per_step']:.4f} | {row['mb_per_step'] / baseline['mb_per_step']:.4f} "
            f"| {row['mb_per_sync']:.3f} | {row['wall_s']:.0f} | {row['wall_s'] / baseline['wall_s']:.3f} "
            f"| {row['tokens_per_sec']:.0f} | {row['tokens_per_sec'] / baseline['tokens_per_sec']:.3f} |"
        )
    formats = against_fp32(results)
    if formats:
        lines += [
            "",
            f"| DiLoCo in a wire format ({config.devices} CPU ranks, {config.max_steps} steps{_warmup(config)}) "
            "| val loss | fp32's | above fp32's | bytes per step vs fp32 |",
            "|---|---|---|---|---|",
        ]
        for name, (loss, fp32_loss, above, ratio) in formats.items():
            lines.append(f"| {name} | {loss:.4f} | {fp32_loss:.4f} | {above:+.2f}% | {ratio:.4f} |")
    return "\n".join(lines)


def against_fp32(results: dict[str, dict[str, float]]) -> dict[str, tuple[float, float, float, float]]:
    """Each DiLoCo mode in a wire format (``nesterov+D ... K=k``) against DiLoCo in fp32 at its K: its validation
    loss, fp32's, the loss above fp32's in %, and its bytes per step over fp32's."""
    rows = {}
    for name, row in results.items():
        match = re.fullmatch(r"nesterov\+\S+.* K=(\d+)", name)
        fp32 = results.get(f"nesterov K={match.group(1)}") if match else None
        if fp32 is not None:
            above = (row["val_loss"] / fp32["val_loss"] - 1) * 100
            rows[name] = (row["val_loss"], fp32["val_loss"], above, row["mb_per_step"] / fp32["mb_per_step"])
    return rows


main = benchmark_main("local_sgd_gpt", LocalSGDGPTConfig, lambda config: report(run(config), config))


if __name__ == "__main__":
    main()
