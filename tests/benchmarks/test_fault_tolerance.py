"""`python -m benchmarks.fault_tolerance`, shrunk: one replica group of two killed, restarted by its
torchrun, back with its peer's parameters bit for bit, the job never restarted as a whole."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from tests.helpers.recipes import run_benchmark  # noqa: E402


@pytest.mark.slow
def test_fault_tolerance_benchmark_kills_a_replica_group_and_takes_it_back(tmp_path):
    # Two groups and both needed for a step: the survivor waits for the restart (no fault-free
    # runs to compare with), so a short run spans it.
    output = run_benchmark(
        "fault_tolerance", "replicas=2", "min_replicas=2", "steps=40", "kill_every=15", "compare=false",
        "recipe=['experiment=gpt_tiny','strategy.ft.quorum_timeout=150','trainer.limit_val_batches=2']", f"hydra.run.dir={tmp_path}", timeout=300,
    )  # fmt: skip
    row = next(line for line in output.splitlines() if line.startswith("| 1 | 1 |"))
    assert row.strip("|").split("|")[-1].strip() == "yes", output  # recovered bitwise
    assert "job restarted as a whole: no" in output
    assert "killed replica group 1" in output
