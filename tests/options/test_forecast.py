"""``forecast.*``: the end-of-run forecast's options, and how bandwidths and latencies are written."""

from __future__ import annotations

import pytest

from lit_dp.options import Options
from lit_dp.options.forecast import parse_bandwidth, parse_latency, show_bandwidth


@pytest.mark.parametrize(
    ("text", "bytes_per_second"),
    [
        ("10Gbit", 1.25e9), ("10 Gbit/s", 1.25e9), ("100Mbit", 12.5e6), ("100mbps", 12.5e6), ("1Gb", 1.25e8),
        ("1.25GB/s", 1.25e9), ("800kbit", 1e5), ("1e9bit", 1.25e8), ("400Gbps", 5e10),
    ],
)  # fmt: skip
def test_bandwidths_in_bits_or_bytes_per_second(text, bytes_per_second):
    assert parse_bandwidth("--bandwidth", text) == pytest.approx(bytes_per_second)


@pytest.mark.parametrize("text", ["fast", "10", "0Gbit", "-1Gbit", "10 Gbyte", 10])
def test_a_bandwidth_without_its_unit_is_refused(text):
    with pytest.raises(
        ValueError,
        match=rf"^x={text!r} is invalid: expected a positive bandwidth with its unit, e\.g\. 10Gbit, 100Mbit/s, 1\.25GB/s\.$",
    ):
        parse_bandwidth("x", text)


def test_latencies():
    assert [parse_latency("x", text) for text in ("20us", "0.5ms", "1s", "100ns", "0s")] == pytest.approx(
        [2e-5, 5e-4, 1.0, 1e-7, 0.0]
    )
    with pytest.raises(
        ValueError, match=r"^x='20' is invalid: expected a latency with its unit, e\.g\. 20us, 0\.5ms\.$"
    ):
        parse_latency("x", "20")


def test_bandwidths_are_shown_in_bits():
    assert [show_bandwidth(b) for b in (1.25e9, 12.5e6, 5e10, 100.0)] == [
        "10 Gbit/s",
        "100 Mbit/s",
        "400 Gbit/s",
        "800 bit/s",
    ]


def test_the_options_at_each_front_door():
    options = Options.build({"forecast_ranks": [8, 64], "forecast_bandwidths": ["10Gbit", "1Gbit"]}, "trainer").forecast
    assert (options.ranks, options.bandwidths) == ((8, 64), ("10Gbit", "1Gbit"))
    assert Options.build({"forecast": {"ranks": 8}}, "fabric").forecast.ranks == (8,)
    assert Options.build({}, "trainer").forecast.ranks is None
    with pytest.raises(
        ValueError,
        match=r"^forecast_ranks=\[8\] is not an option of lit_dp\.DataParallel: after training, call lit_dp\.forecast\.predict\(model\.comm_profile\.record\(\), ranks=\[8, 64\]\)",
    ):
        Options.build({"forecast_ranks": [8]}, "module")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"forecast_ranks": [1, 8]},
            r"^forecast_ranks=\[1, 8\] is invalid: expected numbers of ranks to forecast, each at least 2, e\.g\. \[8, 64\]\.$",
        ),
        ({"forecast_ranks": "8"}, r"^forecast_ranks='8' is invalid: expected numbers of ranks"),
        ({"forecast_ranks": [True]}, r"^forecast_ranks=\[True\] is invalid"),
        (
            {"forecast_ranks": [8], "forecast_bandwidths": ["fast"]},
            r"^forecast_bandwidths='fast' is invalid: expected a positive bandwidth",
        ),
        (
            {"forecast_ranks": [8], "forecast_bandwidths": []},
            r"^forecast_bandwidths=\[\] is invalid: expected bandwidths with their units",
        ),
        (
            {"forecast_bandwidths": ["10Gbit"]},
            r"^forecast_bandwidths=\('10Gbit',\) needs forecast_ranks: expected the numbers of ranks to forecast, e\.g\. forecast_ranks=\[8,64\]\.$",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_option(given, message):
    with pytest.raises(ValueError, match=message):
        Options.build(given, "trainer")
