"""The communication profile: each bucket's ready moment, launch and end per step, kept across a layout, on disk."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lit_dp.observability.profile import KEPT_STEPS, MIN_KEPT_STEPS, CommProfile, Profile, file_name, kept_steps
from lit_dp.observability.stats import BucketSpan, StepTimeline
from tests.helpers.observability import STATS_STEPS


def test_the_profile_of_two_real_ranks(two_ranks):
    results, _ = two_ranks
    for rank, result in results.items():
        profile: Profile = result["profile"]
        assert (profile.rank, profile.world_size, profile.backend, profile.device) == (rank, 2, "gloo", "cpu")
        assert [list(bucket) for bucket in profile.bucket_indices] == result["bucket_indices"]
        assert sum(profile.parameter_bytes) == result["gradient_bytes"]
        # The record holds the steps of the layout after the rebuild in ready order (step 0's too where
        # the rebuild kept its buckets), the last one without a period (no step followed it yet).
        steps = [step.step for step in profile.steps]
        assert steps in (list(range(STATS_STEPS)), list(range(1, STATS_STEPS))), f"rank {rank}: {steps}"
        assert all(step.period_ms > 0 for step in profile.steps[:-1]) and profile.steps[-1].period_ms is None
        for step in profile.steps:
            assert step.backward_start_ms >= 0 and step.backward_end_ms <= step.reduced_ms, f"rank {rank}: {step}"
            # The reducer's own work on the host (the profile times it for the forecast's local steps).
            assert step.host_work_ms is not None and step.host_work_ms > 0, f"rank {rank}: {step}"
            assert [bucket.bytes for bucket in step.buckets] == [
                sum(profile.parameter_bytes[i] for i in bucket) for bucket in profile.bucket_indices
            ]
            for bucket in step.buckets:
                # Gradients arrive from the backward's start on; a bucket launches once ready, in order.
                assert 0 <= bucket.ready_ms <= bucket.launch_ms <= bucket.end_ms, f"rank {rank}: {step}"
            launches = [bucket.launch_ms for bucket in step.buckets]
            assert launches == sorted(launches)
            assert step.buckets[-1].ready_ms <= step.backward_end_ms
        # Each gradient's median ready moment after the step's first.
        ready = profile.gradient_ready_ms
        assert ready is not None and len(ready) == len(profile.parameter_bytes), f"rank {rank}: {ready}"
        assert all(moment is not None and moment >= 0 for moment in ready), f"rank {rank}: {ready}"
        assert profile.settings["comm_buffer_size"] == pytest.approx(4 / 1024)
        assert profile.settings["gradient_bits"] == 32


def timeline(
    step: int,
    start: float,
    layout: tuple[tuple[int, ...], ...],
    ready: float | None = 0.3,
    host_work_ms: float | None = None,
) -> StepTimeline:
    buckets = tuple(
        BucketSpan(i, 16, indices, 1.0 + i, 2.0 + i, None if ready is None else ready + i)
        for i, indices in enumerate(layout)
    )
    return StepTimeline(
        step=step,
        start=start,
        backward_start=start + 0.1,
        backward_end=start + 3.0,
        reduced=start + 4.0,
        buckets=buckets,
        host_work_ms=host_work_ms,
    )


def recorder() -> CommProfile:
    return CommProfile(
        [8, 8, 8], rank=1, world_size=2, backend="gloo", device="cpu", settings={"comm_buffer_size": 25.0}
    )


def test_a_step_is_kept_in_ms_from_its_first_gradient_with_the_period_to_the_next():
    profile = recorder()
    two = ((2,), (0, 1))
    for step in range(3):
        profile.add(timeline(step, 10.0 * step, two))
    steps = profile.record().steps
    assert [step.step for step in steps] == [0, 1, 2]
    assert [step.period_ms for step in steps] == [10_000.0, 10_000.0, None]
    first = steps[0]
    assert first.backward_start_ms == pytest.approx(100.0)
    assert (first.backward_end_ms, first.reduced_ms) == (pytest.approx(2900.0), pytest.approx(3900.0))
    assert [(b.ready_ms, b.launch_ms, b.end_ms) for b in first.buckets] == [
        (pytest.approx(200.0), pytest.approx(900.0), pytest.approx(1900.0)),
        (pytest.approx(1200.0), pytest.approx(1900.0), pytest.approx(2900.0)),
    ]


def test_a_bucket_never_ready_in_backward_is_ready_at_its_launch():
    profile = recorder()
    profile.add(timeline(0, 0.0, ((0, 1, 2),), ready=None))
    (bucket,) = profile.record().steps[0].buckets
    assert bucket.ready_ms == bucket.launch_ms


def test_a_new_layout_starts_the_record_afresh_and_a_missing_step_leaves_no_period():
    profile = recorder()
    profile.add(timeline(0, 0.0, ((0, 1, 2),)))  # registration order, before the rebuild
    for step in (1, 2, 4):  # step 3 not synchronised (a LocalSGD local step, say)
        profile.add(timeline(step, 10.0 * step, ((2,), (0, 1))))
    record = profile.record()
    assert record.bucket_indices == ((2,), (0, 1))
    assert [(step.step, step.period_ms) for step in record.steps] == [(1, 10_000.0), (2, None), (4, None)]


def test_only_the_latest_steps_are_kept():
    profile = recorder()
    for step in range(KEPT_STEPS + 10):
        profile.add(timeline(step, float(step), ((0, 1, 2),)))
    steps = profile.record().steps
    assert len(steps) == KEPT_STEPS + 1 and steps[-1].step == KEPT_STEPS + 9


def test_a_layout_of_many_buckets_keeps_fewer_steps_and_never_fewer_than_the_minimum():
    assert kept_steps(1) == kept_steps(3) == KEPT_STEPS
    assert MIN_KEPT_STEPS < kept_steps(100) < KEPT_STEPS
    assert kept_steps(10_000) == MIN_KEPT_STEPS
    profile = CommProfile([4] * 100, rank=1, world_size=2, backend="gloo", device="cpu", settings={})
    many = tuple((i,) for i in range(100))
    for step in range(KEPT_STEPS + 10):
        profile.add(timeline(step, float(step), many))
    assert len(profile.record().steps) == kept_steps(100) + 1


def test_written_and_read_back(tmp_path):
    profile = recorder()
    for step in range(3):
        profile.add(timeline(step, float(step), ((2,), (0, 1))))
    record = profile.record().with_extra(window={"optimizer_ms": 1.5})
    path = record.write(tmp_path / "logs")
    assert path == tmp_path / "logs" / file_name(1) and path.name == "lit_dp_profile.rank1.json"
    assert Profile.read(path) == record


def test_each_gradient_s_median_ready_moment_over_the_steps(tmp_path):
    profile = recorder()
    for step, ready in enumerate([(0.0, 1.0, None), (0.0, 3.0, None), (0.0, 2.0, None)]):
        profile.add(dataclasses.replace(timeline(step, float(step), ((2,), (0, 1))), gradients_ready_ms=ready))
    record = profile.record()
    assert record.gradient_ready_ms == (0.0, 2.0, None)
    assert Profile.from_json(json.loads(json.dumps(record.to_json()))) == record
    untimed = record.to_json()
    del untimed["gradient_ready_ms"]  # a profile written before lit_dp timed them
    assert Profile.from_json(untimed).gradient_ready_ms is None


def test_a_bound_end_is_kept_and_a_profile_written_before_reads_every_end_as_measured():
    profile = recorder()
    for step in range(2):
        spans = timeline(step, float(step), ((2,), (0, 1))).buckets
        bounded = (dataclasses.replace(spans[0], end_bounded=True), spans[1])
        profile.add(dataclasses.replace(timeline(step, float(step), ((2,), (0, 1))), buckets=bounded))
    record = profile.record()
    assert [[b.end_bounded for b in step.buckets] for step in record.steps] == [[True, False]] * 2
    data = json.loads(json.dumps(record.to_json()))
    assert Profile.from_json(data) == record
    for step in data["steps"]:
        step["buckets"] = [bucket[:4] for bucket in step["buckets"]]  # as written before lit_dp told it
    assert [[b.end_bounded for b in step.buckets] for step in Profile.from_json(data).steps] == [[False, False]] * 2
    data["steps"][1]["buckets"][0].append("yes")
    refusal = r"^the profile is damaged: TypeError: a bucket's end_bounded is 'yes', expected true or false$"
    with pytest.raises(ValueError, match=refusal):
        Profile.from_json(data)


def test_a_profile_written_before_the_host_work_was_timed_reads_without_it(tmp_path):
    profile = recorder()
    for step in range(2):
        profile.add(timeline(step, float(step), ((2,), (0, 1)), host_work_ms=0.25))
    record = profile.record()
    assert [step.host_work_ms for step in record.steps] == [0.25, 0.25]
    data = record.to_json()
    for step in data["steps"]:
        del step["host_work_ms"]
    assert [step.host_work_ms for step in Profile.from_json(data).steps] == [None, None]


def test_a_damaged_or_foreign_file_is_refused_naming_it(tmp_path):
    path = tmp_path / file_name(0)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{path} is damaged: "):
        Profile.read(path)
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(
        ValueError, match=r"is not a lit_dp communication profile of version 1 \(format='something else'"
    ):
        Profile.read(path)
    data = recorder().record().to_json()
    del data["parameter_bytes"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^{path} is damaged: KeyError: 'parameter_bytes'$"):
        Profile.read(path)
