"""What scale would cost: a planner built on the run's own measurements (docs/forecast.md).

A run with ``comm_stats`` writes, on every rank, its communication profile: per step, each
bucket's bytes, the moment its last gradient was ready, its launch and its end
(``lit_dp.observability.profile``). From it the forecast fits a small cost model (a latency
plus bytes over a bandwidth per bucket, a ring's ``2(N-1)/N``, overlap with backward from each
bucket's ready moment, the host's cost per bucket) and predicts each setting's step at other
numbers of ranks and over other links:

    python -m lit_dp.forecast outputs/gpt/<time> --ranks 8,64 --bandwidth 10Gbit

    forecast = lit_dp.forecast.predict("outputs/gpt/<time>", ranks=[8, 64], bandwidth="10Gbit")
    forecast.scenarios[0].fastest  # a Prediction: setting, options, step_ms, exposed_ms, bytes_per_step, cost

``strategy.forecast.ranks=[8,64]`` prints the same rows, one line per setting, when training ends.
"""

from lit_dp.forecast.link import Link
from lit_dp.forecast.model import Forecast, Prediction, Scenario, predict, wire_bits
from lit_dp.forecast.report import end_of_run_lines, table
from lit_dp.forecast.run import Measured, NoRunError, load_profiles, measure

__all__ = [
    "Forecast",
    "Link",
    "Measured",
    "NoRunError",
    "Prediction",
    "Scenario",
    "end_of_run_lines",
    "load_profiles",
    "measure",
    "predict",
    "table",
    "wire_bits",
]
