"""Replica groups of several ranks under torchft against one job of all the ranks without it (issue 44).

    python -m benchmarks.ft_groups                       # 2 groups of 2 CPU ranks against 4 ranks: 6 runs of 160 steps
    python -m benchmarks.ft_groups rounds=2              # each run twice, the order rotated
    python -m benchmarks.ft_groups modes=[per_step,diloco] max_steps=320

For each mode, two runs of ``recipes/gpt.py`` (its default small GPT on the stdlib bytes, CPU,
the same seed, schedule, per-rank batch and ``max_steps``, hence the same tokens):

- **groups**: the launch of docs/fault_tolerance.md ("Replica groups of several ranks"),
  fault-free: a ``torchft_lighthouse --min_replicas G`` and, per group, with ``REPLICA_GROUP_ID``
  set, ``torchrun --standalone --nproc-per-node=N recipes/gpt.py strategy.fault_tolerance=torchft
  strategy.ft.min_replicas=G trainer.devices=N`` (without ``--max-restarts``: a failure fails
  the benchmark rather than being hidden by a restart);
- **one job**: ``torchrun --standalone --nproc-per-node=G*N recipes/gpt.py trainer.devices=G*N``,
  without fault tolerance. torchrun, not the recipe's own launcher, so that both sides start
  their ranks alike: torchrun puts each worker in a session of its own, Lightning's launcher keeps
  its ranks in one, and Linux's autogroup scheduling shares a busy machine's cores per session
  (docs/benchmarks.md shows what that did to a first run).

The modes: per-step sync (the recipe as it is), LocalSGD averaging every K steps
(``strategy.local_sgd.steps=K``) and DiLoCo (also ``strategy.local_sgd.outer=nesterov``). In
the groups, LocalSGD's inner steps are data parallelism inside each group and its syncs cross
groups: G replicas, each stepping on N ranks' batches. In the one job every rank is a replica
of its own: G*N replicas, each stepping on one rank's batch. Every process runs with
``OMP_NUM_THREADS=1`` (the ranks share the machine's cores) and ``strategy.comm_stats=true``.
The recipe validates once, on the whole validation set, after the last step
(``trainer.val_check_interval=max_steps``, ``trainer.limit_val_batches=null``): with LocalSGD
that step is a sync, so every replica validates the same model.

Reported per run:

- **MB across groups per step and rank**: the groups' ``ft/across_mb_per_step`` (each rank's
  shards that crossed groups, over the steps). For the one job, what would cross if its ranks
  were G sites of N ranks: the bytes each rank hands to its all-reduces per step (from the
  ``[lit_dp] comm:`` line: a step's gradients, or LocalSGD's averages per local step), all of
  which a flat all-reduce over the sites sends between them (the count of the groups' own line,
  "of the X MB it reduced"). ``of P`` divides by P, a step's gradient bytes.
- **s/step**: from each trainer's rank 0 (``StepClock``), the wall time of each window of K steps
  after the first ``timing_from`` ones, divided by K (a window holds one LocalSGD sync); the
  median over the windows, so that a burst of another process's load on the machine moves it
  little; for the groups, the mean of the groups' figures. Over several ``rounds``, the median
  of the rounds' figures. Validation and start-up are outside it.
- **val loss**: the ``[lit_dp] final`` line's (for the groups, group 0's; the report says how far
  the groups' losses are apart); over several rounds, their mean.
- **wall**: the whole command, start-up and validation included.

The runs go one after the other, a mode's two jobs side by side; each round rotates the modes
and swaps which job goes first, so that drift on a shared machine hits both alike.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import (
    LIGHTHOUSE_FLAGS,
    benchmark_main,
    check_timing_from,
    environment,
    final_metrics,
    rotated,
    run_all,
    start_lighthouse,
    torchrun,
)

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("one job", "groups")

# name: (label, recipe overrides with {k} for local_steps)
MODES: dict[str, tuple[str, tuple[str, ...]]] = {
    "per_step": ("per-step sync", ()),
    "average": ("averaging K={k}", ("strategy.local_sgd.steps={k}",)),
    "diloco": ("DiLoCo K={k}", ("strategy.local_sgd.steps={k}", "strategy.local_sgd.outer=nesterov")),
}


@dataclass
class FTGroupsConfig:
    """What to run (benchmarks/conf/ft_groups.yaml)."""

    groups: int = 2  # replica groups; the one job has groups * ranks ranks
    ranks: int = 2  # ranks per replica group (torchrun --nproc-per-node)
    modes: tuple[str, ...] = ("per_step", "average", "diloco")
    local_steps: int = 16  # K of LocalSGD averaging and DiLoCo; also the timing window
    max_steps: int = 160  # a multiple of local_steps: LocalSGD's runs validate right after a sync
    timing_from: int = 32  # steps left out of the timing (a multiple of local_steps)
    rounds: int = 1  # each run this many times, the order rotated
    extra: tuple[str, ...] = ()  # recipe overrides for every run
    lighthouse: tuple[str, ...] = LIGHTHOUSE_FLAGS
    timeout: float = 1200.0  # seconds a run may take
    output_dir: str = "."

    def __post_init__(self) -> None:
        if self.groups < 2:
            raise ValueError(
                f"groups={self.groups} is invalid: expected at least 2 replica groups (one sends nothing across)."
            )
        if self.ranks < 1:
            raise ValueError(f"ranks={self.ranks} is invalid: expected at least 1 rank per replica group.")
        unknown = [mode for mode in self.modes if mode not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes={list(self.modes)} is invalid: expected some of {', '.join(MODES)}.")
        if self.local_steps < 1 or self.max_steps % self.local_steps:
            raise ValueError(
                f"max_steps={self.max_steps} is invalid with local_steps={self.local_steps}: expected a multiple of it "
                "(LocalSGD's runs must end on a sync)."
            )
        check_timing_from(self.timing_from, self.local_steps, self.max_steps)
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds} is invalid: expected at least 1.")


@dataclass
class Result:
    """One run's figures (see the module docstring)."""

    across_mb: float  # per step and rank
    gradient_mb: float  # P: a step's gradient bytes per rank
    step_s: float
    val_loss: float
    val_spread: float  # the groups' val losses apart (0 for the one job)
    wall_s: float


def step_seconds(clock: Path, config: FTGroupsConfig) -> float:
    """The median over windows of ``local_steps`` steps after ``timing_from`` of the seconds per step."""
    times = {int(step): at for step, at in json.loads(clock.read_text()).items()}
    ends = range(config.timing_from, config.max_steps + 1, config.local_steps)
    return statistics.median((times[b] - times[a]) / config.local_steps for a, b in itertools.pairwise(ends))


def comm_figures(output: str, label: str) -> tuple[float, float]:
    """From the ``[lit_dp] comm:`` line: MB each rank hands to its all-reduces per step, and a step's gradient MB."""
    line = next((line for line in output.splitlines() if line.startswith("[lit_dp] comm: ")), None)
    gradients = re.search(r"([\d.]+) MB in \d+ buckets? per step", line or "") or re.search(
        r"data parallelism's ([\d.]+) MB", line or ""
    )
    if line is None or gradients is None:
        raise RuntimeError(
            f"{label}: no '[lit_dp] comm:' line with the gradients' bytes in its output:\n{output[-3000:]}"
        )
    local = re.search(r"([\d.]+) MB per local step", line)
    return float((local or gradients).group(1)), float(gradients.group(1))


def recipe(config: FTGroupsConfig, overrides: list[str], folder: Path, clock: Path) -> list[str]:
    return [
        str(ROOT / "recipes" / "gpt.py"),
        f"trainer.max_steps={config.max_steps}",
        f"trainer.val_check_interval={config.max_steps}",
        "trainer.limit_val_batches=null",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "strategy.comm_stats=true",
        f"hydra.run.dir={folder}",
        "+callbacks.clock._target_=benchmarks.common.StepClock",
        f"+callbacks.clock.path={clock}",
        *config.extra,
        *overrides,
    ]


def run_one_job(config: FTGroupsConfig, overrides: list[str], folder: Path) -> Result:
    folder.mkdir(parents=True)
    clock, log = folder / "clock.json", folder / "output.log"
    ranks = config.groups * config.ranks
    argv = [*torchrun(ranks), *recipe(config, overrides, folder / "run", clock), f"trainer.devices={ranks}"]
    began = time.monotonic()
    run_all([(argv, environment(), log)], config.timeout, f"one job ({folder.name})")
    wall = time.monotonic() - began
    output = log.read_text(errors="replace")
    across, gradients = comm_figures(output, str(log))
    metrics = final_metrics(output, str(log))
    return Result(across, gradients, step_seconds(clock, config), metrics["val_loss"], 0.0, wall)


def run_groups(config: FTGroupsConfig, overrides: list[str], folder: Path) -> Result:
    folder.mkdir(parents=True)
    beacon, address = start_lighthouse(folder, config.groups, config.lighthouse)
    commands = []
    for group in range(config.groups):
        argv = [
            *torchrun(config.ranks),
            *recipe(config, overrides, folder / f"group{group}", folder / f"clock{group}.json"),
            "strategy.fault_tolerance=torchft",
            f"strategy.ft.min_replicas={config.groups}",
            f"trainer.devices={config.ranks}",
        ]
        env = environment(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=str(group))
        commands.append((argv, env, folder / f"group{group}.log"))
    began = time.monotonic()
    try:
        run_all(commands, config.timeout, f"replica groups ({folder.name})")
    finally:
        beacon.send_signal(signal.SIGTERM)
        beacon.wait()
    wall = time.monotonic() - began
    outputs = [log.read_text(errors="replace") for _, _, log in commands]
    metrics = [final_metrics(output, str(log)) for output, (_, _, log) in zip(outputs, commands)]
    losses = [m["val_loss"] for m in metrics]
    _, gradients = comm_figures(outputs[0], str(commands[0][2]))
    step = statistics.mean(step_seconds(folder / f"clock{group}.json", config) for group in range(config.groups))
    return Result(metrics[0]["ft/across_mb_per_step"], gradients, step, losses[0], max(losses) - min(losses), wall)


def run(config: FTGroupsConfig) -> dict[tuple[str, str], list[Result]]:
    """Every (mode, job)'s results, one per round."""
    results: dict[tuple[str, str], list[Result]] = {(mode, job): [] for mode in config.modes for job in JOBS}
    output = Path(config.output_dir).resolve()
    for round_index in range(config.rounds):
        jobs = JOBS if round_index % 2 == 0 else JOBS[::-1]
        for mode in rotated(config.modes, round_index):
            overrides = [override.format(k=config.local_steps) for override in MODES[mode][1]]
            for job in jobs:
                folder = output / f"round{round_index}" / f"{mode}-{job.replace(' ', '_')}"
                runner = run_groups if job == "groups" else run_one_job
                results[mode, job].append(runner(config, overrides, folder))
                print(f"[benchmark] round {round_index}: {mode}, {job} done", flush=True)
    return results


def report(results: dict[tuple[str, str], list[Result]], config: FTGroupsConfig) -> str:
    ranks = config.groups * config.ranks
    names = {
        "one job": f"one job of {ranks} ranks",
        "groups": f"{config.groups} groups of {config.ranks} ranks (torchft)",
    }
    lines = [
        (
            f"recipes/gpt.py {' '.join(config.extra)} on CPU: {config.groups} replica groups of {config.ranks} ranks "
            f"against one job of {ranks} ranks; trainer.max_steps={config.max_steps} (the same tokens in every run); "
            f"s/step over windows of {config.local_steps} steps after step {config.timing_from}; "
            f"{config.rounds} round{'s' * (config.rounds > 1)}"
        ),
        "",
        "| mode | job | MB across groups per step and rank | of P | s/step | groups / one job | val loss | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for mode in config.modes:
        label = MODES[mode][0].format(k=config.local_steps)
        figures = {}
        for job in JOBS:
            runs = results[mode, job]
            figures[job] = {
                "across": runs[0].across_mb,
                "of_p": runs[0].across_mb / runs[0].gradient_mb,
                "step": statistics.median(r.step_s for r in runs),
                "loss": statistics.mean(r.val_loss for r in runs),
                "wall": statistics.median(r.wall_s for r in runs),
            }
        flat, grouped = figures["one job"], figures["groups"]
        for job in JOBS:
            f = figures[job]
            ratio = f"{grouped['step'] / flat['step']:.3f}" if job == "groups" else ""
            lines.append(
                f"| {label} | {names[job]} | {f['across']:.4f} | {f['of_p']:.4f} | {f['step']:.3f} | {ratio} "
                f"| {f['loss']:.4f} | {f['wall']:.0f} |"
            )
        summary.append(
            f"{label}: the groups send {grouped['across'] / flat['across']:.3f} of the one job's bytes across groups "
            f"(1/N = {1 / config.ranks:.3f}), at {grouped['step'] / flat['step']:.3f} of its step time, "
            f"val loss {grouped['loss'] - flat['loss']:+.4f} against it"
        )
    runs = [r for rs in results.values() for r in rs]
    spread = max(r.val_spread for r in runs)
    rounds_apart = max(max(r.val_loss for r in rs) - min(r.val_loss for r in rs) for rs in results.values())
    lines += ["", *summary, f"the replica groups' val losses at most {spread:.4f} apart in any run"]
    if config.rounds > 1:
        lines.append(f"a run's val loss at most {rounds_apart:.4f} apart across rounds")
    return "\n".join(lines)


main = benchmark_main("ft_groups", FTGroupsConfig, lambda config: report(run(config), config))

if __name__ == "__main__":
    main()
