"""``strategy.forecast.ranks``: the end-of-run forecast, one line per setting, and the profile each rank leaves."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lit_dp.forecast.model import DILOCO_QUALITY
from lit_dp.observability.link_probe import PROBE_BYTES
from lit_dp.observability.profile import Profile
from lit_dp.observability.resume_probe import IDLE_MS
from lit_dp.options import Options
from lit_dp.strategies.monitoring import forecast_lines
from tests.forecast.test_command import forecast
from tests.helpers.recipes import QUIET, run_recipe

RUN = Path(__file__).parent / "recorded_run"
PROFILE = RUN / "csv" / "version_0" / "lit_dp_profile.rank0.json"


def test_the_lines_at_the_ranks_and_links_asked():
    options = Options.build({"forecast_ranks": [8, 64], "forecast_bandwidths": ["10Gbit"]}, "trainer").forecast
    lines = forecast_lines(Profile.read(PROFILE), options, "outputs/digits/run")
    assert lines[0].startswith("[lit_dp] forecast: from the run: 2 gloo ranks on cpu, rank 0's last ")
    setting = re.compile(
        r"^\[lit_dp\] forecast (.+?)( \*)?: 8 ranks ([\d.]+) ms \(x[\d.]+\), 64 ranks ([\d.]+) ms \(x[\d.]+\) per step$"
    )
    settings = [setting.match(line) for line in lines[1:-2]]
    assert all(settings), lines
    names = [match.group(1) for match in settings]
    assert names[0].startswith("data parallelism, the run's buckets") and "ZeRO-1 (sharding.stage=1)" in names
    assert "DiLoCo K=16, syncs in bf16" in names
    assert all(bool(match.group(2)) == ("DiLoCo" in name or "LocalSGD" in name) for match, name in zip(settings, names))
    assert lines[-2].startswith("[lit_dp] forecast: fastest at 64 ranks over 10 Gbit/s: ")
    assert (
        lines[-1] == f"[lit_dp] forecast: * {DILOCO_QUALITY}; the table: python -m lit_dp.forecast outputs/digits/run"
    )


def test_over_the_run_s_own_link_without_bandwidths():
    options = Options.build({"forecast_ranks": [4]}, "trainer").forecast
    lines = forecast_lines(Profile.read(PROFILE), options, None)
    assert lines[-2].startswith("[lit_dp] forecast: fastest at 4 ranks over the run's own link: ")
    assert lines[-1] == f"[lit_dp] forecast: * {DILOCO_QUALITY}"


def test_a_run_that_synchronised_no_step_says_so_in_one_line():
    options = Options.build({"forecast_ranks": [8]}, "trainer").forecast
    empty = dataclasses.replace(Profile.read(PROFILE), steps=())
    [line] = forecast_lines(empty, options, None)
    assert line.startswith("[lit_dp] forecast: none: the profile of rank 0 holds no synchronised step")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_recipe_run_ends_with_the_forecast_and_leaves_every_rank_s_profile(tmp_path):
    run = tmp_path / "run"
    output = run_recipe(
        "digits", *QUIET, "trainer.max_epochs=1", "trainer.limit_train_batches=12", "trainer.limit_val_batches=1",
        "strategy.forecast.ranks=[8,64]", "strategy.forecast.bandwidths=[10Gbit]", f"hydra.run.dir={run}", timeout=500,
    )  # fmt: skip
    assert re.search(
        r"^\[lit_dp\] forecast DiLoCo K=16, syncs in fp32 \*: 8 ranks [\d.]+ ms \(x[\d.]+\), 64 ranks", output, re.M
    ), output
    assert re.search(r"^\[lit_dp\] forecast: fastest at 64 ranks over 10 Gbit/s: ", output, re.M), output
    profiles = sorted(run.glob("csv/version_0/lit_dp_profile.rank*.json"))
    assert [path.name for path in profiles] == ["lit_dp_profile.rank0.json", "lit_dp_profile.rank1.json"]
    assert {Profile.read(path).rank for path in profiles} == {0, 1}
    for path in profiles:  # each rank timed the link and its host's resume when training ended, for the forecast
        assert Profile.read(path).extra["link_probe"]["bytes"] == list(PROBE_BYTES), path
        assert Profile.read(path).extra["resume_probe"]["idle_ms"] == list(IDLE_MS), path
    table = forecast(str(run), "--ranks", "8")
    assert table.returncode == 0 and "\nfastest: " in table.stdout, table.stderr
    assert "resume after a wait was not probed" not in table.stdout
    probed = ", ".join(f"{nbytes / 2**20:g}" for nbytes in PROBE_BYTES)  # 0.03125, ..., 8
    assert f"the run's link: fitted to all-reduces of {probed} MB timed when the run ended" in table.stdout
