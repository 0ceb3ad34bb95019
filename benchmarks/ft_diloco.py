"""DiLoCo across replica groups: a slow group against a fast one, and the cost of one transient fault (issue 50).

    python -m benchmarks.ft_diloco                        # groups of 2 CPU ranks, K=16, 320 steps, the recipe's small GPT
    python -m benchmarks.ft_diloco parts=[slow_group] slow_seconds=0.5
    python -m benchmarks.ft_diloco parts=[transient_fault] fault_modes=[diloco] fault_sync=3

Every run is ``recipes/gpt.py`` launched as docs/fault_tolerance.md launches replica groups: a
``torchft_lighthouse`` and, per group with ``REPLICA_GROUP_ID``, ``torchrun --standalone
--nproc-per-node=N recipes/gpt.py strategy.fault_tolerance=torchft strategy.ft.min_replicas=G
trainer.devices=N`` (without ``--max-restarts``: a group that fails is reported as such, not hidden
by a restart), the same seed, data and ``max_steps`` everywhere. Two parts (``parts``):

- **slow_group**: DiLoCo (``strategy.local_sgd.steps=K strategy.local_sgd.outer=nesterov``). The
  fast group alone (one group, ``min_replicas=1``), then the fast group together with a slow one
  whose rank 0 sleeps ``slow_seconds`` in every step (``lit_dp_recipes.faults.SlowRank``, inside the
  step: its whole group waits for it). From each group's rank 0 (``benchmarks.common.StepClock``,
  the wall clock at each step's end), after the first ``timing_from`` steps: the median time of an
  inner step (one that does not sync), of a sync step, and the mean time per step over the
  windows of K steps. Between syncs a group should run free: with a quorum per sync, the fast
  group's inner steps take what they take alone, and it waits for the slow one only at a sync;
  with a quorum per step, every step waits for the slow group.
- **transient_fault**: per mode in ``fault_modes`` (per-step sync, DiLoCo), two runs of ``groups``
  groups: without faults, and with one transient fault: on rank 0 of group 1, the collective across
  groups that starts the ``fault_sync``-th sync (its count of the ranks taking part), or with
  per-step sync a gradient bucket's all-reduce in the same step, completed on every rank but
  reported failed on that one (the chaos tests' fixture, ``tests.helpers.chaos.TransientFaults``).
  Reported per run: the transactions each group committed and discarded (torchft's votes, from its
  log of each group's rank 0: a step each with per-step sync; with DiLoCo the first step's and one
  per sync, the inner steps taking none), the syncs (or steps, per-step) in which a collective across groups failed
  on some rank (the fixture logs every failure it sees below the library, planned or not, as it
  happens), the validation loss of each group against the run without faults, whether every rank
  of every group ends bitwise equal (``tests.helpers.chaos.FinalWeights``), and how the run ended
  (a group that exits with an error is reported with its ``[lit_dp] the run stopped`` line).

The machine's load (``os.getloadavg``) is reported with the results: the ranks share its cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (
    LIGHTHOUSE_FLAGS,
    ROOT,
    benchmark_main,
    check_timing_from,
    environment,
    final_metrics,
    run_all,
    start_lighthouse,
    torchrun,
)

PARTS = ("slow_group", "transient_fault")
FAULT_MODES = ("per_step", "diloco")
FIXTURE = "tests.helpers.chaos"  # the chaos tests' fault injector and final-state writer
COMMIT = re.compile(r"- step \d+\] should_commit=(True|False)")


@dataclass
class FTDiLoCoConfig:
    """What to run (benchmarks/conf/ft_diloco.yaml)."""

    parts: tuple[str, ...] = PARTS
    groups: int = 2  # replica groups of the transient-fault runs (the slow-group part has one fast and one slow)
    ranks: int = 2  # ranks per replica group (torchrun --nproc-per-node)
    local_steps: int = 16  # DiLoCo's K
    max_steps: int = 320  # a multiple of local_steps: the runs end on a sync
    timing_from: int = 32  # steps left out of the timing (a multiple of local_steps)
    slow_seconds: float = 0.3  # the slow group's sleep per step
    fault_modes: tuple[str, ...] = FAULT_MODES
    fault_sync: int = 6  # the fault falls on this sync (per-step sync: in the same step)
    extra: tuple[str, ...] = ()  # recipe overrides for every run
    lighthouse: tuple[str, ...] = LIGHTHOUSE_FLAGS
    timeout: float = 1800.0  # seconds a run may take
    output_dir: str = "."

    def __post_init__(self) -> None:
        unknown = [part for part in self.parts if part not in PARTS]
        if unknown or not self.parts:
            raise ValueError(f"parts={list(self.parts)} is invalid: expected some of {', '.join(PARTS)}.")
        modes = [mode for mode in self.fault_modes if mode not in FAULT_MODES]
        if modes or not self.fault_modes:
            raise ValueError(
                f"fault_modes={list(self.fault_modes)} is invalid: expected some of {', '.join(FAULT_MODES)}."
            )
        if self.groups < 2:
            raise ValueError(
                f"groups={self.groups} is invalid: expected at least 2 replica groups (a fault crosses groups)."
            )
        if self.ranks < 1:
            raise ValueError(f"ranks={self.ranks} is invalid: expected at least 1 rank per replica group.")
        if self.local_steps < 2 or self.max_steps % self.local_steps:
            raise ValueError(
                f"max_steps={self.max_steps} is invalid with local_steps={self.local_steps}: expected local_steps of at "
                "least 2 (an inner step between syncs) and max_steps a multiple of it (the runs end on a sync)."
            )
        check_timing_from(self.timing_from, self.local_steps, self.max_steps)
        if not 1 <= self.fault_sync < self.max_steps // self.local_steps:
            raise ValueError(
                f"fault_sync={self.fault_sync} is invalid: expected a sync before the last of the run's "
                f"{self.max_steps // self.local_steps} (max_steps / local_steps), so that some follow it."
            )
        if self.slow_seconds <= 0:
            raise ValueError(f"slow_seconds={self.slow_seconds} is invalid: expected a positive number of seconds.")

    @property
    def fault_step(self) -> int:
        """The trainer's global step as the step that makes the ``fault_sync``-th sync starts."""
        return self.fault_sync * self.local_steps - 1


def diloco(config: FTDiLoCoConfig) -> list[str]:
    return [f"strategy.local_sgd.steps={config.local_steps}", "strategy.local_sgd.outer=nesterov"]


@dataclass
class GroupsRun:
    """One launch of replica groups: its folder, and what each group's torchrun ended with."""

    folder: Path
    groups: int
    ended: str = "every group ended by itself"  # or the failure
    seconds: float = 0.0

    def output(self, group: int) -> str:
        return (self.folder / f"group{group}.log").read_text(errors="replace")

    def clock(self, group: int) -> dict[int, float]:
        path = self.folder / f"clock{group}.json"
        return {int(step): at for step, at in json.loads(path.read_text()).items()} if path.exists() else {}

    def votes(self, group: int) -> tuple[int, int]:
        """Transactions group ``group`` committed and discarded (torchft's votes in the log of its rank 0)."""
        path = self.folder / f"group{group}" / f"torchft-group{group}.log"
        found = COMMIT.findall(path.read_text(errors="replace")) if path.exists() else []
        return found.count("True"), found.count("False")

    def stopped(self, group: int) -> str | None:
        """Why group ``group``'s run stopped, if it did not end by itself: its ``[lit_dp] the run stopped`` line,
        else its last line."""
        lines = [line.strip() for line in self.output(group).splitlines() if line.strip()]
        if any(line.startswith("[lit_dp] final ") for line in lines):
            return None
        said = [line for line in lines if line.startswith("[lit_dp] the run stopped")]
        return ((said or lines or ["no output"])[-1])[:300]

    def val_loss(self, group: int) -> float | None:
        try:
            return final_metrics(self.output(group), f"group {group}")["val_loss"]
        except (RuntimeError, KeyError):
            return None


def launch(
    config: FTDiLoCoConfig,
    folder: Path,
    overrides: list[str],
    per_group: list[list[str]],
    environ: dict[str, str] | None = None,
) -> GroupsRun:
    """One replica group per entry of ``per_group`` (its own overrides), the recipe with ``overrides``."""
    folder.mkdir(parents=True)
    groups = len(per_group)
    beacon, address = start_lighthouse(folder, groups, config.lighthouse)
    commands = []
    for group, own in enumerate(per_group):
        argv = [
            *torchrun(config.ranks), str(ROOT / "recipes" / "gpt.py"), "strategy.fault_tolerance=torchft",
            f"strategy.ft.min_replicas={groups}", f"trainer.devices={config.ranks}", f"trainer.max_steps={config.max_steps}",
            f"trainer.val_check_interval={config.max_steps}", "trainer.limit_val_batches=null",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.run.dir={folder / f'group{group}'}",
            "+callbacks.clock._target_=benchmarks.common.StepClock", f"+callbacks.clock.path={folder / f'clock{group}.json'}",
            *config.extra, *overrides, *own,
        ]  # fmt: skip
        env = environment(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=str(group), **(environ or {}))
        commands.append((argv, env, folder / f"group{group}.log"))
    run = GroupsRun(folder, groups)
    began = time.monotonic()
    try:
        run_all(commands, config.timeout, f"replica groups ({folder.name})")
    except RuntimeError:  # reported with the results: what a fault did to the run is the measure
        run.ended = "failed: " + "; ".join(
            f"group {group}: {why}" for group in range(groups) if (why := run.stopped(group))
        )
    finally:
        beacon.send_signal(signal.SIGTERM)
        beacon.wait()
    run.seconds = time.monotonic() - began
    return run


# --- slow group -------------------------------------------------------------------------------------


@dataclass
class Pace:
    """One group's step times (seconds), after ``timing_from``."""

    inner: float  # median of the steps that do not sync
    sync: float  # median of the steps that sync
    per_step: float  # mean over the windows of K steps


def pace(clock: dict[int, float], config: FTDiLoCoConfig) -> Pace | None:
    k, first = config.local_steps, config.timing_from
    steps = [s for s in range(first + 1, config.max_steps + 1) if s in clock and s - 1 in clock]
    if not steps:
        return None
    inner = [clock[s] - clock[s - 1] for s in steps if s % k]
    sync = [clock[s] - clock[s - 1] for s in steps if not s % k]
    ends = [s for s in range(first, config.max_steps + 1, k) if s in clock]
    windows = [(clock[b] - clock[a]) / k for a, b in zip(ends, ends[1:])]
    return Pace(statistics.median(inner), statistics.median(sync) if sync else float("nan"), statistics.mean(windows))


def slow_group(config: FTDiLoCoConfig, output: Path) -> list[str]:
    slow = [
        "+callbacks.slow._target_=lit_dp_recipes.faults.SlowRank", "+callbacks.slow.rank=0",
        f"+callbacks.slow.seconds={config.slow_seconds}", "+callbacks.slow.where=step",
    ]  # fmt: skip
    alone = launch(config, output / "alone", diloco(config), [[]])
    together = launch(config, output / "together", diloco(config), [[], slow])
    paces = {"alone": pace(alone.clock(0), config), "together": pace(together.clock(0), config)}
    slow_pace = pace(together.clock(1), config)
    lines = [
        f"A slow group against a fast one: DiLoCo K={config.local_steps}, groups of {config.ranks} ranks, "
        f"{config.max_steps} steps, the slow group's rank 0 sleeping {config.slow_seconds} s per step; step times from "
        f"each group's rank 0 after step {config.timing_from}",
        "",
        "| run | group | inner step (s) | sync step (s) | s/step over K steps | ended |",
        "|---|---|---|---|---|---|",
    ]
    rows = [("fast group alone", "fast", paces["alone"], alone), ("fast and slow", "fast", paces["together"], together),
            ("fast and slow", "slow", slow_pace, together)]  # fmt: skip
    for run_name, group, figures, run in rows:
        if figures is None:
            lines.append(f"| {run_name} | {group} | - | - | - | {run.ended} |")
            continue
        lines.append(
            f"| {run_name} | {group} | {figures.inner:.4f} | {figures.sync:.4f} | {figures.per_step:.4f} | {run.ended} |"
        )
    if paces["alone"] is not None and paces["together"] is not None:
        lines += [
            "",
            f"the fast group's inner steps take {paces['together'].inner / paces['alone'].inner:.2f} times as long with "
            f"the slow group as alone, its steps over K {paces['together'].per_step / paces['alone'].per_step:.2f} times",
        ]
    return lines


# --- transient fault --------------------------------------------------------------------------------


@dataclass
class FaultRun:
    run: GroupsRun
    failed_syncs: list[int] = field(default_factory=list)  # steps with a failed collective across groups
    fired: int = 0
    equal: str = "-"


def fault_runs(config: FTDiLoCoConfig, mode: str, output: Path) -> dict[str, FaultRun]:
    from tests.helpers.chaos import (
        Fault,
        faults_environment,
        read_failures,
        read_fault_log,
        read_finals,
        unequal_ranks,
    )

    kind = "bucket" if mode == "per_step" else "sync-count"
    overrides = [
        *(diloco(config) if mode == "diloco" else []),
        f"+callbacks.faults._target_={FIXTURE}.TransientFaults", f"+callbacks.final._target_={FIXTURE}.FinalWeights",
    ]  # fmt: skip
    results = {}
    for name, faults in (("no fault", []), ("one fault", [Fault(group=1, rank=0, kind=kind, step=config.fault_step)])):
        folder = output / f"{mode}-{name.replace(' ', '_')}"
        log, finals = folder / "faults.jsonl", folder / "final"
        run = launch(
            config, folder, [*overrides, f"+callbacks.final.folder={finals}"], [[] for _ in range(config.groups)],
            faults_environment(faults, log),
        )  # fmt: skip
        failed = sorted({record["step"] for record in read_failures(folder)})
        states = read_finals(finals)
        complete = len(states) == config.groups * config.ranks
        unequal = unequal_ranks(states) if complete else []
        equal = "yes" if complete and not unequal else ("no" if complete else f"{len(states)} ranks wrote theirs")
        results[name] = FaultRun(run, failed, len(read_fault_log(log)), equal)
    return results


def transient_fault(config: FTDiLoCoConfig, output: Path) -> list[str]:
    lines = [
        f"One transient fault: rank 0 of group 1, the {config.fault_sync}th sync's count (DiLoCo K={config.local_steps}) or "
        f"a gradient bucket at the same step (per-step sync, trainer step {config.fault_step}); {config.groups} groups of "
        f"{config.ranks} ranks, {config.max_steps} steps",
        "",
        "| mode | run | transactions committed per group | discarded per group | steps with a failed collective across groups "
        "| val loss per group | every rank equal | ended |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for mode in config.fault_modes:
        runs = fault_runs(config, mode, output)
        label = "per-step sync" if mode == "per_step" else f"DiLoCo K={config.local_steps}"
        for name, result in runs.items():
            run = result.run
            votes = [run.votes(group) for group in range(config.groups)]
            losses = [run.val_loss(group) for group in range(config.groups)]
            failed = ", ".join(map(str, result.failed_syncs[:8])) + (" ..." if len(result.failed_syncs) > 8 else "")
            lines.append(
                f"| {label} | {name} | {', '.join(str(c) for c, _ in votes)} | {', '.join(str(d) for _, d in votes)} "
                f"| {len(result.failed_syncs)}{f' ({failed})' if failed else ''} "
                f"| {', '.join('-' if loss is None else f'{loss:.4f}' for loss in losses)} | {result.equal} | {run.ended} |"
            )
        calm, hit = runs["no fault"], runs["one fault"]
        if hit.fired != 1:
            summary.append(f"{label}: the fault fired {hit.fired} times (expected once): the figures are not its cost")
            continue
        base, faulty = calm.run.val_loss(0), [hit.run.val_loss(group) for group in range(config.groups)]
        lost = [calm.run.votes(group)[0] - hit.run.votes(group)[0] for group in range(config.groups)]
        units = "syncs" if mode == "diloco" else "steps"
        gaps = ", ".join("-" if base is None or loss is None else f"{(loss - base) / base:+.2%}" for loss in faulty)
        summary.append(
            f"{label}: one fault cost {', '.join(map(str, lost))} committed transactions (per group) and "
            f"{len(hit.failed_syncs)} {units} with a failed collective; val loss against no fault: {gaps}"
        )
    return [*lines, "", *summary]


def run_and_report(config: FTDiLoCoConfig) -> str:
    output = Path(config.output_dir).resolve()
    load = os.getloadavg()
    lines = []
    if "slow_group" in config.parts:
        lines += [*slow_group(config, output / "slow_group"), ""]
    if "transient_fault" in config.parts:
        lines += [*transient_fault(config, output / "transient_fault"), ""]
    extra = " ".join(config.extra) or "(its small CPU GPT)"
    after = os.getloadavg()
    lines.append(
        f"recipes/gpt.py {extra} on CPU; load average {load[0]:.1f} before, {after[0]:.1f} after ({os.cpu_count()} cores)"
    )
    return "\n".join(lines)


main = benchmark_main("ft_diloco", FTDiLoCoConfig, run_and_report)

if __name__ == "__main__":
    main()
