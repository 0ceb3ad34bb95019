"""Streaming DiLoCo's overlapped syncs on the GPT recipe over a simulated slow link, per sync delay.

    python -m benchmarks.local_sgd_overlap_gpt
    python -m benchmarks.local_sgd_overlap_gpt link_mbit=20 delays=[0,1]
    python -m benchmarks.local_sgd_overlap_gpt delays=[0,1] sync_dtypes=[fp32,int8,int4]

Each mode is one run of ``recipes/gpt.py`` as in ``benchmarks.local_sgd_gpt`` (its default small
GPT on the stdlib bytes, ``devices`` CPU processes, the same seed, batch and schedule, validated once
at ``max_steps``, ``strategy.comm_stats=true``), with DiLoCo every ``local_steps`` steps in
``fragments`` fragments and ``strategy.local_sgd.sync_delay`` tau, one mode per tau in ``delays`` and
format in ``sync_dtypes`` (``fp32``: the parameters' own; else ``strategy.local_sgd.sync_dtype``, with
error feedback at its default).
Every rank's LocalSGD collectives go through the benchmark's simulated link of ``link_mbit`` Mbit/s
(``benchmarks.local_sgd_overlap.SlowSyncLink``, a recipe callback): a collective is complete no
sooner than the link, shared by the syncs in turn, would have carried its bytes.

Read from the recipe's output: the validation loss of its ``[lit_dp] final`` line, and from its
``[lit_dp] comm:`` line rank 0's syncs before the fit's final one, their mean bytes, time in
flight and exposed time (the wait when a sync is applied, and applying it). Reported: the exposed
sync time per training step (exposed per sync x syncs / ``max_steps``), the time the link alone
takes per sync, and wall time (the whole command); the losses and exposed times set against fp32's
at tau 0 (the first mode's, when fp32 is not run).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

from benchmarks.common import benchmark_main
from benchmarks.local_sgd_gpt import LocalSGDGPTConfig, run_mode


@dataclass
class OverlapGPTConfig:
    """What to run (the recipe's own defaults for everything else)."""

    devices: int = 2
    max_steps: int = 320
    local_steps: int = 16  # K
    fragments: int = 4  # F: a fragment syncs every K/F steps
    delays: tuple[int, ...] = (0, 1, 2)  # sync_delay (tau) per mode, each below K/F
    sync_dtypes: tuple[str, ...] = ("fp32",)  # per mode too: fp32 (the parameters' dtype) or a sync_dtype
    mixing: float = 0.0  # alpha, the weight kept of the local parameters when a sync is applied
    link_mbit: float = 100.0
    extra: tuple[str, ...] = ()  # more recipe overrides for every mode, e.g. experiment=gpt_tiny


def _overrides(dtype: str, delay: int, config: OverlapGPTConfig) -> list[str]:
    wire = [] if dtype == "fp32" else [f"strategy.local_sgd.sync_dtype={dtype}"]
    return [
        *wire,
        f"strategy.local_sgd.steps={config.local_steps}",
        "strategy.local_sgd.outer=nesterov",
        f"strategy.local_sgd.fragments={config.fragments}",
        f"strategy.local_sgd.sync_delay={delay}",
        f"strategy.local_sgd.mixing={config.mixing}",
        "+callbacks.slow_link._target_=benchmarks.local_sgd_overlap.SlowSyncLink",
        f"+callbacks.slow_link.mbit={config.link_mbit}",
    ]


def run(config: OverlapGPTConfig) -> dict[tuple[str, int], dict[str, float]]:
    recipe = LocalSGDGPTConfig(devices=config.devices, max_steps=config.max_steps, extra=config.extra)
    modes = [(dtype, delay) for dtype in config.sync_dtypes for delay in config.delays]
    with tempfile.TemporaryDirectory() as folder:
        return {
            (dtype, delay): run_mode(_overrides(dtype, delay, config), recipe, f"{folder}/{index}")
            for index, (dtype, delay) in enumerate(modes)
        }


def report(results: dict[tuple[str, int], dict[str, float]], config: OverlapGPTConfig) -> str:
    # Of a sync's bytes, what each rank sends: a ring all-reduce's, or an all-to-all's and an all-gather's.
    share = 2 * (config.devices - 1) / config.devices
    baseline = results.get(("fp32", 0), next(iter(results.values()), None))
    lines = [
        f"DiLoCo K={config.local_steps}, F={config.fragments}, mixing={config.mixing:g} on the GPT recipe, "
        f"{config.devices} CPU ranks, {config.max_steps} steps, a {config.link_mbit:g} Mbit/s link for the syncs; "
        "rank 0's syncs before the fit's final one",
        "",
        "| sync_dtype | sync_delay | val loss | vs fp32 at tau 0 | syncs | link per sync (ms) | in flight per sync (ms) "
        "| exposed per sync (ms) | exposed sync ms per step | vs fp32 at tau 0 | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (dtype, delay), row in results.items():
        link_ms = row["mb_mean_per_sync"] * 2**20 * share * 8 / (config.link_mbit * 1e6) * 1e3
        exposed_per_step = row["sync_exposed_ms"] * row["syncs"] / config.max_steps
        base_per_step = baseline["sync_exposed_ms"] * baseline["syncs"] / config.max_steps if baseline else None
        loss_vs = f"{(row['val_loss'] / baseline['val_loss'] - 1) * 100:+.2f}%" if baseline else ""
        exposed_vs = f"{exposed_per_step / base_per_step:.3f}" if base_per_step else ""
        lines.append(
            f"| {dtype} | {delay} | {row['val_loss']:.4f} | {loss_vs} | {row['syncs']:.0f} | {link_ms:.1f} "
            f"| {row['sync_time_ms']:.1f} | {row['sync_exposed_ms']:.2f} | {exposed_per_step:.2f} | {exposed_vs} "
            f"| {row['wall_s']:.0f} |"
        )
    return "\n".join(lines)


main = benchmark_main("local_sgd_overlap_gpt", OverlapGPTConfig, lambda config: report(run(config), config))

if __name__ == "__main__":
    main()
