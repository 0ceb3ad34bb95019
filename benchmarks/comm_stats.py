"""What ``comm_stats`` costs a recipe's step: the recipe with the statistics on and off, side by side.

    python -m benchmarks.comm_stats
    python -m benchmarks.comm_stats buckets=[0.02] rounds=5

The digits recipe (its own defaults, shortened by ``overrides``) on ``ranks`` ranks, at each of
``buckets`` (``comm_buffer_size`` and, below 1 MB, ``last_comm_buffer_size``: the digits MLP's
0.1 MB of gradients in 1 bucket at 25 MB, in 3 at 0.02 MB), once with ``strategy.comm_stats=true``
and once with ``false``, in ``rounds`` rounds one after the other (each round every setting, the
order of on and off swapped from one round to the next), measured as ``benchmarks.forecast``
measures a run (``StepTimes``: rank 0's median step after the first steps, validation left out).
The row of a size: the medians over the rounds of the step with and without the statistics, and
the median of each round's ratio (on / off); the fastest and slowest round beside it show the
machine's spread between runs, which a ratio within it does not beat.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import benchmark_main, in_runs_folder
from benchmarks.forecast import DEFAULT_LAST_BUCKET_MB, TIMES_FILE, median_step_ms, run_case


@dataclass
class CommStatsBenchmarkConfig:
    recipe: str = "digits"
    ranks: int = 2
    buckets: tuple[float, ...] = (25.0, 0.02)  # comm_buffer_size, MB
    overrides: tuple[str, ...] = ("trainer.max_epochs=10",)
    rounds: int = 3
    folder: str | None = None  # keep the runs there, and reuse those already done; None: a temporary folder


def _overrides(config: CommStatsBenchmarkConfig, size: float, stats: bool) -> list[str]:
    overrides = [f"strategy.comm_stats={str(stats).lower()}", f"trainer.devices={config.ranks}", *config.overrides]
    overrides.append(f"strategy.comm_buffer_size={size:g}")
    if size < DEFAULT_LAST_BUCKET_MB:
        overrides.append(f"strategy.last_comm_buffer_size={size:g}")
    return overrides


def run(config: CommStatsBenchmarkConfig, root: Path) -> list[dict[str, Any]]:
    """Per bucket size: each round's step (ms) with the statistics and without."""
    if isinstance(config.rounds, bool) or not isinstance(config.rounds, int) or config.rounds < 1:
        raise ValueError(f"rounds={config.rounds!r} is invalid: expected a number of rounds, at least 1.")
    steps: dict[float, dict[bool, list[float]]] = {size: {True: [], False: []} for size in config.buckets}
    for number in range(1, config.rounds + 1):
        order = (True, False) if number % 2 else (False, True)
        for size in config.buckets:
            for stats in order:
                folder = root / f"round{number}" / f"{config.recipe}-{size:g}-{'on' if stats else 'off'}"
                run_case(config.recipe, _overrides(config, size, stats), folder)
                step = median_step_ms(json.loads((folder / TIMES_FILE).read_text()))
                steps[size][stats].append(step)
                print(f"round {number}: {folder.name}: {step:.2f} ms", flush=True)
    return [{"size": size, "on": runs[True], "off": runs[False]} for size, runs in steps.items()]


def report(rows: list[dict[str, Any]], config: CommStatsBenchmarkConfig) -> str:
    lines = [
        f"The {config.recipe} recipe on {config.ranks} ranks, step (ms, rank 0's median) with comm_stats on and off: "
        f"medians over {config.rounds} round{'s' * (config.rounds != 1)}, the fastest to the slowest round beside them",
        "",
        "| comm_buffer_size (MB) | on | on: rounds | off | off: rounds | on / off (median of the rounds') |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        on, off = row["on"], row["off"]
        ratio = statistics.median(a / b for a, b in zip(on, off))
        lines.append(
            f"| {row['size']:g} | {statistics.median(on):.2f} | {min(on):.2f} to {max(on):.2f} "
            f"| {statistics.median(off):.2f} | {min(off):.2f} to {max(off):.2f} | {ratio:.3f} |"
        )
    return "\n".join(lines)


def run_and_report(config: CommStatsBenchmarkConfig) -> str:
    return report(in_runs_folder(config.folder, lambda root: run(config, root)), config)


main = benchmark_main("comm_stats", CommStatsBenchmarkConfig, run_and_report)

if __name__ == "__main__":
    main()
