"""`python -m benchmarks.fault_tolerance`, shrunk: a short chaos run of three replica groups of the
recipe's small GPT (300 steps), each group killed at least once, one time two close together; every failure recovered bitwise,
nothing wedged, the job ended by itself with equal parameters. The stall and discard bars are
the full run's (on a quiet machine); here they are only reported, the machine being shared."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torchft")

from tests.helpers.recipes import run_benchmark  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_chaos_benchmark_kills_every_group_and_the_job_ends_equal(tmp_path):
    output = run_benchmark(
        "fault_tolerance", "steps=300", "chaos_seconds=60", "kill_every=3", "pair_every=2", "kills_per_group=1",
        "tail_seconds=20", "compare=false", f"hydra.run.dir={tmp_path}", timeout=1100,
    )  # fmt: skip
    rows = [line for line in output.splitlines() if re.match(r"\| \d+", line)]
    assert rows, output
    assert all(row.rstrip(" |").endswith("yes") for row in rows), output  # recovered bitwise at the first commit
    assert any("(pair)" in row for row in rows), output
    killed = re.search(r"failures per group: 0: (\d+), 1: (\d+), 2: (\d+)", output)
    assert killed and all(int(count) >= 1 for count in killed.groups()), output
    assert "wedged: never" in output
    assert "the job ended by itself: yes" in output
    assert "final parameters bitwise equal across groups: yes" in output
