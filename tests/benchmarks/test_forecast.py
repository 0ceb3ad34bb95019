"""benchmarks/forecast.py: the measured step of a run, the simulated link's gradient all-reduces, and the table, shrunk."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from benchmarks.forecast import SKIP_STEPS, Case, ForecastBenchmarkConfig, cases, median_step_ms, report
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


def test_a_link_future_that_is_only_looked_at_completes_on_the_clock_with_no_thread_of_its_own():
    # On CPU the reducer's observers poll each bucket's future. A real link's future runs no Python
    # on another thread; a simulated one that did (a timer thread per bucket, started from a
    # callback on Gloo's thread) took the interpreter from the training thread during backward.
    one_rank_group()
    link = SlowLink(mbit=8.0, world_size=2)
    tensor = torch.ones(25_000)  # 100 KB: 0.1 s on the link
    threads = threading.active_count()
    began = time.monotonic()
    future = link.all_reduce(tensor, async_op=True).get_future()
    while not future.done():
        assert threading.active_count() == threads
        time.sleep(0.005)
    assert time.monotonic() - began >= 0.1
    assert torch.equal(future.value()[0], torch.ones(25_000))
    assert future.wait() is future.value()
    # A callback still runs once the link has carried the collective.
    second = link.all_reduce(tensor, async_op=True).get_future()
    chained = second.then(lambda done: time.monotonic())
    assert chained.wait() - began >= 0.2 and second.done()


def test_the_link_s_latency_is_paid_per_hop_of_the_ring_before_its_bytes():
    # Two ranks: an all-reduce goes round the ring twice, one hop each; an all-gather once.
    one_rank_group()
    link = SlowLink(mbit=8000.0, world_size=2, latency_s=0.05)  # 1 GB/s: 4 bytes take nothing
    tensor = torch.zeros(1)
    began = time.monotonic()
    link.all_reduce(tensor, async_op=True).wait()
    assert time.monotonic() - began >= 2 * 0.05
    began = time.monotonic()
    link.all_gather_into_tensor(torch.zeros(1), tensor, async_op=True).wait()
    assert 0.05 <= time.monotonic() - began < 2 * 0.05


def test_the_forecast_is_told_the_simulated_link_and_the_recipe_run_gets_it(tmp_path, monkeypatch):
    import benchmarks.forecast as benchmark

    config = ForecastBenchmarkConfig(link_latency_us=80.0)
    linked = Case("digits", 2, 100.0, "dp 25", False)
    assert "+callbacks.slow_link.latency_us=80" in benchmark._overrides(linked, config)
    told = []

    def predict(base, **link):
        told.append({name: link.get(name) for name in ("bandwidth", "latency")})
        raise LookupError  # what was told is all this test reads

    for case in (linked, Case("digits", 2, 0.0, "dp 25", False)):
        with pytest.raises(LookupError):
            benchmark._predicted(predict, tmp_path, case, config)
    assert told == [{"bandwidth": "100Mbit", "latency": "80us"}, {"bandwidth": None, "latency": None}]


def test_the_table_has_every_row_and_beside_a_contended_one_the_forecast_from_fewer_ranks():
    config = ForecastBenchmarkConfig(recipes=("digits",), links_mbit=(100.0,), contended_ranks=(3,))
    rows = [
        {"case": Case("digits", 2, 100.0, "dp 25", False), "measured": 20.0, "predicted": 21.0, "own": 19.0},
        {"case": Case("digits", 2, 100.0, "diloco", False), "measured": 10.0, "predicted": 8.0},
        {"case": Case("digits", 3, 100.0, "dp 25", True), "measured": 30.0, "predicted": 27.0, "from_base": 21.0},
    ]
    for row, loads, spread in zip(rows, [(3.5, 2.0), (3.0, 2.0), (4.0, 5.0)], [(19.0, 22.8), (9.5, 10.5), (30.0, 30.0)]):
        row["load"], row["base_load"] = loads
        row["spread"] = spread
    lines = report(rows, config).splitlines()
    own = "| digits | 2 | 100 Mbit/s | DP, 25 MB buckets | 20.00 | 19.00 to 22.80 | 21.00 | +5.0% | 19.00 | -5.0% |  |  | 3.5, 2.0 |"
    assert own in lines
    diloco = "| digits | 2 | 100 Mbit/s | DiLoCo K=16 | 10.00 | 9.50 to 10.50 | 8.00 | -20.0% |  |  |  |  | 3.0, 2.0 |"
    assert diloco in lines
    contended = "| 30.00 | 30.00 to 30.00 | 27.00 | -10.0% |  |  | 21.00 | -30.0% | 4.0, 5.0 |"
    assert f"| digits | 3 (contended) | 100 Mbit/s | DP, 25 MB buckets {contended}" in lines
    # The spread's median over the rows with a core per rank: 22.8/19 and 10.5/9.5, 20% and 10.5%.
    assert lines[-1] == (
        "A core per rank: 1 of 2 within 10%, mean |error| 12.5% from the base run; data parallelism from its own run: "
        "1 of 1 within 10%, mean |error| 5.0%; the slowest round measured 15.3% over the fastest (the rows' median)"
    )


def test_rows_are_the_medians_over_the_rounds_of_their_own_and_their_base_run(tmp_path, monkeypatch):
    # Three rounds, each its own runs (a base and the case) in its own folder; the row takes each
    # figure's median, and the fastest and slowest measurement.
    import benchmarks.forecast as benchmark

    config = ForecastBenchmarkConfig(recipes=("digits",), links_mbit=(100.0,), contended_ranks=(), digits_buckets=(25.0,), rounds=3)
    measured = {"round1": 10.0, "round2": 14.0, "round3": 11.0}
    predicted = {"round1": 12.0, "round2": 9.0, "round3": 10.0}
    folders = []

    def run_case(recipe, overrides, folder):  # a run's step times, named by its round
        folders.append(folder.relative_to(tmp_path).as_posix())
        folder.mkdir(parents=True)
        (folder / benchmark.TIMES_FILE).write_text(json.dumps({"round": folder.parent.name}))
        return 1.0

    monkeypatch.setattr(benchmark, "run_case", run_case)
    monkeypatch.setattr(benchmark, "median_step_ms", lambda times, window: measured[times["round"]])
    monkeypatch.setattr(benchmark, "_predicted", lambda predict, base, case, config: predicted[base.parent.name])
    rows = benchmark.run(config, tmp_path)
    assert folders[:3] == ["round1/base-digits-2-0-dp25", "round1/digits-2-100-dp25", "round1/digits-2-100-diloco"]
    assert len(folders) == 9 and folders[-1] == "round3/digits-2-100-diloco"
    assert [row["case"].setting for row in rows] == ["dp 25", "diloco"]
    assert rows[0]["measured"] == 11.0 and rows[0]["spread"] == (10.0, 14.0)
    assert rows[0]["predicted"] == 10.0 and rows[0]["own"] == 10.0 and "from_base" not in rows[0]
    with pytest.raises(ValueError, match=r"^rounds=0 is invalid: expected a number of rounds, at least 1\.$"):
        dataclasses.replace(config, rounds=0)


def test_a_negative_link_latency_is_refused_naming_the_option_before_any_run():
    expected = r"^link_latency_us=-5\.0 is invalid: expected the simulated link's latency per hop in microseconds, 0 or more\.$"
    with pytest.raises(ValueError, match=expected):
        ForecastBenchmarkConfig(link_latency_us=-5.0)
    assert ForecastBenchmarkConfig(link_latency_us=0).link_latency_us == 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_benchmark_prints_every_row_against_its_prediction(tmp_path):
    # Three recipe runs: the base, then data parallelism and DiLoCo K=4 over a 100 Mbit/s link.
    overrides = [
        "recipes=[digits]", "links_mbit=[100]", "contended_ranks=[]", "local_steps=4", "digits_buckets=[25]", "rounds=1",
        "digits=['trainer.max_epochs=2']", f"folder={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    output = run_benchmark("forecast", *overrides, timeout=1100)
    row = re.compile(r"^\| digits \| 2 \| 100 Mbit/s \| (.+?) \| ([\d.]+) \| [\d.]+ to [\d.]+ \| ([\d.]+) \| ([-+][\d.]+)% \|", re.M)
    rows = {match.group(1): [float(value) for value in match.groups()[1:]] for match in row.finditer(output)}
    assert set(rows) == {"DP, 25 MB buckets", "DiLoCo K=4"}, output
    for measured, predicted, error in rows.values():
        # The error comes from the unrounded times; each printed time may be 0.005 off, the error 0.05.
        rounding = 100 * (0.005 / measured + 0.005 * predicted / measured**2) + 0.05
        assert error == pytest.approx((predicted / measured - 1) * 100, abs=rounding)
    summary = r"^A core per rank: \d of 2 within 10%, mean \|error\| [\d.]+% from the base run; data parallelism from its own run: "
    assert re.search(summary + r"\d of 1 within 10%", output, re.M), output
    assert sorted(path.name for path in (tmp_path / "runs" / "round1").iterdir()) == [
        "base-digits-2-0-dp25", "digits-2-100-diloco", "digits-2-100-dp25",
    ]  # fmt: skip
