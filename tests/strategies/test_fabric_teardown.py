"""A Fabric run ends as a Trainer fit does: its trace written, its hang watchdog's thread stopped,
the straggler report's and the consistency check's summaries and the forecast said.

Fabric never tears its strategy down itself: the strategy's features end at
``fabric.strategy.teardown()`` or, without it, when the process exits. Real processes under
Lightning's script launcher (``scripts/fabric_run.py``); a run of 4 steps traces steps 1 to 9,
so only the end of the run writes the trace.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fabric_run.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["teardown", "exit"])
def test_a_fabric_run_writes_its_trace_and_leaves_no_lit_dp_thread(tmp_path, ending):
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        environ.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), ending],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"rank 0: {ending} ok" in output and f"rank 1: {ending} ok" in output, output
    assert sorted(path.name for path in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"], output
    # The lines a Trainer's fit ends with, said once, by rank 0, as the run ends.
    assert len(re.findall(r"^\[lit_dp\] straggler: (no rank lagged in \d+|\d+ of \d+) windows? of 2 steps", output, re.M)) == 1, output
    consistency = r"^\[lit_dp\] replica consistency: 2 checks every 2 synchronised steps; the replicas agreed at each$"
    assert len(re.findall(consistency, output, re.M)) == 1, output
    # The forecast (forecast_ranks=[8]): rank 0's, from its profile in memory (Fabric has no log folder).
    assert len(re.findall(r"^\[lit_dp\] forecast: fastest at 8 ranks over the run's own link: ", output, re.M)) == 1, output
    assert re.search(r"^\[lit_dp\] forecast ZeRO-1 \(sharding\.stage=1\): 8 ranks [\d.]+ ms \(x[\d.]+\) per step$", output, re.M), output
