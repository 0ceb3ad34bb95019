"""The forecast against measurement: predicted and measured median step times, every row, side by side.

    python -m benchmarks.forecast
    python -m benchmarks.forecast recipes=[digits] contended_ranks=[] folder=forecast_runs

For each recipe (its own defaults, shortened by ``digits`` and ``gpt``'s overrides) and each number
of ranks, one **base** run (data parallelism at the first of the recipe's bucket sizes, no
simulated link, ``strategy.comm_stats=true``, so it leaves its communication profile) gives the
forecast (``lit_dp.forecast.predict``); then every case runs as a recipe run of its own and is
measured:

- with ``ranks`` ranks (each with a core of its own on a 2-core machine): data parallelism at each
  bucket size, and DiLoCo every ``local_steps`` steps (``strategy.local_sgd.outer=nesterov``), each
  without a simulated link and over one of ``links_mbit`` (0: none);
- with each of ``contended_ranks`` (more ranks than cores): data parallelism at the first bucket
  size and DiLoCo, over each of ``contended_links_mbit``; the compute is that of the base run at
  the same number of ranks (contention measured, not predicted), and beside it the forecast from
  the ``ranks``-rank base run, whose compute knows nothing of the contention.

For each data-parallel row, beside the forecast from the base run, the forecast from the row's own
run (its profile: its compute and its buckets as they ran, the link replaced by the model's time
for the bandwidth given): measured in the same minutes as the step it predicts, it isolates the
communication model from the machine's drift between runs.

The simulated link is ``benchmarks.local_sgd_overlap.SlowSyncLink(gradients=True)``: every gradient
all-reduce and every DiLoCo sync is complete no sooner than a link of that bandwidth and
``link_latency_us`` per hop, shared by them in turn, would have carried it (``2(N-1)`` hops and
``2(N-1)/N`` of its bytes per rank), nor before the real all-reduce on the loopback is. The forecast
is told the link's bandwidth and latency: the link it is asked about is the one simulated.

Measured: each run's rank 0 notes when each training batch starts and when validation runs
(``StepTimes``, a recipe callback); a step's time is from one start to the next, less the
validation between them. For data parallelism the median over the steps after the first five;
for DiLoCo, after the first ``local_steps``, the median local step plus a ``local_steps``-th of
what the median syncing step (every ``local_steps``-th) takes beyond it: the mean step with
the syncs spread over their period, with neither kind's outliers (an epoch's end) weighing in.
Each row also has the machine's 1-minute load (``os.getloadavg``) when its run ended and when
the base run its forecast comes from ended: the runs share the machine's cores with whatever
else runs, and a prediction carries its base run's load as a measurement carries its own.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from benchmarks.common import benchmark_main, in_runs_folder

ROOT = Path(__file__).resolve().parent.parent
TIMES_FILE = "step_times.json"
SKIP_STEPS = 5  # data parallelism: steps left out at the start (the bucket rebuild, first allocations)
DEFAULT_LAST_BUCKET_MB = 1.0  # last_comm_buffer_size's default: smaller sizes set it too, as the forecast's options do


class StepTimes(pl.Callback):
    """Rank 0 notes when each training batch starts and when validation runs, and writes them to
    ``step_times.json`` in the run folder when training ends."""

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._pauses: list[list[float]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._starts.append(time.monotonic())

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pauses.append([time.monotonic(), time.monotonic()])

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pauses:
            self._pauses[-1][1] = time.monotonic()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            path = Path(trainer.default_root_dir) / TIMES_FILE
            path.write_text(json.dumps({"starts": self._starts, "pauses": self._pauses}))


def median_step_ms(times: dict[str, list], local_steps: int = 1) -> float:
    """The typical step (ms), validations left out: for data parallelism (``local_steps`` 1) the median
    step after ``SKIP_STEPS``; with a sync every ``local_steps`` steps, after the first period, the median
    local step plus a ``local_steps``-th of what the median step that ends with a sync takes beyond it (a
    median per kind of step, so that an epoch's end, with its loaders and logs, weighs in neither)."""
    starts, pauses = times["starts"], times["pauses"]
    periods = []
    for begin, end in zip(starts, starts[1:]):
        paused = sum(max(0.0, min(end, stop) - max(begin, start)) for start, stop in pauses)
        periods.append(end - begin - paused)
    first = SKIP_STEPS if local_steps == 1 else local_steps
    if len(periods) <= first + local_steps:
        raise RuntimeError(f"{len(starts)} steps are too few to measure a period of {local_steps}: run longer")
    if local_steps == 1:
        return statistics.median(periods[first:]) * 1e3
    # The sync runs in the optimizer step of every K-th step (steps counted from 1), before the next batch.
    syncing = [p for index, p in enumerate(periods) if index >= first and (index + 1) % local_steps == 0]
    local = statistics.median(p for index, p in enumerate(periods) if index >= first and (index + 1) % local_steps)
    return (local + (statistics.median(syncing) - local) / local_steps) * 1e3


@dataclass
class ForecastBenchmarkConfig:
    """What to run (the recipes' own defaults for everything else)."""

    recipes: tuple[str, ...] = ("digits", "gpt")
    ranks: int = 2  # the full grid: as many ranks as the machine has cores
    links_mbit: tuple[float, ...] = (0.0, 50.0, 100.0, 1000.0)  # 0: no simulated link
    link_latency_us: float = 100.0  # the simulated link's, per hop (a LAN's order)
    contended_ranks: tuple[int, ...] = (3, 4)
    contended_links_mbit: tuple[float, ...] = (0.0, 100.0)
    local_steps: int = 16  # DiLoCo's K
    digits_buckets: tuple[float, ...] = (25.0, 0.02)  # comm_buffer_size, MB: the digits MLP's 0.1 MB in 1, or 3 buckets
    gpt_buckets: tuple[float, ...] = (25.0, 0.25)
    digits: tuple[str, ...] = ("trainer.max_epochs=40",)  # 920 steps: about 4 s of steps, not 1 (the median moves between seconds)
    gpt: tuple[str, ...] = ("trainer.max_steps=160", "trainer.val_check_interval=160", "trainer.limit_val_batches=2")
    rounds: int = 3  # every run this many times, round after round: the rows are medians over the rounds
    folder: str | None = None  # keep the runs there, and reuse those already done; None: a temporary folder

    def __post_init__(self) -> None:
        # Refused here, before any run: a negative latency would first be refused by the link inside a recipe run.
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds={self.rounds!r} is invalid: expected a number of rounds, at least 1.")
        latency = self.link_latency_us
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
            raise ValueError(
                f"link_latency_us={latency!r} is invalid: expected the simulated link's latency per hop in "
                "microseconds, 0 or more."
            )


@dataclass(frozen=True)
class Case:
    recipe: str
    ranks: int
    link_mbit: float
    setting: str  # "dp <MB>" or "diloco"
    contended: bool

    @property
    def name(self) -> str:
        return f"{self.recipe}-{self.ranks}-{self.link_mbit:g}-{self.setting.replace(' ', '')}"


def cases(config: ForecastBenchmarkConfig) -> list[Case]:
    found = []
    for recipe in config.recipes:
        buckets = _buckets(config, recipe)
        for link in config.links_mbit:
            found += [Case(recipe, config.ranks, link, f"dp {size:g}", False) for size in buckets]
            found.append(Case(recipe, config.ranks, link, "diloco", False))
        for ranks in config.contended_ranks:
            for link in config.contended_links_mbit:
                found += [
                    Case(recipe, ranks, link, f"dp {buckets[0]:g}", True),
                    Case(recipe, ranks, link, "diloco", True),
                ]
    return found


def _buckets(config: ForecastBenchmarkConfig, recipe: str) -> tuple[float, ...]:
    return tuple(getattr(config, f"{recipe}_buckets"))


def _overrides(case: Case, config: ForecastBenchmarkConfig) -> list[str]:
    overrides = ["strategy.comm_stats=true", f"trainer.devices={case.ranks}", *getattr(config, case.recipe)]
    if case.setting == "diloco":
        overrides += [f"strategy.local_sgd.steps={config.local_steps}", "strategy.local_sgd.outer=nesterov"]
        overrides.append(f"strategy.comm_buffer_size={_buckets(config, case.recipe)[0]:g}")
    else:
        size = case.setting.split()[1]
        overrides.append(f"strategy.comm_buffer_size={size}")
        if float(size) < DEFAULT_LAST_BUCKET_MB:  # else the last bucket (the first layers') keeps its 1 MB
            overrides.append(f"strategy.last_comm_buffer_size={size}")
    if case.link_mbit:
        overrides += [
            "+callbacks.slow_link._target_=benchmarks.local_sgd_overlap.SlowSyncLink",
            f"+callbacks.slow_link.mbit={case.link_mbit:g}",
            f"+callbacks.slow_link.latency_us={config.link_latency_us:g}",
            "+callbacks.slow_link.gradients=true",
        ]
    return overrides


def run_case(recipe: str, overrides: list[str], folder: Path) -> float:
    """Run the recipe into ``folder`` (unless a finished run is there); the 1-minute load when it ended."""
    done = folder / "load.json"
    if done.exists() and (folder / TIMES_FILE).exists():
        return json.loads(done.read_text())["load"]
    command = [
        sys.executable,
        str(ROOT / "recipes" / f"{recipe}.py"),
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "ckpt_path=null",
        "+callbacks.step_times._target_=benchmarks.forecast.StepTimes",
        f"hydra.run.dir={folder}",
        *overrides,
    ]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}"
        )
    load = os.getloadavg()[0]
    done.write_text(json.dumps({"load": load}))
    return load


def run(config: ForecastBenchmarkConfig, root: Path) -> list[dict[str, Any]]:
    """Every case, measured and predicted, in each of ``config.rounds`` rounds; a row per case, its
    figures the medians over the rounds, with the fastest and slowest measurement."""
    rounds = [_round(config, root / f"round{number}") for number in range(1, config.rounds + 1)]
    rows = []
    for taken in zip(*rounds):
        measured = [r["measured"] for r in taken]
        row: dict[str, Any] = {"case": taken[0]["case"], "spread": (min(measured), max(measured))}
        for column in ("measured", "load", "base_load", "predicted", "own", "from_base"):
            values = [r[column] for r in taken if r.get(column) is not None]
            if values:
                row[column] = statistics.median(values)
        rows.append(row)
    return rows


def _round(config: ForecastBenchmarkConfig, root: Path) -> list[dict[str, Any]]:
    """One round: each recipe's base runs and every case, measured, with the forecasts from this round's base runs."""
    from lit_dp.forecast import predict

    rows = []
    bases: dict[tuple[str, int], Path] = {}
    base_loads: dict[tuple[str, int], float] = {}
    for case in cases(config):
        key = (case.recipe, case.ranks)
        if key not in bases:
            base = Case(case.recipe, case.ranks, 0.0, f"dp {_buckets(config, case.recipe)[0]:g}", case.contended)
            bases[key] = root / f"base-{base.name}"
            base_loads[key] = run_case(case.recipe, _overrides(base, config), bases[key])
        folder = root / case.name
        load = run_case(case.recipe, _overrides(case, config), folder)
        window = config.local_steps if case.setting == "diloco" else 1
        measured = median_step_ms(json.loads((folder / TIMES_FILE).read_text()), window)
        row = {"case": case, "measured": measured, "load": load, "base_load": base_loads[key]}
        row["predicted"] = _predicted(predict, bases[key], case, config)
        if case.setting != "diloco":  # its own run left a profile (DiLoCo's synchronises no step)
            row["own"] = _predicted(predict, folder, case, config)
        two_ranks = bases.get((case.recipe, config.ranks))
        if case.contended and two_ranks is not None:
            row["from_base"] = _predicted(predict, two_ranks, case, config)
        rows.append(row)
        print(f"{root.name}: {_line(row)}", flush=True)
    return rows


def _predicted(predict: Any, base: Path, case: Case, config: ForecastBenchmarkConfig) -> float:
    sizes = _buckets(config, case.recipe)
    # Without a simulated link the link is the run's own, its latency fitted.
    link = {"bandwidth": f"{case.link_mbit:g}Mbit", "latency": f"{config.link_latency_us:g}us"} if case.link_mbit else {}
    forecast = predict(base, ranks=case.ranks, bucket_sizes=sizes, local_steps=[config.local_steps], **link)
    wanted = (
        f"DiLoCo K={config.local_steps}, syncs in fp32"
        if case.setting == "diloco"
        else f"data parallelism, buckets of {case.setting.split()[1]} MB"
    )
    row = next(row for row in forecast.scenarios[0].rows if row.setting == wanted)
    return row.step_ms


def _link(mbit: float) -> str:
    return f"{mbit:g} Mbit/s" if mbit else "none"


def _setting(case: Case, config: ForecastBenchmarkConfig) -> str:
    if case.setting == "diloco":
        return f"DiLoCo K={config.local_steps}"
    return f"DP, {case.setting.split()[1]} MB buckets"


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted / measured - 1) * 100:+.1f}%"


def _line(row: dict[str, Any]) -> str:
    case = row["case"]
    return (
        f"{case.name}: measured {row['measured']:.2f} ms, predicted {row['predicted']:.2f} ms, load {row['load']:.1f}"
    )


def _cells(value: float | None, measured: float) -> str:
    return "|  |  |" if value is None else f"| {value:.2f} | {_error(value, measured)} |"


def _within(rows: list[dict[str, Any]], column: str) -> str:
    errors = [abs(row[column] / row["measured"] - 1) for row in rows if row.get(column) is not None]
    within = sum(error <= 0.10 for error in errors)
    return f"{within} of {len(errors)} within 10%, mean |error| {statistics.fmean(errors) * 100:.1f}%" if errors else ""


def _spread(row: dict[str, Any]) -> str:
    fastest, slowest = row.get("spread") or (row["measured"], row["measured"])
    return f"{fastest:.2f} to {slowest:.2f}"


def _repeatability(rows: list[dict[str, Any]]) -> str:
    """How far the slowest round's measurement was from the fastest's, over the rows."""
    spreads = [row["spread"][1] / row["spread"][0] - 1 for row in rows if row.get("spread") and row["spread"][0] > 0]
    if not spreads:
        return ""
    return f"; the slowest round measured {statistics.median(spreads) * 100:.1f}% over the fastest (the rows' median)"


def report(rows: list[dict[str, Any]], config: ForecastBenchmarkConfig) -> str:
    lines = [
        f"Predicted against measured median step times (ms), each the median over {config.rounds} "
        f"round{'s' * (config.rounds != 1)}; "
        f"{os.cpu_count()} CPU cores; forecasts from each round's base run of the recipe at the same ranks (data "
        "parallelism, no link); for data parallelism also from the row's own run (its compute, the link predicted); "
        f"at more ranks than cores also from the {config.ranks}-rank base run; the simulated links with "
        f"{config.link_latency_us:g} us per hop",
        "",
        "| recipe | ranks | link | setting | measured | measured, fastest to slowest round | predicted | error "
        f"| from its own run | error | from the {config.ranks}-rank run | error | load (its run, the base run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        case = row["case"]
        lines.append(
            f"| {case.recipe} | {case.ranks}{' (contended)' if case.contended else ''} | {_link(case.link_mbit)} "
            f"| {_setting(case, config)} | {row['measured']:.2f} | {_spread(row)} "
            f"{_cells(row['predicted'], row['measured'])}"
            f"{_cells(row.get('own'), row['measured'])[1:]}{_cells(row.get('from_base'), row['measured'])[1:]} "
            f"{row['load']:.1f}, {row['base_load']:.1f} |"
        )
    uncontended = [row for row in rows if not row["case"].contended]
    lines += ["", f"A core per rank: {_within(uncontended, 'predicted')} from the base run"]
    if any(row.get("own") is not None for row in uncontended):
        lines[-1] += f"; data parallelism from its own run: {_within(uncontended, 'own')}"
    lines[-1] += _repeatability(uncontended)
    return "\n".join(lines)


def run_and_report(config: ForecastBenchmarkConfig) -> str:
    return report(in_runs_folder(config.folder, lambda root: run(config, root)), config)


main = benchmark_main("forecast", ForecastBenchmarkConfig, run_and_report)

if __name__ == "__main__":
    main()
