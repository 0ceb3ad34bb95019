"""benchmarks/local_sgd_overlap.py, shrunk: every delay runs on the simulated link, and a delay exposes less of it."""

from __future__ import annotations

import re

import pytest

from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_overlap_benchmark_reports_every_delay(tmp_path):
    # 2 syncs of a 4 MB fragment per epoch on a 20 Mbit/s link: about 1.7 s in flight each, of which
    # two steps' compute (well under a second on any machine) can hide only part.
    output = run_benchmark(
        "local_sgd_overlap", "epochs=1", "delays=[0,2]", "link_mbit=20", f"hydra.run.dir={tmp_path}", timeout=500
    )
    rows = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^\| (\d) \| ([\d.]+) \|", output, re.M)}
    assert set(rows) == {0, 2}, output
    assert rows[2] < rows[0], output
