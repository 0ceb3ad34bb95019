"""docs/fault_tolerance.md's launch as a user runs it, every replica group killed in turn.

The lighthouse command and the replica groups' torchrun command are read from the docs and run
as written (only the lighthouse's port is a free one, and ``trainer.max_steps`` is appended),
from a fresh folder: three groups of the recipe's small GPT, one CPU process each. The worker
of group 0, then 1, then 2, then 0 again gets SIGKILL, each once the one before is back.
Every time: the survivors go on (their workers keep one pid from start to end, and each says
the victim left in one line, without a traceback); nothing restarts as a whole (only the
victim's worker changes); the victim recovers live, from a peer (its own line says so). A living
group that misses a quorum's join timeout on a loaded machine is also left out and said to leave;
it then catches up from a peer, and says so: the survivors' lines are counted against both. At the
end every launcher exits 0 by itself, no worker is left, and every group's final checkpoint
holds bitwise the same parameters.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from tests.helpers.documented import ROOT, DocumentedCommand, documented_commands  # noqa: E402
from tests.helpers.torchft import LaunchedGroup, documented_lighthouse, wait_for_groups, wait_for_groups_to_end  # noqa: E402

DOC = ROOT / "docs" / "fault_tolerance.md"
GROUPS = 3
# A multiple of the recipe's val_check_interval: the last checkpoint is the last step's. The four kills take
# about 160 steps (each victim back and training); should the run end before they do, the wait for it fails.
STEPS = 400
VICTIMS = (0, 1, 2, 0)
LEFT = re.compile(r"replica groups? ([\d, ]+) left")
# A living group that was left out of a quorum recovers without rejoining (a new worker's line ends "and rejoined").
CAUGHT_UP = r"replica group {} recovered a peer's state in [\d.]+ s(?! and)"


def said_left(output: str, victim: int) -> int:
    """How many of a group's lines say that ``victim`` left (alone or with others, before or after news of others)."""
    return sum(str(victim) in ids.split(", ") for ids in LEFT.findall(output))


def launch() -> tuple[DocumentedCommand, DocumentedCommand, dict[str, str]]:
    """The lighthouse's command, a replica group's, and what the launch block exports."""
    commands = documented_commands([DOC])
    lighthouse = next(c for c in commands if c.argv[0] == "torchft_lighthouse")
    group = next(c for c in commands if c.argv[0] == "torchrun" and dict(c.env).get("REPLICA_GROUP_ID") == "$group")
    block = DOC.read_text().split("```bash")[2].split("```")[0]  # the launch block (the first is pip's)
    assert lighthouse.text in " ".join(block.split()), "the lighthouse's command is not in the launch block"
    exports = {}
    for line in block.splitlines():
        if line.startswith("export "):
            exports.update(word.split("=", 1) for word in shlex.split(line, comments=True)[1:])
    return lighthouse, group, exports


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_documented_launch_survives_every_replica_group_killed_in_turn(tmp_path):
    lighthouse_command, group_command, exports = launch()
    cwd, environ, lighthouse = documented_lighthouse(tmp_path, lighthouse_command, exports, ROOT)
    groups: list[LaunchedGroup] = []
    try:
        steps = [f"trainer.max_steps={STEPS}"]
        groups = [LaunchedGroup(number, group_command, cwd, environ, steps) for number in range(GROUPS)]
        wait_for_groups("every group to train", lambda: all(g.committed() >= 5 for g in groups), groups, 600)
        for kill_number, victim in enumerate(VICTIMS, start=1):
            group = groups[victim]
            pid = group.worker()
            assert pid is not None, group.describe()
            others = [g for g in groups if g is not group]
            survivors = {g.number: g.worker() for g in others}
            rejoined = group.output().count(f"replica group {victim} recovered a peer's state in")
            left = {g.number: said_left(g.output(), victim) for g in groups}
            os.kill(pid, signal.SIGKILL)
            which = f"kill {kill_number} (replica group {victim})"
            wait_for_groups(
                f"the survivors of {which} to say it left",
                lambda: all(said_left(g.output(), victim) > left[g.number] for g in others),
                groups,
                120,
            )
            committed = {g.number: g.committed() for g in others}
            wait_for_groups(
                f"the survivors of {which} to go on",
                lambda: all(g.committed() > committed[g.number] + 3 for g in others),
                groups,
                120,
            )
            wait_for_groups(
                f"replica group {victim} to recover live after kill {kill_number}",
                lambda: group.output().count(f"replica group {victim} recovered a peer's state in") > rejoined,
                groups,
                300,
            )
            wait_for_groups(
                f"replica group {victim} to train again after kill {kill_number}",
                lambda: group.committed() > max(committed.values()),
                groups,
                120,
            )
            kept = {g.number: g.worker() for g in others}
            assert kept == survivors, f"kill {kill_number} (replica group {victim}): the survivors' workers {survivors} became {kept}"
        wait_for_groups_to_end(groups, 600)
    finally:
        for group in groups:
            group.stop()  # its workers too: torchrun starts each in a session of its own
        lighthouse.kill()  # as the docs' script stops it once the groups are done
        lighthouse.wait()

    outputs = {group.number: group.output() for group in groups}
    for group in groups:
        killed = VICTIMS.count(group.number)
        # No whole-job restart: one new worker per kill of this group, none for the others' kills.
        assert len(group.workers) == killed + 1, f"replica group {group.number}: workers {group.workers}\n{group.describe()}"
        output = group.output()
        assert len(re.findall(rf"replica group {group.number} recovered a peer's state in [\d.]+ s and rejoined", output)) == killed, (
            group.describe()
        )
        assert "Traceback (most recent call last)" not in output, group.describe()
        for victim in set(VICTIMS) - {group.number}:
            # One line per failure on each survivor, and at most one more per time the victim, alive, was left out.
            caught_up = len(re.findall(CAUGHT_UP.format(victim), outputs[victim]))
            assert VICTIMS.count(victim) <= said_left(output, victim) <= VICTIMS.count(victim) + caught_up, (
                f"replica group {victim} caught up {caught_up} times\n{group.describe()}"
            )
        for pid in group.workers:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), (
                f"replica group {group.number}'s worker {pid} is still running"
            )
    finals = [torch.load(g.run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"] for g in groups]
    for number, state in enumerate(finals[1:], start=1):
        for name, tensor in finals[0].items():
            assert torch.equal(tensor, state[name]), f"replica group {number}'s final {name} differs from group 0's"
