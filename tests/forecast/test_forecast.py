"""lit_dp.forecast's API and cost model on a recorded run folder (tests/forecast/recorded_run).

The folder is what a recipe run left (``python recipes/digits.py trainer.max_epochs=2
strategy.comm_buffer_size=0.02 strategy.last_comm_buffer_size=0.02``: 2 gloo ranks, the digits MLP's
0.1 MB of gradients in 3 buckets), its profiles cut to their last 31 steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import lit_dp.forecast.model
from lit_dp.forecast import (
    Forecast,
    Link,
    NoRunError,
    Prediction,
    end_of_run_lines,
    load_profiles,
    measure,
    predict,
    table,
    wire_bits,
)
from lit_dp.forecast.model import DILOCO_QUALITY
from lit_dp.forecast.report import options_to_type
from lit_dp.forecast.run import ResumeCost, _spread
from lit_dp.observability.profile import Profile

RUN = Path(__file__).parent / "recorded_run"
MB = 2**20


@pytest.fixture(scope="module")
def measured():
    return measure(load_profiles(RUN))


def rows_of(forecast: Forecast, scenario: int = 0) -> dict[str, Prediction]:
    return {row.setting: row for row in forecast.scenarios[scenario].rows}


def test_the_run_is_measured_from_its_slowest_rank(measured):
    profiles = load_profiles(RUN)
    assert sorted(profile.rank for profile in profiles) == [0, 1]
    each = [measure(profile) for profile in profiles]
    assert measured.rank == max(each, key=lambda m: m.compute_ms).rank
    assert (measured.ranks, measured.backend, measured.device) == (2, "gloo", "cpu")
    assert measured.model_bytes == sum(profiles[0].parameter_bytes)
    assert len(measured.bucket_sizes) == 3
    sample = measured.samples[0]
    # Parameters in ready order, each ready no earlier than the one before; a bucket's last at its ready moment.
    assert list(sample.parameter_ready_ms) == sorted(sample.parameter_ready_ms)
    assert measured.compute_ms < measured.period_ms


def test_at_its_own_ranks_and_link_the_run_is_predicted_as_measured(measured):
    # Every sample re-timed with the run's own buckets, launches and link gives back its own step:
    # the model adds nothing of its own where nothing changes.
    forecast = predict(measured)
    own = forecast.scenarios[0].rows[0]
    assert own.setting.startswith("data parallelism, the run's buckets (3 of")
    assert own.options == {} and own.ranks == 2 and forecast.scenarios[0].link.measured
    assert own.step_ms == pytest.approx(measured.period_ms, rel=1e-6)


def test_every_setting_is_a_typed_row_with_the_options_to_type(measured):
    forecast = predict(RUN, ranks=[8, 64], bandwidth="10Gbit", latency="20us", bucket_sizes=[5], local_steps=[32])
    assert [(s.ranks, s.link.bandwidth) for s in forecast.scenarios] == [(8, 1.25e9), (64, 1.25e9)]
    assert all(s.link.latency == pytest.approx(20e-6) for s in forecast.scenarios)
    rows = rows_of(forecast)
    expected = {
        "data parallelism, buckets of 5 MB": {"comm_buffer_size": 5.0},
        "ZeRO-1 (sharding.stage=1)": {"sharding.stage": 1},
        "ZeRO-2 (sharding.stage=2)": {"sharding.stage": 2},
        "LocalSGD, averaging every 4 steps": {"local_sgd.steps": 4},
        "DiLoCo K=16, syncs in fp32": {"local_sgd.steps": 16, "local_sgd.outer": "nesterov"},
        "DiLoCo K=32, syncs in bf16": {"local_sgd.steps": 32, "local_sgd.outer": "nesterov", "local_sgd.sync_dtype": "bf16"},
        "DiLoCo K=16, 4 fragments, sync_delay=1, syncs in fp32": {
            "local_sgd.steps": 16, "local_sgd.outer": "nesterov", "local_sgd.fragments": 4, "local_sgd.sync_delay": 1,
        },
        "data parallelism, 0.25 MB, gradients in bf16": {"comm_buffer_size": 0.25, "comm_dtype": "bf16"},
    }  # fmt: skip
    for setting, options in expected.items():
        assert rows[setting].options == options, setting
    for row in rows.values():
        assert row.step_ms >= row.compute_ms > 0 and row.exposed_ms >= 0 and row.cost == row.step_ms / row.compute_ms
        assert row.exact == (
            row.setting.startswith("data parallelism") and "gradients in" not in row.setting or "ZeRO" in row.setting
        )
        assert (row.note == DILOCO_QUALITY) == ("LocalSGD" in row.setting or "DiLoCo" in row.setting)


def test_bytes_per_rank_follow_the_ring_the_period_and_the_dtype(measured):
    rows = rows_of(predict(measured, ranks=8, bandwidth="10Gbit"))
    ring = 2 * 7 / 8 * measured.model_bytes
    assert rows["data parallelism, buckets of 0.25 MB (the best)"].bytes_per_step == pytest.approx(ring)
    assert rows["data parallelism, 0.25 MB, gradients in fp16"].bytes_per_step == pytest.approx(ring / 2)
    assert rows["LocalSGD, averaging every 4 steps"].bytes_per_step == pytest.approx(ring / 4)
    assert rows["DiLoCo K=64, syncs in bf16"].bytes_per_step == pytest.approx(ring / 64 / 2)
    # ZeRO-1 all-reduces the gradients and gathers the parameters; ZeRO-2 reduce-scatters them instead.
    assert rows["ZeRO-1 (sharding.stage=1)"].bytes_per_step == pytest.approx(ring + 7 / 8 * measured.model_bytes)
    assert rows["ZeRO-2 (sharding.stage=2)"].bytes_per_step == pytest.approx(ring)


def test_a_slower_link_and_more_ranks_cost_data_parallelism_more(measured):
    def step(ranks: int, bandwidth: str) -> float:
        return rows_of(predict(measured, ranks=ranks, bandwidth=bandwidth))[
            "data parallelism, buckets of 25 MB"
        ].step_ms

    forecast = predict(measured, ranks=[8], bandwidth=["100Gbit", "100Mbit"], bucket_sizes=[25])
    fast, slow = (rows_of(forecast, i)["data parallelism, buckets of 25 MB"] for i in (0, 1))
    assert slow.step_ms > fast.step_ms and slow.exposed_ms > fast.exposed_ms
    # At 100 Mbit/s the link dominates: 2(N-1)/N of 0.1 MB is ~15 ms at 8 ranks, which no backward of
    # a fraction of a ms hides.
    link_ms = 2 * 7 / 8 * measured.model_bytes / (100e6 / 8) * 1e3
    assert slow.exposed_ms == pytest.approx(link_ms, rel=0.1)
    assert (
        rows_of(predict(measured, ranks=64, bandwidth="100Mbit", bucket_sizes=[25]))[
            "data parallelism, buckets of 25 MB"
        ].step_ms
        > slow.step_ms
    )
    # Syncing every K steps costs a K-th of a sync per step: DiLoCo gains on a slow link.
    diloco = rows_of(forecast, 1)["DiLoCo K=64, syncs in fp32"]
    assert diloco.step_ms < slow.step_ms


def test_a_step_whose_collectives_the_host_delayed_stays_as_delayed_over_another_link(measured):
    # Of three steps alike, the run's host delayed one's first collective by DELAY and another's rest
    # by as much: two of its three steps took DELAY longer. Over a told link the delayed collective
    # keeps its delay (the host's, not the link's), so the median step is still about DELAY longer
    # than with three undelayed collectives (less what a gap on the link before a later bucket absorbs).
    DELAY = 1.0
    sample = measured.samples[0]
    delayed_link = dataclasses.replace(sample, link_ms=(sample.link_ms[0] + DELAY, *sample.link_ms[1:]))
    delayed_rest = dataclasses.replace(sample, rest_ms=sample.rest_ms + DELAY)

    def step(*samples) -> float:  # data parallelism with the run's buckets
        return predict(dataclasses.replace(measured, samples=samples), bandwidth="100Mbit").scenarios[0].rows[0].step_ms

    assert step(sample, delayed_link, delayed_rest) > step(sample, sample, delayed_rest) + 0.8 * DELAY


def test_over_the_run_s_own_link_a_bucket_seen_done_only_during_backward_gives_no_pace(measured):
    # The first bucket's time on the link, 5 ms longer in every step: as a measured time it slows the
    # link's pace of every bucket of a forecast of other buckets; as a bound (seen done at a look during
    # backward) it is left out of the pace. With every bucket's a bound, the buckets go at the probe's line.
    SLOWER = 5.0
    ONE_BUCKET = "data parallelism, buckets of 25 MB"

    def step(link_bounded: tuple[bool, ...], slower: float) -> float:
        samples = tuple(
            dataclasses.replace(s, link_ms=(s.link_ms[0] + slower, *s.link_ms[1:]), link_bounded=link_bounded)
            for s in measured.samples
        )
        return rows_of(predict(dataclasses.replace(measured, samples=samples), bucket_sizes=(25,)))[ONE_BUCKET].step_ms

    assert len(measured.bucket_sizes) == 3 and not any(measured.samples[0].link_bounded)
    measured_first, bounded_first = (False, False, False), (True, False, False)
    assert step(measured_first, SLOWER) > step(measured_first, 0.0) + 1.0
    assert step(bounded_first, SLOWER) == pytest.approx(step(bounded_first, 0.0), rel=1e-9)
    all_bounded = (True, True, True)
    assert step(all_bounded, SLOWER) == pytest.approx(step(all_bounded, 0.0), rel=1e-9)


def test_the_resume_cost_is_linear_between_the_probed_waits():
    cost = ResumeCost(idle_ms=(1.0, 4.0), extra_ms=(0.2, 1.4))
    assert cost.probed and cost.after(0.0) == 0.0 and cost.after(-1.0) == 0.0  # no wait costs nothing
    assert cost.after(0.5) == pytest.approx(0.1) and cost.after(1.0) == pytest.approx(0.2)
    assert cost.after(2.5) == pytest.approx(0.8)
    assert cost.after(100.0) == pytest.approx(1.4)  # beyond the longest wait probed: the longest's
    assert not ResumeCost().probed and ResumeCost().after(5.0) == 0.0


DILOCO = "DiLoCo K=16, syncs in fp32"


def test_a_local_step_waits_for_no_link_and_drops_the_resume_after_the_run_s_wait(measured):
    # Every step of the run waited 2 ms; any wait of 1 ms or more adds RESUME ms to the host work
    # after it. Data parallelism over a slower link still waits more than 1 ms: its step keeps the
    # run's resume. A DiLoCo step waits for nothing but every 16th step's sync: it has RESUME less,
    # but for a 16th of the sync's.
    RESUME = 0.7
    waited = dataclasses.replace(measured, samples=tuple(dataclasses.replace(s, idle_ms=2.0) for s in measured.samples))
    unprobed = rows_of(predict(waited, bandwidth="100Mbit"))
    probed_rows = rows_of(predict(dataclasses.replace(waited, resume=ResumeCost((1.0,), (RESUME,))), bandwidth="100Mbit"))
    run_s = next(name for name in unprobed if name.startswith("data parallelism, the run's buckets"))
    assert probed_rows[run_s].step_ms == pytest.approx(unprobed[run_s].step_ms, rel=1e-9)
    assert probed_rows[DILOCO].step_ms == pytest.approx(unprobed[DILOCO].step_ms - RESUME + RESUME / 16, rel=1e-9)


def test_a_local_step_runs_no_reducer_and_drops_its_host_work(measured):
    # The reducer's own host work, 0.5 ms a step in the run: data parallelism keeps it, a local step
    # of LocalSGD and DiLoCo does not do it (with sync_delay an inner step also overlaps less of the sync).
    HOST_WORK = 0.5
    assert not measured.host_work_timed  # the recorded run predates the timing
    timed = dataclasses.replace(
        measured,
        samples=tuple(dataclasses.replace(s, host_work_ms=HOST_WORK) for s in measured.samples),
        host_work_timed=True,
    )
    assert min(sample.compute_ms for sample in measured.samples) > HOST_WORK
    before, after = rows_of(predict(measured, ranks=[8])), rows_of(predict(timed, ranks=[8]))
    for setting, row in after.items():
        if "local_sgd.sync_delay" in row.options:
            assert before[setting].step_ms - HOST_WORK <= row.step_ms < before[setting].step_ms, setting
        elif "local_sgd.steps" in row.options:
            assert row.step_ms == pytest.approx(before[setting].step_ms - HOST_WORK, rel=1e-9), setting
        else:
            assert row.step_ms == pytest.approx(before[setting].step_ms, rel=1e-9), setting
    note = "the reducer's own host work was not timed"
    assert any(line.startswith(note) for line in predict(measured).notes)
    assert not any(line.startswith(note) for line in predict(timed).notes)


def test_gradients_are_placed_between_buckets_as_the_run_timed_them_or_else_by_their_bytes():
    # Two buckets, ready at 4 and 10 ms: parameter 2, then 1 and 0 (ready order), of 2, 1 and 1 bytes.
    buckets, parameter_bytes, ready = [(2,), (1, 0)], [1, 1, 2], [4.0, 10.0]
    assert _spread(buckets, parameter_bytes, ready) == [4.0, 7.0, 10.0]  # by bytes
    # The run's medians: parameter 1 ready right after parameter 2, parameter 0 much later.
    timed = _spread(buckets, parameter_bytes, ready, shape=[9.0, 2.5, 2.0])
    assert timed == pytest.approx([4.0, 4.0 + 6.0 * 0.5 / 7.0, 10.0])
    # A member the run never timed: that bucket falls back to the bytes.
    assert _spread(buckets, parameter_bytes, ready, shape=[None, 2.5, 2.0]) == [4.0, 7.0, 10.0]


def test_a_longer_wait_for_the_link_costs_the_host_work_after_it_more(measured):
    # The probe: 9.9 ms more after 100 ms idle, nothing after 1 ms. Over 10 Mbit/s the recorded run's
    # 0.1 MB takes about 80 ms a step, where the run waited at most 10.5 ms: the step pays the
    # difference. Over the run's own link, as it ran, the step stays the one measured.
    slow = dataclasses.replace(measured, resume=ResumeCost((1.0, 100.0), (0.0, 9.9)))
    assert max(sample.idle_ms for sample in measured.samples) < 11.0
    before = predict(measured, bandwidth="10Mbit").scenarios[0].rows[0].step_ms
    after = predict(slow, bandwidth="10Mbit").scenarios[0].rows[0].step_ms
    assert 5.0 < after - before < 9.9
    assert predict(slow).scenarios[0].rows[0].step_ms == pytest.approx(measured.period_ms, rel=1e-6)


def test_without_a_resume_probe_the_forecast_says_the_host_work_is_kept_as_measured(measured):
    note = "the host's resume after a wait was not probed: each step's host work is kept as the run measured it"
    assert note in predict(measured).notes
    assert note not in predict(dataclasses.replace(measured, resume=ResumeCost((1.0,), (0.1,)))).notes


def test_the_fastest_setting_and_the_fastest_with_data_parallelism_s_gradients(measured):
    scenario = predict(measured, ranks=64, bandwidth="100Mbit").scenarios[0]
    assert scenario.fastest == min(scenario.rows, key=lambda row: row.step_ms)
    assert scenario.fastest_exact == min((row for row in scenario.rows if row.exact), key=lambda row: row.step_ms)
    assert not scenario.fastest.exact and scenario.fastest.setting.startswith("DiLoCo")
    text = table(predict(measured, ranks=64, bandwidth="100Mbit"))
    fastest = scenario.fastest
    assert f"fastest: {fastest.setting}, {fastest.step_ms:.2f} ms per step: {options_to_type(fastest.options)}" in text
    assert options_to_type({"local_sgd.steps": 16, "local_sgd.outer": "nesterov"}) == (
        "strategy.local_sgd.steps=16 strategy.local_sgd.outer=nesterov (Python: local_sgd_steps=16, local_sgd_outer='nesterov')"
    )
    assert "fastest with data parallelism's gradients: " in text
    assert f"* {DILOCO_QUALITY}" in text and "docs/local_sgd.md#diloco-on-the-gpt-recipe" in text


def test_the_best_bucket_size_is_no_slower_than_any_tried(measured):
    sizes = list(lit_dp.forecast.model.CANDIDATE_BUCKET_MB)
    rows = rows_of(predict(measured, ranks=8, bandwidth="1Gbit", bucket_sizes=sizes))
    best = next(row for setting, row in rows.items() if setting.endswith("(the best)"))
    assert all(best.step_ms <= rows[f"data parallelism, buckets of {size:g} MB"].step_ms for size in sizes)


def test_a_sync_dtype_added_to_lit_dp_is_forecast_without_a_change_here(measured, monkeypatch):
    # int8 and int4 syncs are being added to local_sgd.sync_dtype: the forecast reads the list, and
    # a dtype's bits from its name.
    monkeypatch.setattr(lit_dp.forecast.model, "SYNC_DTYPES", ("bf16", "int8", "int4"))
    rows = rows_of(predict(measured, ranks=8, bandwidth="10Gbit"))
    fp32 = rows["DiLoCo K=16, syncs in fp32"].bytes_per_step
    assert rows["DiLoCo K=16, syncs in int8"].bytes_per_step == pytest.approx(fp32 / 4)
    assert rows["DiLoCo K=16, syncs in int4"].bytes_per_step == pytest.approx(fp32 / 8)
    assert rows["DiLoCo K=16, syncs in int8"].options["local_sgd.sync_dtype"] == "int8"
    assert [wire_bits(name) for name in ("fp32", "bf16", "fp16", "int8", "int4")] == [32, 16, 16, 8, 4]
    with pytest.raises(ValueError, match=r"dtype 'half': expected a name ending in its bits"):
        wire_bits("half")


def test_replica_groups_per_node_cross_nodes_with_a_slice_each(measured):
    forecast = predict(measured, ranks=64, bandwidth="400Gbit", ranks_per_node=8, inter_node="10Gbit")
    link = forecast.scenarios[0].link
    assert (link.ranks_per_node, link.inter_node, link.nodes(64)) == (8, 1.25e9, 8)
    rows = rows_of(forecast)
    groups = rows["replica groups of 8 ranks, one per node (hierarchical all-reduce)"]
    assert groups.options == {"fault_tolerance": "torchft"} and groups.exact
    assert groups.bytes_per_step == pytest.approx(link.hierarchical_bytes(measured.model_bytes, 64))
    across = rows["DiLoCo K=16 across replica groups of 8 ranks per node"]
    assert across.options == {"fault_tolerance": "torchft", "local_sgd.steps": 16, "local_sgd.outer": "nesterov"}


def test_the_link_s_collectives():
    link = Link(bandwidth=1e9, latency=1e-5)
    # A ring all-reduce: 2(N-1) hops of latency, 2(N-1)/N of the bytes; a reduce-scatter half of it.
    assert link.allreduce_ms(1e9, 4) == pytest.approx((6 * 1e-5 + 1.5) * 1e3)
    assert link.half_ms(1e9, 4) == pytest.approx((3 * 1e-5 + 0.75) * 1e3)
    assert link.allreduce_ms(1e9, 1) == 0.0
    nodes = Link(bandwidth=1e10, latency=0.0, ranks_per_node=4, inter_node=1e9)
    # A flat ring across nodes goes at the slower link's pace; the hierarchical one sends a quarter across.
    assert nodes.allreduce_ms(1e9, 8) == pytest.approx(2 * 7 / 8 * 1e3)
    assert nodes.hierarchical_ms(1e9, 8) == pytest.approx((2 * 3 / 4 * 0.1 + 2 * 1 / 2 * 0.25) * 1e3)
    assert nodes.hierarchical_bytes(1e9, 8) == pytest.approx(2 * 3 / 4 * 1e9 + 2 * 1 / 2 * 0.25e9)


def probed(latency_ms: float, ms_per_mb: float, outlier: float = 1.0) -> list[Profile]:
    """The recorded run's profiles with a link probe of an exact line (the middle size ``outlier`` times slower)."""
    sizes = [64 * 1024, MB, 8 * MB]
    times = [latency_ms + ms_per_mb * size / MB for size in sizes]
    times[1] *= outlier
    return [profile.with_extra(link_probe={"bytes": sizes, "ms": times}) for profile in load_profiles(RUN)]


def test_the_link_is_fitted_to_the_probe_where_the_run_timed_one(measured):
    assert measured.link.note == "fitted to 3 bucket sizes of the run"  # the recorded run has no probe
    for outlier in (1.0, 4.0):  # a size slowed throughout its probe (Gloo's 1 MB on loopback) leaves the line
        link = measure(probed(0.25, 0.5, outlier)).link
        # Two ranks: an all-reduce is 2 hops and sends the whole payload (2(N-1)/N = 1).
        assert link.latency_s == pytest.approx(0.25e-3 / 2), outlier
        assert link.bandwidth == pytest.approx(MB / 0.5e-3), outlier
        assert link.note == "fitted to all-reduces of 0.0625, 1, 8 MB timed when the run ended"


def test_a_probed_latency_costs_small_buckets_and_many_ranks(measured):
    # The probe's latency, paid 2(N-1) times per bucket, separates what one bucket size cannot.
    rows = {}
    for latency_ms in (0.0, 0.25):
        forecast = predict(probed(latency_ms, 0.5), ranks=[64], bandwidth="10Gbit", bucket_sizes=[0.02, 25])
        rows[latency_ms] = rows_of(forecast)
    small, large = "data parallelism, buckets of 0.02 MB", "data parallelism, buckets of 25 MB"
    assert rows[0.25][small].step_ms - rows[0.0][small].step_ms > rows[0.25][large].step_ms - rows[0.0][large].step_ms
    assert rows[0.25][large].step_ms > rows[0.0][large].step_ms


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"ranks": 1}, r"^ranks=1 is invalid: expected numbers of ranks, each at least 2\.$"),
        (
            {"bandwidth": "fast"},
            r"^bandwidth='fast' is invalid: expected a positive bandwidth with its unit, e\.g\. 10Gbit",
        ),
        ({"latency": "soon"}, r"^latency='soon' is invalid: expected a latency with its unit, e\.g\. 20us"),
        ({"ranks_per_node": 8}, r"^ranks_per_node=8 with inter_node=None is invalid: expected both"),
        ({"bucket_sizes": [0]}, r"^bucket_sizes=\[0\] is invalid: expected positive sizes in MB\.$"),
        ({"local_steps": [0]}, r"^local_steps=\[0\] is invalid: expected periods K, each at least 1\.$"),
    ],
)
def test_bad_arguments_are_refused_naming_them(measured, arguments, message):
    with pytest.raises(ValueError, match=message):
        predict(measured, **arguments)


def test_a_live_model_s_profile_and_its_records_predict_alike(measured):
    profiles = load_profiles(RUN)
    slowest = next(profile for profile in profiles if profile.rank == measured.rank)
    assert predict(slowest, ranks=8).scenarios[0].rows == predict(measured, ranks=8).scenarios[0].rows
    assert predict(profiles, ranks=8).scenarios[0].rows == predict(RUN, ranks=8).scenarios[0].rows


def test_the_end_of_run_lines_one_per_setting(measured):
    forecast = predict(measured, ranks=[8, 64], bandwidth=["10Gbit", "1Gbit"])
    lines = end_of_run_lines(forecast, "outputs/digits/run")
    settings = forecast.scenarios[0].rows
    assert lines[0].startswith("[lit_dp] forecast: from the run: 2 gloo ranks on cpu")
    per_setting = lines[1 : 1 + len(settings)]
    for line, row in zip(per_setting, settings):
        assert line.startswith(f"[lit_dp] forecast {row.setting}{' *' if row.note else ''}: 8 ranks at 10 Gbit/s ")
        assert line.count(" ms (x") == 4 and line.endswith(" per step")  # 2 sizes x 2 links
    fastest = lines[1 + len(settings) : -1]
    assert [line.split(" over ")[1].split(":")[0] for line in fastest] == ["10 Gbit/s", "1 Gbit/s"]
    assert all(line.startswith("[lit_dp] forecast: fastest at 64 ranks over ") for line in fastest)
    assert (
        lines[-1] == f"[lit_dp] forecast: * {DILOCO_QUALITY}; the table: python -m lit_dp.forecast outputs/digits/run"
    )


def test_a_profile_without_synchronised_steps_says_what_to_run(measured):
    (profile, *_) = load_profiles(RUN)
    empty = dataclasses.replace(profile, steps=())
    with pytest.raises(
        lit_dp.forecast.NoRunError, match=r"holds no synchronised step .* run data parallelism on 2 or more ranks first"
    ):
        predict(empty)


def test_the_fixture_is_a_recorded_run():
    for path in sorted(RUN.rglob("lit_dp_profile.rank*.json")):
        profile = Profile.read(path)
        assert profile.world_size == 2 and len(profile.steps) == 31 and profile.extra["window"]["optimizer_ms"] > 0


def test_a_bucket_size_that_cuts_the_run_s_buckets_is_predicted_as_the_run(measured):
    # The recorded run: comm_buffer_size=0.02 and last_comm_buffer_size=0.02.
    rows = rows_of(predict(measured, bucket_sizes=[0.02]))
    assert rows["data parallelism, buckets of 0.02 MB"].step_ms == pytest.approx(measured.period_ms, rel=1e-6)
    assert rows["data parallelism, buckets of 0.02 MB"].options == {"comm_buffer_size": 0.02}


@pytest.mark.parametrize("probe", [{"bytes": [65536], "ms": [0.2]}, {"bytes": [65536, "1 MB"], "ms": [0.2, 0.8]}, [1]])
def test_a_damaged_link_probe_is_refused_naming_it(probe):
    profiles = [profile.with_extra(link_probe=probe) for profile in load_profiles(RUN)]
    with pytest.raises(NoRunError, match=r"^the profile of rank \d is damaged: extra\.link_probe=.* is invalid, expected "):
        measure(profiles)


@pytest.mark.parametrize(
    "probe",
    [
        {"idle_ms": [4.0, 1.0], "extra_ms": [0.1, 0.2]},  # not increasing
        {"idle_ms": [0.0, 1.0], "extra_ms": [0.0, 0.2]},  # a wait of nothing
        {"idle_ms": [1.0], "extra_ms": [-0.1]},
        {"idle_ms": [1.0, 4.0], "extra_ms": [0.1]},
        [1],
    ],
)
def test_a_damaged_resume_probe_is_refused_naming_it(probe):
    profiles = [profile.with_extra(resume_probe=probe) for profile in load_profiles(RUN)]
    with pytest.raises(NoRunError, match=r"^the profile of rank \d is damaged: extra\.resume_probe=.* is invalid, expected "):
        measure(profiles)
