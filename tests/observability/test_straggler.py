"""The straggler report: which rank lags, by how much and why, judged alike on every rank.

The verdict is a pure function of the ranks' timings, tested without processes; then two real
Gloo ranks in a hand-written loop (``lit_dp.DataParallel`` alone, no Lightning), with a fault
planted on rank 1: a slow loader, a slow step, or none.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

from lit_dp.observability.step_clock import StepTimes
from lit_dp.observability.straggler import ALARM_WINDOWS, LAG_MS, LAG_SHARE, Streak, judge, summarize
from tests.helpers.distributed import run_ranks


def times(data=1.0, compute=10.0, exposed=1.0, optimizer=1.0, steps=10, with_batch=10) -> StepTimes:
    step = data + compute + exposed + optimizer
    return StepTimes(0, steps - 1, steps, with_batch, data, compute, exposed, optimizer, step)


def test_the_rank_with_the_most_own_time_lags_by_its_excess_over_the_others_median():
    # Rank 2 waits 30 ms for data; the others wait for it in the collectives.
    report = judge([0, 1, 2], [times(exposed=31), times(exposed=32), times(data=31)])
    assert (report.slowest, report.cause, report.lagging) == (2, "data", True)
    assert report.lag_ms == pytest.approx(30.0)
    assert report.data_lag_ms == pytest.approx(30.0) and report.compute_lag_ms == pytest.approx(0.0)
    assert report.as_metrics()["straggler/slowest_rank"] == 2.0
    assert report.as_metrics()["straggler/others_exposed_ms"] == pytest.approx(31.5)
    assert re.match(r"rank 2 lags the others by 30\.0 ms per step \(7\d% of the 43\.\d ms step\): data", report.describe())


def test_the_cause_is_where_the_excess_went_compute_including_the_optimizer_step():
    report = judge([0, 1], [times(exposed=21), times(compute=25, optimizer=6)])
    assert (report.slowest, report.cause) == (1, "compute")
    assert report.compute_lag_ms == pytest.approx(20.0)


@pytest.mark.parametrize(
    "base, lag, lagging",
    [
        (10.0, 0.9 * LAG_MS, False),  # a large share of a short step, under the floor
        (100 * LAG_MS, 2 * LAG_MS, False),  # over the floor, a small share of a long step
        (10.0, 2 * LAG_MS, True),  # over both
    ],
)
def test_a_lag_counts_only_over_both_thresholds(base, lag, lagging):
    report = judge([0, 1], [times(compute=base, exposed=1.0 + lag), times(compute=base + lag)])
    assert report.slowest == 1 and report.lag_ms == pytest.approx(lag)
    assert report.lagging is lagging, (report.lag_ms, report.lag_share, LAG_SHARE)


def test_ranks_that_did_not_take_every_step_with_a_batch_are_not_compared():
    report = judge([0, 1], [times(), times(data=50, with_batch=7)])  # rank 1 ran out (Join, uneven inputs)
    assert report.slowest is None and not report.lagging and report.as_metrics() == {}
    report = judge([0, 1, 2], [times(), times(data=50, with_batch=7), times(compute=40)])
    assert report.slowest == 2


def test_the_line_is_due_once_the_same_rank_lagged_for_the_same_cause_several_windows_in_a_row():
    slow_1, slow_0 = judge([0, 1], [times(), times(data=50)]), judge([0, 1], [times(data=50), times()])
    busy_1 = judge([0, 1], [times(), times(compute=50)])
    healthy = judge([0, 1], [times(), times()])
    streak = Streak()
    seen = [streak.see(report) for report in [slow_1] * (ALARM_WINDOWS - 1) + [healthy] + [slow_1] * ALARM_WINDOWS]
    assert seen == [False] * (2 * ALARM_WINDOWS - 1) + [True]
    assert streak.see(slow_1) is False  # once per streak
    assert [streak.see(slow_0) for _ in range(ALARM_WINDOWS)] == [False] * (ALARM_WINDOWS - 1) + [True]  # another rank
    alternating = [slow_1, busy_1] * ALARM_WINDOWS  # noise: the same rank, but now data, now compute
    assert not any(streak.see(report) for report in alternating)


def test_the_runs_line_alarms_only_about_a_lag_and_a_run_too_short_gets_none():
    # Issue 47: "0 of 1 window ... the largest lag: rank 0, 1.8 ms per step (33% of the step)" read
    # as an alarm about nothing, and a short run ended with "no window completed".
    below = judge([0, 1], [times(), times(compute=11.8)])  # 1.8 ms: under the thresholds
    assert summarize(0, 0, None, 10) is None
    assert summarize(1, 0, below, 10) == "no rank lagged in 1 window of 10 steps"
    assert summarize(6, 0, below, 10) == "no rank lagged in 6 windows of 10 steps"
    assert summarize(3, 0, below, 1) == "no rank lagged in 3 windows of 1 step"
    slow = judge([0, 1], [times(exposed=51), times(data=51)])
    assert summarize(6, 2, slow, 10) == (
        "2 of 6 windows of 10 steps had a rank lagging; the largest lag: rank 1, 50.0 ms per step "
        "(79% of the step, data) in the window ending at step 9"
    )


EVERY = 4
STEPS = 20
DELAY = 0.04


def hand_written_loop(rank: int) -> dict:
    """One healthy run and one per fault on rank 1, each with a fresh wrapper; what each reported."""
    import io
    from contextlib import redirect_stdout

    import lit_dp

    lit_dp.init_parallel_env()
    results = {}
    for fault in ("none", "loader", "step"):
        torch.manual_seed(0)
        model = lit_dp.DataParallel(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)), straggler_every_n_steps=EVERY)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        printed = io.StringIO()
        with redirect_stdout(printed):
            for _ in range(STEPS):
                if fault == "loader" and rank == 1:
                    time.sleep(DELAY)  # the next batch takes this long to arrive
                loss = model(torch.randn(16, 8)).square().mean()
                if fault == "step" and rank == 1:
                    time.sleep(DELAY)  # a slow step: between the forward and the backward
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        report = model.straggler
        results[fault] = {
            "printed": printed.getvalue(),
            "windows": report.windows,
            "alarms": report.alarms,
            "last": (report.last.slowest, report.last.cause, report.last.lagging),
            "summary": report.summary(),
        }
    return results


def test_a_slow_loader_and_a_slow_step_on_one_rank_are_named_with_their_cause_and_a_healthy_run_is_not():
    results = run_ranks(hand_written_loop, 2, timeout=120)
    assert results[0]["none"]["windows"] == results[1]["none"]["windows"] == STEPS // EVERY - 1  # step 0 is left out
    for rank in (0, 1):  # every rank judges alike; only rank 0 prints
        assert results[rank]["loader"]["last"] == (1, "data", True)
        assert results[rank]["step"]["last"] == (1, "compute", True)
    # No line without a fault (a single window over the thresholds may happen on a loaded machine).
    assert results[0]["none"]["alarms"] == results[1]["none"]["alarms"] == 0 and results[0]["none"]["printed"] == ""
    for fault, cause in (("loader", "data"), ("step", "compute")):
        printed = results[0][fault]["printed"]
        assert re.search(
            rf"^\[lit_dp\] straggler: rank 1 lags the others by (\d+\.\d) ms per step \(\d+% of the [\d.]+ ms step\): "
            rf"{cause} .*; {ALARM_WINDOWS} windows of {EVERY} steps in a row \(steps 1-{ALARM_WINDOWS * EVERY - 1}\)$",
            printed,
            re.MULTILINE,
        ), printed
        lag = float(re.search(r"by (\d+\.\d) ms", printed).group(1))
        assert DELAY * 1e3 * 0.8 < lag < DELAY * 1e3 * 2.5, printed  # the lag planted, not the whole step
        assert results[1][fault]["printed"] == ""
