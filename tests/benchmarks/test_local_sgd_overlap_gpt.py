"""benchmarks/local_sgd_overlap_gpt.py, shrunk: the GPT recipe runs on the simulated link at every delay, and each is reported."""

from __future__ import annotations

import re

import pytest

from benchmarks.local_sgd_overlap import SlowSyncLink
from tests.benchmarks.test_local_sgd_gpt import TINY
from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(1200)  # four recipe runs of 2 ranks on a loaded 2-core machine
def test_overlap_gpt_benchmark_reports_every_delay_and_format(tmp_path):
    overrides = [
        "local_steps=4", "fragments=2", "delays=[0,1]", "sync_dtypes=[fp32,int4]", "max_steps=8", "link_mbit=50",
        f"extra={TINY}",
    ]  # fmt: skip
    output = run_benchmark("local_sgd_overlap_gpt", *overrides, f"hydra.run.dir={tmp_path}", timeout=1100)
    assert "a 50 Mbit/s link for the syncs" in output, output
    row = re.compile(
        r"^\| (fp32|int4) \| (\d) \| ([\d.]+) \| [^|]* \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", re.M
    )
    rows = {(m.group(1), int(m.group(2))): [float(value) for value in m.groups()[2:]] for m in row.finditer(output)}
    assert set(rows) == {("fp32", 0), ("fp32", 1), ("int4", 0), ("int4", 1)}, output
    # Fragment syncs every K/F = 2 steps, counted before the fit's final one: 4 at tau 0, the last
    # one still in flight at tau 1 (applied by the fit's end, after the recipe's summary).
    assert [rows[mode][1] for mode in sorted(rows)] == [4, 3, 4, 3], output
    for mode, (_, _, link_ms, in_flight_ms, _, _) in rows.items():
        # The link was in the way: no sync completes before the link has carried its bytes (int4's all-to-all
        # and all-gather too).
        assert in_flight_ms >= link_ms - 0.1, f"{mode}: {output}"
    # int4 carries about 0.13 of fp32's bytes (scales included; the tiny model's fragments pad to whole blocks).
    assert 0.1 < rows[("int4", 0)][2] / rows[("fp32", 0)][2] < 0.3, output
    # Delayed, a wire format's exchange of chunks still blocks the sync's start: half its bytes, counted exposed
    # (the link's time is computed from MB printed to 3 decimals: hence 0.4, not 0.5).
    assert rows[("int4", 1)][4] >= 0.4 * rows[("int4", 1)][2], output


@pytest.mark.parametrize("mbit", [0, -100.0])
def test_the_simulated_link_refuses_a_bandwidth_of_nothing(mbit):
    with pytest.raises(ValueError, match=rf"^SlowSyncLink\(mbit={mbit}\) is invalid: expected a bandwidth in Mbit/s above 0\.$"):
        SlowSyncLink(mbit=mbit)


def test_the_simulated_link_refuses_a_negative_latency():
    with pytest.raises(ValueError, match=r"^SlowSyncLink\(latency_us=-5\.0\) is invalid: expected microseconds per hop, 0 or more\.$"):
        SlowSyncLink(mbit=100.0, latency_us=-5.0)
