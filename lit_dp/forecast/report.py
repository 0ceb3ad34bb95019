"""A forecast in words: the table ``python -m lit_dp.forecast`` prints, and the end-of-run lines."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_dp.forecast.model import DILOCO_QUALITY, Forecast, Prediction, Scenario
from lit_dp.forecast.run import Measured
from lit_dp.options.forecast import show_bandwidth

MB = 2**20
PREFIX = "[lit_dp] forecast"


def options_to_type(options: Mapping[str, Any]) -> str:
    """The options as a recipe's command line takes them, and as keyword arguments."""
    if not options:
        return "as run (nothing to change)"
    hydra = " ".join(f"strategy.{path}={_hydra(value)}" for path, value in options.items())
    python = ", ".join(f"{path.replace('.', '_')}={value!r}" for path, value in options.items())
    return f"{hydra} (Python: {python})"


def _hydra(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_run(m: Measured) -> str:
    return (
        f"the run: {m.ranks} {m.backend} ranks on {m.device}, rank {m.rank}'s last {m.steps} steps (medians): a step of "
        f"{m.period_ms:.2f} ms, one rank's compute {m.compute_ms:.2f} ms (forward {m.median('forward_ms'):.2f}, backward "
        f"{m.median('backward_ms'):.2f}, optimizer, data and the rest {m.median('rest_ms'):.2f}), {m.median('exposed_ms'):.2f} ms "
        f"waiting for buckets after backward; a bucket launch costs the host {m.launch_ms:.3f} ms + "
        f"{m.launch_ms_per_mb:.3f} ms/MB; {m.model_bytes / MB:.3f} MB of gradients"
    )


def table(forecast: Forecast) -> str:
    """Every scenario's rows, the fastest setting and the options to type for it."""
    lines = [describe_run(forecast.measured), *forecast.notes]
    for scenario in forecast.scenarios:
        lines += ["", f"{scenario.ranks} ranks over {scenario.link.describe()}", ""]
        lines += [
            "| setting | step (ms) | exposed comm (ms/step) | MB per rank per step | vs one rank's compute |",
            "|---|---|---|---|---|",
        ]
        for row in scenario.rows:
            mark = " *" if row.note else ""
            lines.append(
                f"| {row.setting}{mark} | {row.step_ms:.2f} | {row.exposed_ms:.2f} | {row.bytes_per_step / MB:.4g} | {row.cost:.2f} |"
            )
        lines += ["", *recommendation(scenario)]
    if any(row.note for scenario in forecast.scenarios for row in scenario.rows):
        lines += ["", f"* {DILOCO_QUALITY}"]
    return "\n".join(lines)


def recommendation(scenario: Scenario) -> list[str]:
    fastest, exact = scenario.fastest, scenario.fastest_exact
    lines = [f"fastest: {fastest.setting}, {fastest.step_ms:.2f} ms per step: {options_to_type(fastest.options)}"]
    if exact is not fastest:
        lines.append(
            f"fastest with data parallelism's gradients: {exact.setting}, {exact.step_ms:.2f} ms per step: "
            f"{options_to_type(exact.options)}"
        )
    if fastest.note:
        lines.append(f"({fastest.setting}: {fastest.note})")
    return lines


def end_of_run_lines(forecast: Forecast, folder: str | None = None) -> list[str]:
    """One line per setting with its step at every (ranks, link) asked, then the fastest at the largest."""
    scenarios = forecast.scenarios
    several_links = len({scenario.link for scenario in scenarios}) > 1
    lines = [f"{PREFIX}: from {describe_run(forecast.measured)}"]
    for position, first in enumerate(scenarios[0].rows):
        cells = []
        for scenario in scenarios:
            row: Prediction = scenario.rows[position]
            where = f"{scenario.ranks} ranks" + (
                f" at {show_bandwidth(scenario.link.bandwidth)}" if several_links else ""
            )
            cells.append(f"{where} {row.step_ms:.2f} ms (x{row.cost:.2f})")
        mark = " *" if first.note else ""
        lines.append(f"{PREFIX} {first.setting}{mark}: {', '.join(cells)} per step")
    largest = max(scenario.ranks for scenario in scenarios)
    for scenario in (s for s in scenarios if s.ranks == largest):
        link = "the run's own link" if scenario.link.measured else show_bandwidth(scenario.link.bandwidth)
        fastest, exact = scenario.fastest, scenario.fastest_exact
        text = (
            f"{PREFIX}: fastest at {largest} ranks over {link}: {fastest.setting} ({options_to_type(fastest.options)})"
        )
        if exact is not fastest:
            text += f"; with data parallelism's gradients: {exact.setting} ({options_to_type(exact.options)})"
        lines.append(text)
    tail = f"; the table: python -m lit_dp.forecast {folder}" if folder else ""
    lines.append(f"{PREFIX}: * {DILOCO_QUALITY}{tail}")
    return lines
