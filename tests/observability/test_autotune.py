"""``comm_buffer_size="auto"``: the choice on 2 real ranks, the schedule's length, the score."""

from __future__ import annotations

import pytest

from lit_dp.observability.autotune import CANDIDATES_MB, MEASURE_STEPS, MIN_PASSES, TUNING_STEPS, WARMUP_STEPS
from lit_dp.observability.autotune import _trimmed_mean, settled_step
from tests.helpers.observability import KB, MAX_TUNING_STEPS, PREFERRED


def test_autotune_picks_the_size_the_slowest_rank_runs_fastest_with(two_ranks):
    results, _ = two_ranks
    # Autotune: the same choice everywhere, the preferred one, reached within the schedule.
    first, second = results[0], results[1]
    assert first["chosen"] == second["chosen"] == PREFERRED
    assert first["sweep"] == second["sweep"] and sorted(first["sweep"]) == [4 * KB, 20 * KB, 40 * KB]
    assert first["tuned_buckets"] == second["tuned_buckets"] == first["preferred_buckets"]
    assert first["steps"] == 1 + first["tuning_steps"] + 1  # step 0, the windows, the deciding step
    assert first["tuning_steps"] == MAX_TUNING_STEPS


def test_the_score_drops_the_fastest_and_slowest_eighth():
    steps = [10.0] * 14 + [1.0, 100.0]  # one lucky and one disturbed step among 16
    assert _trimmed_mean(steps) == pytest.approx(10.0)
    assert _trimmed_mean([3.0, 5.0]) == pytest.approx(4.0)  # too few to trim


def test_buckets_settle_after_the_whole_schedule():
    window = WARMUP_STEPS + MEASURE_STEPS
    assert settled_step() == 1 + max(TUNING_STEPS, MIN_PASSES * len(CANDIDATES_MB) * window)
