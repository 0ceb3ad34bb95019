"""Draw a lit_dp Chrome trace (``lit_dp.observability.trace``) as a PNG timeline, with matplotlib.

    python -m lit_dp.observability.trace merge outputs/<run>/trace -o merged.json
    python -m lit_dp_recipes.trace_render merged.json -o timeline.png

One row per (rank, track): backward, each bucket's all-reduce, the exposed communication.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from lit_dp.observability.trace import COMPLETE


def render(trace: str | Path, output: str | Path, title: str | None = None) -> Path:
    """Draw a trace's complete events as a timeline PNG: one row per (rank, track)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    events = json.loads(Path(trace).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == COMPLETE]
    if not spans:
        raise ValueError(f"{trace} holds no complete events to draw")
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    origin = min(e["ts"] for e in spans)
    colours = {"backward": "tab:blue", "bucket": "tab:green", "exposed": "tab:red"}
    figure, axes = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    for row, key in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e["tid"]) == key):
            axes.barh(
                row,
                e["dur"] / 1e3,
                left=(e["ts"] - origin) / 1e3,
                height=0.6,
                color=colours.get(e.get("cat"), "tab:gray"),
                edgecolor="black",
                linewidth=0.3,
            )
    for e in (e for e in events if e.get("ph") == "i" and e.get("cat") == "step"):
        axes.axvline((e["ts"] - origin) / 1e3, color="gray", linewidth=0.5, linestyle=":")
    axes.set_yticks(range(len(rows)), [f"rank {pid} · {names.get((pid, tid), tid)}" for pid, tid in rows])
    axes.invert_yaxis()
    axes.set_xlabel("ms (dotted lines: step starts)", labelpad=2)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    axes.legend(
        handles,
        ["backward", "bucket all-reduce", "exposed communication"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=3,
        fontsize=8,
    )
    axes.set_title(title or f"Rendering of the Chrome trace {Path(trace).name}")
    figure.tight_layout()
    figure.savefig(output, dpi=120)
    plt.close(figure)
    return Path(output)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_dp_recipes.trace_render", description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="a trace file (e.g. merged.json)")
    parser.add_argument("-o", "--output", default="timeline.png")
    args = parser.parse_args(argv)
    print(render(args.trace, args.output))


if __name__ == "__main__":
    main()
