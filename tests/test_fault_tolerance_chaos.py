"""Replica groups under transient faults and deaths, launched as docs/fault_tolerance.md launches them (issue 50).

A transient fault is one collective across replica groups that completes on every rank but
reports a failure on one side only (``tests.helpers.chaos``: injected at torchft's process group,
every one logged, so each test asserts that its faults really fired). Every run is the documented
launch (a lighthouse, one ``torchrun --nproc-per-node=N`` per group with ``REPLICA_GROUP_ID``) of
a tiny GPT, per-step sync or DiLoCo (the documented ``strategy.local_sgd.steps=16
strategy.local_sgd.outer=nesterov``). The oracle, for every test: every planned fault fired; every
torchrun exits 0 by itself; no group restarts a worker but the one whose rank or group was killed
(which restarts once); every rank of every group ends at ``max_steps`` bitwise equal, with the same
validation loss (``tests.helpers.chaos_launch.check_survived``).

- ``test_one_transient_fault``: issue 50's table, one fault per run: 2 groups x 1 rank and
  2 x 2 with per-step sync (a gradient bucket's all-reduce at step 100), 2 x 1, 2 x 2 and 3 x 2
  with DiLoCo (the 6th sync: its count, or a payload).
- ``test_a_group_left_out_of_the_last_sync_takes_the_final_state_at_the_quorum_after_the_last_step``:
  3 groups x 1 rank, DiLoCo, a group late to the last sync (``tests.helpers.chaos.Pause``) meets
  the others at their quorum after the last step and ends with them.
- ``test_what_survives_what``: per mode, 2 groups x 2 ranks: a rank's death, a group's death
  (its torchrun and workers killed and its command started again), a transient fault on every rank
  of a group at once, and one during a heal (the killed rank's group, at its first collective
  after it recovered a peer's state). A transient fault on one rank is ``test_one_transient_fault``'s.
  docs/fault_tolerance.md's table "What survives what" is filled from these.
- ``test_chaos``: the issue's chaos test: 3 groups x 2 ranks, 640 steps, 5 transient faults at
  random steps on random ranks of random groups (per-step sync: gradient buckets; DiLoCo: syncs'
  counts and payloads), one of them during the heal of a group whose rank was killed at a random
  step; plus a run without faults, whose validation loss every rank's must be within 1% of. Both
  runs take ``min_replicas=3`` (the lighthouse's and the groups'): the others wait for the killed
  rank's group instead of training on without it, so that the run with faults trains on the same
  samples as the one without but for the steps its faults discard. With the documented 2, the
  steps taken while a group restarts (from 100 to 270 of 640 here, as the machine's load makes
  its restart last) deal fewer samples, which alone moved the loss by 1.2% in a run whose ranks
  all ended equal. ``LIT_DP_CHAOS_SEED`` (default 0) draws the faults and the kill.

Run them: the chaos test is the soak tier (``-m soak``, on demand: CI's time on 2 cores cannot hold it
beside the end-to-end tier), the others the slow tier. On the project's 2-core machine, idle, a
160-step run takes 20 to 40 s (start-up included), the chaos test 2 to 3.5 minutes per mode (its two
runs); at a load average of 10 to 15, 2 to 3 minutes and 6 to 7:

    python -m pytest -q -m slow tests/test_fault_tolerance_chaos.py -p no:cacheprovider
    LIT_DP_CHAOS_SEED=1 python -m pytest -q -m soak tests/test_fault_tolerance_chaos.py -p no:cacheprovider
"""

from __future__ import annotations

import os
import random
import re

import pytest

pytest.importorskip("torchft")

from tests.helpers.chaos import Fault, random_faults  # noqa: E402
from tests.helpers.chaos_launch import FIXTURE, Kill, check_survived, launch_under_faults  # noqa: E402
from tests.helpers.documented import ROOT  # noqa: E402

MODES = ("per_step", "diloco")
TABLE = "### What survives what, per mode"  # docs/fault_tolerance.md's section filled from these tests
STEPS = 160  # 10 DiLoCo syncs of K=16: the run ends on one
K = 16
SIXTH_SYNC = 6 * K - 1  # the trainer's global_step as the step that makes the 6th sync starts
KILL_AFTER = 40  # steps the victim's group trains before it dies
CHAOS_STEPS = 640  # at least 600, a multiple of K
CHAOS_SEED = int(os.environ.get("LIT_DP_CHAOS_SEED", "0"))
# Small buckets: several all-reduces per step, so that a fault can fall on one that is not the step's first.
BUCKETS = ["strategy.comm_buffer_size=0.02", "strategy.last_comm_buffer_size=0.02"]
JOIN_TIMEOUT_MS = 30_000  # the lighthouse's, for more groups than ft.min_replicas (see test_one_transient_fault)
VAL_LOSS_TOLERANCE = 0.01  # the issue's bar: within 1% of the same run with no faults

# id: (mode, groups, ranks, fault) — issue 50's table, on the tiny GPT and 160 steps.
ISSUE_TABLE = {
    "2x1-per_step-bucket": ("per_step", 2, 1, Fault(group=1, rank=0, kind="bucket", step=100, skip=1)),
    "2x2-per_step-bucket": ("per_step", 2, 2, Fault(group=1, rank=0, kind="bucket", step=100, skip=1)),
    "2x1-diloco-sync6": ("diloco", 2, 1, Fault(group=1, rank=0, kind="sync", step=SIXTH_SYNC)),
    "2x2-diloco-sync6-count": ("diloco", 2, 2, Fault(group=1, rank=0, kind="sync-count", step=SIXTH_SYNC)),
    "3x2-diloco-sync6-payload": ("diloco", 3, 2, Fault(group=1, rank=0, kind="sync-payload", step=SIXTH_SYNC)),
}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("row", list(ISSUE_TABLE))
def test_one_transient_fault(tmp_path, row):
    mode, groups, ranks, fault = ISSUE_TABLE[row]
    # More groups than the documented min_replicas=2: as docs/fault_tolerance.md advises for DiLoCo, a join
    # timeout above the spread of the groups' arrival at a sync. With its 0.5 s a loaded machine leaves a
    # group out of one sync's quorum after another, and out of the last ones, after which the job ends
    # without it and it never holds the final state.
    join = JOIN_TIMEOUT_MS if groups > 2 else None
    launched = launch_under_faults(
        tmp_path, mode, groups, ranks, STEPS, [fault], extra=BUCKETS, timeout=900, join_timeout_ms=join
    )
    check_survived(launched, groups, ranks, STEPS)
    record = launched.fired[0]
    if mode == "diloco":
        # The fault fell on the 6th sync, as planned (the sync after step 96, whose collectives come at step 95;
        # ``sync`` counts this worker's own, which a group that joined late or was left out of one has fewer of).
        assert "sync" in record["kinds"] and record["step"] == SIXTH_SYNC, record


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_group_left_out_of_the_last_sync_takes_the_final_state_at_the_quorum_after_the_last_step(tmp_path):
    # DiLoCo, 3 groups of one rank, the documented ft.min_replicas=2, a lighthouse join timeout of 8 s (every
    # group starts in the first quorum): group 2 comes 10 s late to the last sync (after step 32), so groups 0
    # and 1 sync without it after 8 s, then take 4 s to end their step before they ask for the quorum after the
    # last step, where group 2 waits since 2 s: it takes their final state there instead of its sync, has no
    # quorum left to take, and its Trainer ends that step at max_steps as theirs did. Before, it waited the
    # quorum timeout for a quorum after the last step that nobody else would join, then failed on the torchft
    # error kept from it, and its loop counted one step past max_steps.
    steps = 2 * K
    late = [f"+callbacks.late._target_={FIXTURE}.Pause", "+callbacks.late.groups=[2]", f"+callbacks.late.step={steps - 1}",
            "+callbacks.late.seconds=10"]  # fmt: skip
    slow_end = [f"+callbacks.slow_end._target_={FIXTURE}.Pause", "+callbacks.slow_end.groups=[0,1]",
                f"+callbacks.slow_end.step={steps - 1}", "+callbacks.slow_end.seconds=4",
                "+callbacks.slow_end.when=after_step"]  # fmt: skip
    launched = launch_under_faults(
        tmp_path, "diloco", 3, 1, steps, extra=late + slow_end, timeout=600, join_timeout_ms=8000
    )
    check_survived(launched, 3, 1, steps)
    said = launched.groups[2].output()
    assert re.search(rf"replica group 2 recovered a peer's state in [\d.]+ s.* at the sync after step {steps};", said), said
    assert all("no quorum within" not in group.output() for group in launched.groups), launched.describe()


def fault_of(mode: str, group: int, rank: int, step: int) -> Fault:
    """A transient fault on the mode's cross-group collective: a gradient bucket, or a sync's first (its count)."""
    return Fault(group=group, rank=rank, kind="bucket" if mode == "per_step" else "sync", step=step)


# event: (faults, kill, the groups that restart) for a mode; 2 groups x 2 ranks.
EVENTS = {
    "rank_death": lambda mode: ([], Kill("rank", group=1, after=KILL_AFTER)),
    "group_death": lambda mode: ([], Kill("group", group=1, after=KILL_AFTER)),
    "transient_whole_group": lambda mode: ([fault_of(mode, 1, rank, SIXTH_SYNC) for rank in (0, 1)], None),
    "transient_during_heal": lambda mode: (
        [Fault(group=1, rank=0, kind="heal")],
        Kill("rank", group=1, after=KILL_AFTER),
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("event", list(EVENTS))
@pytest.mark.parametrize("mode", MODES)
def test_what_survives_what(tmp_path, mode, event):
    faults, kill = EVENTS[event](mode)
    launched = launch_under_faults(tmp_path, mode, 2, 2, STEPS, faults, kill, extra=BUCKETS, timeout=900)
    check_survived(launched, 2, 2, STEPS, restarted={kill.group} if kill else set())


def chaos_plan(mode: str, seed: int) -> tuple[list[Fault], Kill]:
    """Five transient faults and one rank's death, drawn from ``seed``: four at random steps on random ranks
    of random groups (gradient buckets, or syncs' counts and payloads), the fifth during the heal of
    the group whose rank dies after a random number of steps."""
    chooser = random.Random(seed)
    victim = chooser.randrange(3)
    kill = Kill("rank", group=victim, after=chooser.randrange(150, 400))
    kinds = ["bucket"] if mode == "per_step" else ["sync-count", "sync-payload"]
    faults = random_faults(seed, count=4, groups=[0, 1, 2], ranks=2, kinds=kinds, steps=(24, CHAOS_STEPS - 3 * K))
    # From the kill's step on: an earlier heal (a group left out of a quorum on a loaded machine catches up) is not this one.
    return [*faults, Fault(group=victim, rank=chooser.randrange(2), kind="heal", step=kill.after)], kill


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mode", MODES)
def test_chaos(tmp_path, mode):
    faults, kill = chaos_plan(mode, CHAOS_SEED)
    plan = f"LIT_DP_CHAOS_SEED={CHAOS_SEED}: {faults}, {kill}"
    settings = {"extra": BUCKETS, "timeout": 1500, "min_replicas": 3}
    calm = launch_under_faults(tmp_path / "calm", mode, 3, 2, CHAOS_STEPS, **settings)
    check_survived(calm, 3, 2, CHAOS_STEPS)
    launched = launch_under_faults(tmp_path / "chaos", mode, 3, 2, CHAOS_STEPS, faults, kill, **settings)
    try:
        check_survived(launched, 3, 2, CHAOS_STEPS, restarted={kill.group})
    except AssertionError as error:
        raise AssertionError(f"{plan}\n{error}") from None
    reference = calm.finals[0, 0]["val_loss"]
    far = {
        key: loss
        for key, loss in launched.val_losses().items()
        if abs(loss - reference) > VAL_LOSS_TOLERANCE * reference
    }
    assert not far, f"{plan}\nval_loss further than 1% from the run without faults ({reference:.4f}): {far}"


def test_the_docs_table_of_what_survives_what_names_every_test_here_and_only_these():
    text = (ROOT / "docs" / "fault_tolerance.md").read_text()
    assert TABLE in text, f"docs/fault_tolerance.md has no section {TABLE!r}"
    section = text.split(TABLE, 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_\w+)\[([\w-]+)\]`", section))
    tests = {
        *(("test_one_transient_fault", row) for row in ISSUE_TABLE),
        *(("test_what_survives_what", f"{mode}-{event}") for mode in MODES for event in EVENTS),
        *(("test_chaos", mode) for mode in MODES),
    }
    assert named == tests, (
        f"named in the docs but not a test: {named - tests}; a test the docs do not name: {tests - named}"
    )
