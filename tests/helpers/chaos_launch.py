"""Replica groups launched as docs/fault_tolerance.md launches them, under planned faults, and what they end with.

``launch_under_faults`` starts the documented lighthouse and one documented ``torchrun`` per replica
group (``tests.helpers.torchft``), the recipe shrunk to a tiny GPT (``TINY``) and given the chaos
fixture's callbacks (``tests.helpers.chaos``: the transient faults of the plan, every rank's final
state). It may kill one rank of a group (its torchrun starts the group's workers again) or a whole
group (its torchrun and workers SIGKILLed, then its command started again, as SLURM requeues a
lost node's job), once that group has committed ``after`` steps. It waits for every torchrun to
exit by itself, kills whatever is left in any case, and returns a ``Launched``: the final state of
every rank of every group, the faults that fired, every group's workers and output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.chaos import (
    Fault,
    faults_environment,
    read_fault_log,
    read_finals,
    read_trained,
    unequal_ranks,
)
from tests.helpers.documented import ROOT, DocumentedCommand
from tests.helpers.torchft import (
    LaunchedGroup,
    documented_group_launch,
    documented_lighthouse,
    wait_for_groups,
    wait_for_groups_to_end,
)

# The documented commands' recipe made tiny (one layer of 32), for 7 processes on 2 loaded cores; every
# rank validates on the same 8 batches once, after the last step.
TINY = [
    "data.max_bytes=30000", "data.block_size=32", "data.batch_size=4", "model.n_layer=1", "model.n_embd=32",
    "model.n_head=2", "model.warmup_steps=1", "callbacks.throughput.warmup=1", "trainer.limit_val_batches=8",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
]  # fmt: skip
FIXTURE = "tests.helpers.chaos"


@dataclass(frozen=True)
class Kill:
    """A death during the run: ``what`` is ``"rank"`` (the group's last rank, SIGKILL) or ``"group"`` (its
    torchrun and every worker, then its command again), once replica group ``group`` trained ``after`` steps
    (the trainer's global step, whatever torchft counts: DiLoCo commits only its syncs)."""

    what: str
    group: int
    after: int

    def __post_init__(self) -> None:
        if self.what not in ("rank", "group"):
            raise ValueError(f"Kill(what={self.what!r}) is invalid: expected 'rank' or 'group'.")


@dataclass
class Launched:
    """What a launch ended with."""

    finals: dict[tuple[int, int], dict[str, Any]]  # (group, rank): tests.helpers.chaos.FinalWeights' record
    fired: list[dict[str, Any]]  # tests.helpers.chaos.read_fault_log's records
    groups: list[LaunchedGroup]
    planned: list[Fault]

    def describe(self) -> str:
        return "\n\n".join(group.describe() for group in self.groups)

    def unfired(self) -> list[str]:
        fired = {record["fault"] for record in self.fired}
        return [f"{index}: {fault}" for index, fault in enumerate(self.planned) if index not in fired]

    def unequal(self) -> list[str]:
        return unequal_ranks(self.finals)

    def val_losses(self) -> dict[tuple[int, int], float | None]:
        return {key: final["val_loss"] for key, final in self.finals.items()}


def launch_under_faults(
    tmp_path: Path,
    mode: str,
    groups: int,
    ranks: int,
    steps: int,
    faults: list[Fault] = (),
    kill: Kill | None = None,
    extra: list[str] = (),
    timeout: float = 1500.0,
    min_replicas: int | None = None,
    join_timeout_ms: int | None = None,
) -> Launched:
    """``groups`` replica groups of ``ranks`` ranks in ``mode`` (``per_step`` or ``diloco``: the documented
    commands), ``steps`` steps, under ``faults`` and ``kill``; see the module docstring. ``timeout``
    bounds each wait (the groups to train, to recover, to end). ``min_replicas`` replaces the documented
    value, in the lighthouse's command and the groups' alike; ``join_timeout_ms`` the lighthouse's."""
    launch = documented_group_launch(ranks)
    lighthouse_command, command = launch.lighthouse, launch.modes[mode]
    if min_replicas is not None:
        lighthouse_command = with_min_replicas(lighthouse_command, min_replicas)
        command = with_min_replicas(command, min_replicas)
    if join_timeout_ms is not None:
        lighthouse_command = with_join_timeout(lighthouse_command, join_timeout_ms)
    tmp_path.mkdir(parents=True, exist_ok=True)
    cwd, environ, lighthouse = documented_lighthouse(tmp_path, lighthouse_command, launch.exports, ROOT)
    fault_log, final_folder = tmp_path / "faults.jsonl", tmp_path / "final"
    environ = {**environ, **faults_environment(faults, fault_log)}
    arguments = [
        *TINY, f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
        f"+callbacks.faults._target_={FIXTURE}.TransientFaults",
        f"+callbacks.final._target_={FIXTURE}.FinalWeights", f"+callbacks.final.folder={final_folder}", *extra,
    ]  # fmt: skip
    launched: list[LaunchedGroup] = []
    killed = {kill.group} if kill is not None else set()

    def no_restart_but_the_victims() -> None:
        # A group that restarts its workers unasked (a wedge its ranks gave up on, a crash) fails the run now,
        # not at the end: its torchrun would retrain it from scratch and could hide what went wrong.
        for group in launched:
            limit = ranks * (2 if group.number in killed else 1)
            assert len(group.workers) <= limit, (
                f"replica group {group.number} restarted its workers ({group.workers}; "
                f"{'one death was planned' if group.number in killed else 'no death was planned'}):\n{group.describe()}"
            )

    try:
        launched = [LaunchedGroup(number, command, cwd, environ, arguments) for number in range(groups)]
        if kill is not None:
            victim = launched[kill.group]
            wait_for_groups(
                f"replica group {kill.group} to train {kill.after} steps before its {kill.what} is killed",
                lambda: read_trained(tmp_path, kill.group) >= kill.after and len(victim.watch()) == ranks,
                launched,
                timeout,
                no_restart_but_the_victims,
            )
            if kill.what == "rank":
                victim.kill_worker()
            else:
                victim.relaunch()
        wait_for_groups_to_end(launched, timeout, no_restart_but_the_victims)
    finally:
        for group in launched:
            group.stop()
        lighthouse.kill()
        lighthouse.wait()
    left = {group.number: group.alive_workers() for group in launched if group.alive_workers()}
    assert not left, f"workers left running (by replica group): {left}"
    return Launched(
        finals=read_finals(final_folder),
        fired=read_fault_log(fault_log),
        groups=launched,
        planned=list(faults),
    )


def with_min_replicas(command: DocumentedCommand, count: int) -> DocumentedCommand:
    """``command`` (the lighthouse's or a group's) with ``count`` for its ``--min_replicas`` or ``strategy.ft.min_replicas``."""
    argv = list(command.argv)
    for index, argument in enumerate(argv):
        if argument == "--min_replicas":
            argv[index + 1] = str(count)
        elif argument.startswith("strategy.ft.min_replicas="):
            argv[index] = f"strategy.ft.min_replicas={count}"
    assert argv != list(command.argv), f"{command.text} sets no min_replicas"
    return dataclasses.replace(command, argv=tuple(argv))


def with_join_timeout(command: DocumentedCommand, milliseconds: int) -> DocumentedCommand:
    """The lighthouse's ``command`` with ``milliseconds`` for its ``--join_timeout_ms``."""
    argv = list(command.argv)
    index = argv.index("--join_timeout_ms")
    argv[index + 1] = str(milliseconds)
    return dataclasses.replace(command, argv=tuple(argv))


def check_survived(launched: Launched, groups: int, ranks: int, steps: int, restarted: set[int] = frozenset()) -> None:
    """What a run that survives its faults ends with: every planned fault fired; every rank of every group
    wrote its final state at ``steps``; no group but those ``restarted`` started a worker again (and those
    started theirs once, as one death asks); every rank of every group bitwise equal, and validated alike at the end."""
    unfired = launched.unfired()
    assert not unfired, f"planned faults that never fired: {unfired}\n{launched.describe()}"
    expected = {(group, rank) for group in range(groups) for rank in range(ranks)}
    assert set(launched.finals) == expected, (
        f"final states written by {sorted(launched.finals)}, expected {sorted(expected)}\n{launched.describe()}"
    )
    wrong_step = {key: final["global_step"] for key, final in launched.finals.items() if final["global_step"] != steps}
    assert not wrong_step, f"ranks that ended short of trainer.max_steps={steps}: {wrong_step}"
    for group in launched.groups:
        attempts = 2 if group.number in restarted else 1
        assert len(group.workers) == attempts * ranks, (
            f"replica group {group.number} started {len(group.workers)} workers, expected {attempts * ranks} "
            f"({'one death' if attempts == 2 else 'no restart'})\n{group.describe()}"
        )
        restarts = {rank: launched.finals[group.number, rank]["restarts"] for rank in range(ranks)}
        if group.number not in restarted:
            assert set(restarts.values()) == {0}, f"replica group {group.number}'s workers were restarted: {restarts}"
    unequal = launched.unequal()
    fired = "\n".join(str(record) for record in launched.fired)
    assert not unequal, "the ranks do not end bitwise equal:\n" + "\n".join(unequal) + f"\nfaults fired:\n{fired}"
    # The fit's last validation comes after the last quorum that reconciles the groups (docs/fault_tolerance.md,
    # "The groups end equal"): equal final states must have validated alike.
    losses = launched.val_losses()
    assert len(set(losses.values())) == 1, (
        f"every rank ends with the same state, but their last validation losses differ (some validated another "
        f"state than their final one): {losses}\nfaults fired:\n{fired}"
    )
