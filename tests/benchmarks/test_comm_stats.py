"""benchmarks/comm_stats.py: the recipe's step with the statistics on and off, in rounds, and its table."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from benchmarks.comm_stats import CommStatsBenchmarkConfig, report
from tests.helpers.recipes import run_benchmark


def test_each_round_runs_every_size_on_and_off_alternating_which_goes_first(tmp_path, monkeypatch):
    import benchmarks.comm_stats as benchmark

    config = CommStatsBenchmarkConfig(buckets=(25.0, 0.02), rounds=2)
    runs = []
    steps = {"on": 6.0, "off": 5.0}

    def run_case(recipe, overrides, folder):
        runs.append((folder.relative_to(tmp_path).as_posix(), overrides))
        folder.mkdir(parents=True)
        (folder / benchmark.TIMES_FILE).write_text(json.dumps({"kind": folder.name.rsplit("-", 1)[1]}))
        return 1.0

    monkeypatch.setattr(benchmark, "run_case", run_case)
    monkeypatch.setattr(benchmark, "median_step_ms", lambda times: steps[times["kind"]])
    rows = benchmark.run(config, tmp_path)
    assert [folder for folder, _ in runs] == [
        "round1/digits-25-on", "round1/digits-25-off", "round1/digits-0.02-on", "round1/digits-0.02-off",
        "round2/digits-25-off", "round2/digits-25-on", "round2/digits-0.02-off", "round2/digits-0.02-on",
    ]  # fmt: skip
    overrides = dict(runs)
    assert overrides["round1/digits-25-on"][:2] == ["strategy.comm_stats=true", "trainer.devices=2"]
    assert overrides["round1/digits-25-off"][-1] == "strategy.comm_buffer_size=25"  # 25 MB keeps the 1 MB last bucket
    assert overrides["round1/digits-0.02-off"][-2:] == ["strategy.comm_buffer_size=0.02", "strategy.last_comm_buffer_size=0.02"]
    assert rows == [{"size": 25.0, "on": [6.0, 6.0], "off": [5.0, 5.0]}, {"size": 0.02, "on": [6.0, 6.0], "off": [5.0, 5.0]}]
    with pytest.raises(ValueError, match=r"^rounds=0 is invalid: expected a number of rounds, at least 1\.$"):
        benchmark.run(dataclasses.replace(config, rounds=0), tmp_path)


def test_a_row_holds_the_medians_their_spread_and_the_median_ratio_of_the_rounds():
    rows = [{"size": 0.02, "on": [7.0, 6.0, 5.0], "off": [5.0, 6.0, 4.0]}]
    table = report(rows, CommStatsBenchmarkConfig(rounds=3))
    # Each round's ratio (1.4, 1.0, 1.25) and their median, not the ratio of the medians (6 / 5): a round's on
    # and off ran minutes apart, the rounds hours apart at worst.
    assert "| 0.02 | 6.00 | 5.00 to 7.00 | 5.00 | 4.00 to 6.00 | 1.250 |" in table.splitlines()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_benchmark_prints_a_row_per_bucket_size(tmp_path):
    overrides = ["buckets=[0.02]", "rounds=1", "overrides=['trainer.max_epochs=1']", f"hydra.run.dir={tmp_path}"]
    output = run_benchmark("comm_stats", *overrides, timeout=500)
    assert re.search(r"^\| 0\.02 \| [\d.]+ \| [\d.]+ to [\d.]+ \| [\d.]+ \| [\d.]+ to [\d.]+ \| \d\.\d{3} \|$", output, re.M), output
