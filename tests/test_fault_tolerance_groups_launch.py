"""docs/fault_tolerance.md's launch of replica groups of several ranks, as a user runs it, one rank killed.

Two replica groups of the recipe's small GPT, each a ``torchrun --nproc-per-node=2`` of two CPU
ranks, around the documented lighthouse; per-step sync, and DiLoCo across the groups (the
documented command with ``strategy.local_sgd.steps=16 strategy.local_sgd.outer=nesterov``). The
commands are read from the docs and run as written, from a fresh folder (only the lighthouse's port
is a free one, and ``trainer.max_steps`` is appended). Once both groups train, one rank of group 1
gets SIGKILL. Then: every launcher exits 0 by itself; group 0's workers keep their pids from
start to end and it never stops committing; group 1's torchrun starts both its ranks again, and
the group recovers live from group 0 and says it rejoined; no worker is left running; both groups
end at ``max_steps`` with bitwise equal weights, and equal optimizer states with per-step sync.
With DiLoCo the run ends on a sync step and each group keeps its own inner optimizer.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from tests.helpers.documented import ROOT  # noqa: E402
from tests.helpers.torchft import LaunchedGroup, documented_group_launch, documented_lighthouse, wait_for_groups  # noqa: E402

RANKS = 2
K = 16  # the DiLoCo command's local_sgd.steps
STEPS = 96  # a multiple of K: the run ends on a sync
KILL_AFTER = 30  # optimizer steps of group 1 before one of its ranks is killed
# What torchft counts (its committed transactions) once group 1 took KILL_AFTER steps: each step with
# per-step sync; with DiLoCo the first step's quorum and one per sync (the steps between take none).
COMMITTED = {"per_step": KILL_AFTER, "diloco": 1 + KILL_AFTER // K}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["per_step", "diloco"])
def test_the_documented_launch_of_groups_of_two_ranks_survives_a_killed_rank(tmp_path, mode):
    launch = documented_group_launch(RANKS)
    commands = launch.modes
    cwd, environ, lighthouse = documented_lighthouse(tmp_path, launch.lighthouse, launch.exports, ROOT)
    groups: list[LaunchedGroup] = []
    try:
        steps = [f"trainer.max_steps={STEPS}"]
        groups = [LaunchedGroup(number, commands[mode], cwd, environ, steps) for number in range(2)]
        survivor, victim = groups
        trained = COMMITTED[mode]
        wait_for_groups("both groups to train", lambda: victim.committed() >= trained and len(survivor.watch()) == RANKS, groups, 400)
        first_workers = survivor.watch()
        killed = victim.watch()[-1]  # its last rank
        os.kill(killed, signal.SIGKILL)
        rejoined = re.compile(r"replica group 1 recovered a peer's state in [\d.]+ s and rejoined")
        wait_for_groups("group 1 to recover live and rejoin", lambda: rejoined.search(victim.output()), groups, 300)
        for group in groups:
            try:
                group.launcher.wait(timeout=400)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"replica group {group.number}'s torchrun did not end by itself:\n{group.describe()}") from None
            assert group.launcher.returncode == 0, group.describe()
        assert survivor.watch() == [] and survivor.workers == first_workers, survivor.describe()  # never restarted
    finally:
        for group in groups:
            group.stop()  # its workers too: torchrun starts each in a session of its own
        lighthouse.kill()
        lighthouse.wait()

    assert len(victim.workers) == 2 * RANKS, victim.describe()  # its torchrun started both ranks again, once
    assert "Traceback (most recent call last)" not in survivor.output(), survivor.describe()
    for group in groups:
        for pid in group.workers:
            alive = Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
            assert not alive, f"replica group {group.number}'s worker {pid} is still running"
    finals = [torch.load(g.run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False) for g in groups]
    assert [final["global_step"] for final in finals] == [STEPS, STEPS]
    for name, tensor in finals[0]["state_dict"].items():
        assert torch.equal(tensor, finals[1]["state_dict"][name]), f"group 1's final {name} differs from group 0's"
    inner = [final["optimizer_states"][0]["state"] for final in finals]
    same_inner = all(
        torch.equal(value, inner[1][index][key])
        for index, state in inner[0].items()
        for key, value in state.items()
        if torch.is_tensor(value)
    )
    if mode == "per_step":
        assert same_inner, "the groups' optimizer states differ after per-step sync"
    else:
        local_sgd = [final["lit_dp"]["local_sgd"] for final in finals]
        assert all(state["step"] == state["last_average"] == STEPS for state in local_sgd), local_sgd  # ended on a sync
        assert not same_inner, "with DiLoCo each group keeps its own inner optimizer"
