"""benchmarks/forecast.py: the measured step of a run, the simulated link's gradient all-reduces, and the table, shrunk."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from benchmarks.forecast import SKIP_STEPS, ForecastBenchmarkConfig, cases, median_step_ms
from benchmarks.local_sgd_overlap import SlowLink
from tests.helpers.groups import one_rank_group
from tests.helpers.recipes import run_benchmark


def starts(periods: list[float]) -> list[float]:
    moments = [0.0]
    for period in periods:
        moments.append(moments[-1] + period)
    return moments


def test_data_parallelism_s_step_is_the_median_after_the_first_steps_less_validation():
    periods = [1.0] * SKIP_STEPS + [0.010, 0.012, 0.011, 0.500, 0.010]
    times = {"starts": starts(periods), "pauses": []}
    assert median_step_ms(times) == pytest.approx(11.0)
    # A validation of 0.49 s inside the long step: the step is what is left.
    moments = starts(periods)
    times["pauses"] = [[moments[SKIP_STEPS + 3] + 0.001, moments[SKIP_STEPS + 3] + 0.491]]
    assert median_step_ms(times) == pytest.approx(10.0)  # 10, 12, 11, 10, 10


def test_a_period_s_sync_is_spread_over_its_steps():
    # K=4: every 4th step ends with a 40 ms sync over 10 ms steps; one epoch's end (200 ms) among the local steps.
    periods = ([0.010, 0.010, 0.010, 0.050] * 5)[:-1] + [0.050]
    periods[9] = 0.200
    times = {"starts": starts(periods), "pauses": []}
    assert median_step_ms(times, 4) == pytest.approx(10.0 + 40.0 / 4)
    with pytest.raises(RuntimeError, match=r"too few to measure a period of 4"):
        median_step_ms({"starts": starts([0.01] * 6), "pauses": []}, 4)


def test_the_cases_the_default_config_runs():
    config = ForecastBenchmarkConfig()
    found = cases(config)
    full = [case for case in found if not case.contended]
    assert len(full) == len(config.recipes) * len(config.links_mbit) * 3  # two bucket sizes and DiLoCo per link
    contended = [case for case in found if case.contended]
    assert {case.ranks for case in contended} == {3, 4}
    assert len(contended) == len(config.recipes) * 2 * len(config.contended_links_mbit) * 2


def test_the_link_holds_a_gradient_all_reduce_until_it_has_carried_its_bytes():
    # The reducer reads a work's future (its observers time the bucket) and waits with the hang
    # watchdog's bounded slices: both see the link, not gloo's own completion.
    one_rank_group()
    link = SlowLink(mbit=8.0, world_size=2)  # 1 MB/s; a ring of 2 sends the whole payload per rank
    tensor = torch.zeros(25_000)  # 100 KB: 0.1 s on the link
    began = time.monotonic()
    work = link.all_reduce(tensor, async_op=True)
    done: list[float] = []
    work.get_future().add_done_callback(lambda _: done.append(time.monotonic()))
    assert work.get_future() is work.get_future()
    assert not work.is_completed()
    with pytest.raises(RuntimeError, match="the simulated link is still carrying this collective"):
        work.wait(timedelta(seconds=0.01))
    work.wait()
    assert time.monotonic() - began >= 0.1 and work.is_completed()
    deadline = time.monotonic() + 5
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done and done[0] - began >= 0.1
    # The next collective waits for the link to be free.
    second = link.all_reduce(tensor, async_op=True)
    assert not second.is_completed()
    second.wait()
    assert time.monotonic() - began >= 0.2
    assert dist.is_initialized()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_benchmark_prints_every_row_against_its_prediction(tmp_path):
    overrides = [
        "recipes=[digits]", "links_mbit=[0,100]", "contended_ranks=[3]", "contended_links_mbit=[100]", "local_steps=4",
        "digits=[trainer.max_epochs=2]", f"folder={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    output = run_benchmark("forecast", *overrides, timeout=850)
    row = re.compile(
        r"^\| digits \| (\d)( \(contended\))? \| (none|100 Mbit/s) \| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([-+][\d.]+)% \|",
        re.M,
    )
    rows = [match.groups() for match in row.finditer(output)]
    settings = {(ranks, link, setting) for ranks, _, link, setting, *_ in rows}
    assert settings == {
        *(("2", link, setting) for link in ("none", "100 Mbit/s") for setting in ("DP, 25 MB buckets", "DP, 0.02 MB buckets", "DiLoCo K=4")),
        ("3", "100 Mbit/s", "DP, 25 MB buckets"), ("3", "100 Mbit/s", "DiLoCo K=4"),
    }, output  # fmt: skip
    for *_, measured, predicted, error in rows:
        assert float(error) == pytest.approx((float(predicted) / float(measured) - 1) * 100, abs=0.06)
    assert re.search(r"^\d+ of 6 rows with a core per rank within 10%; mean \|error\| [\d.]+%$", output, re.M), output
