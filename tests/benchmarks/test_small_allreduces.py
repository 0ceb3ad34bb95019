"""`python -m benchmarks.small_allreduces`, shrunk: its table comes out, consistent with itself."""

from __future__ import annotations

import pytest

from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
def test_small_allreduces_benchmark_prints_each_way_and_what_each_added_all_reduce_costs(tmp_path):
    output = run_benchmark(
        "small_allreduces", "tries=5", "rounds=1", "warmup=1", "floats=[100,200,300]", f"hydra.run.dir={tmp_path}"
    )
    assert "3 buckets of 0.4, 0.8, 1.2 KB (fp32) on 2 gloo ranks" in output
    rows = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[1].replace(".", "").isdigit():
            rows[cells[0]] = (float(cells[1]), float(cells[2]), cells[3])
    assert set(rows) == {"one", "waited one by one", "launched back to back", "behind host work"}
    one = rows["one"][0]
    for way, (ms, slow, added) in rows.items():
        assert slow >= ms, (way, ms, slow)  # the 90th percentile of the same tries
        if way != "one":
            host = 0.4 if way == "behind host work" else 0.0
            assert float(added) == pytest.approx((ms - host - one) / 2, abs=2e-3)
    # Host work of 0.4 ms between the launches and the wait: the way cannot take less.
    assert rows["behind host work"][0] >= 0.4


def test_an_empty_or_zero_bucket_is_refused_with_the_option_named():
    from benchmarks.small_allreduces import SmallAllReducesBenchmarkConfig, run

    for floats in ((), (10, 0)):
        with pytest.raises(ValueError, match=r"floats=.* is invalid: expected one count of 1 or more floats per bucket"):
            run(SmallAllReducesBenchmarkConfig(floats=floats))


@pytest.mark.parametrize("option", [{"tries": 0}, {"tries": 2.5}, {"rounds": 0}, {"warmup": -1}, {"host_work_ms": -0.1}])
def test_a_count_or_time_below_its_least_is_refused_with_the_option_named(option):
    from benchmarks.small_allreduces import SmallAllReducesBenchmarkConfig, run

    [(name, value)] = option.items()
    with pytest.raises(ValueError, match=rf"{name}={value!r} is invalid: expected (a|a whole) number of"):
        run(SmallAllReducesBenchmarkConfig(**option))
