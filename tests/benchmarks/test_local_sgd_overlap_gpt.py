"""benchmarks/local_sgd_overlap_gpt.py, shrunk: the GPT recipe runs on the simulated link at every delay, and each is reported."""

from __future__ import annotations

import re

import pytest

from benchmarks.local_sgd_overlap import SlowSyncLink
from tests.benchmarks.test_local_sgd_gpt import TINY
from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(900)  # two recipe runs of 2 ranks on a loaded 2-core machine
def test_overlap_gpt_benchmark_reports_every_delay(tmp_path):
    overrides = ["local_steps=4", "fragments=2", "delays=[0,1]", "max_steps=8", "link_mbit=50", f"extra={TINY}"]
    output = run_benchmark("local_sgd_overlap_gpt", *overrides, f"hydra.run.dir={tmp_path}", timeout=800)
    assert "a 50 Mbit/s link for the syncs" in output, output
    row = re.compile(r"^\| (\d) \| ([\d.]+) \| [^|]* \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", re.M)
    rows = {int(m.group(1)): [float(value) for value in m.groups()[1:]] for m in row.finditer(output)}
    assert set(rows) == {0, 1}, output
    # Fragment syncs every K/F = 2 steps, counted before the fit's final one: 4 at tau 0, the last
    # one still in flight at tau 1 (applied by the fit's end, after the recipe's summary).
    assert [rows[delay][1] for delay in (0, 1)] == [4, 3], output
    for delay, (_, _, link_ms, in_flight_ms, _, _) in rows.items():
        # The link was in the way: no sync completes before the link has carried its bytes.
        assert in_flight_ms >= link_ms - 0.1, f"sync_delay={delay}: {output}"


@pytest.mark.parametrize("mbit", [0, -100.0])
def test_the_simulated_link_refuses_a_bandwidth_of_nothing(mbit):
    with pytest.raises(ValueError, match=rf"^SlowSyncLink\(mbit={mbit}\) is invalid: expected a bandwidth in Mbit/s above 0\.$"):
        SlowSyncLink(mbit=mbit)
