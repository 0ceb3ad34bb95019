"""A communication timeline per rank in Chrome's trace-event format (Perfetto, ``chrome://tracing``).

``DataParallel(trace_dir=..., trace_steps=(start, stop))`` or the strategy's options of the same
names write ``rank{R}.json`` for the synchronised steps ``start <= step < stop`` (counted from
0, the first synchronised backward; with automatic optimization this is ``trainer.global_step``).
Each file holds, per step:

- an instant event ``step N`` when the forward armed the reducer;
- a complete event ``backward`` from the first gradient ready to the end of backward;
- a complete event ``all_reduce bucket K`` per bucket, from its launch to its completion, on a
  track of its own (all-reduces of consecutive buckets overlap in time), with the bucket index,
  bytes and parameter names in ``args``;
- a complete event ``exposed communication`` from the end of backward to the last completion.

``lit_dp`` does not import this module (``python -m lit_dp.observability.trace`` runs it
cleanly); ``DataParallel`` imports it only when ``trace_dir`` is set.

Timestamps are wall-clock microseconds (each rank's host clock, converted from
``time.monotonic``; on CUDA the spans' lengths come from CUDA events), so ranks on one host
line up exactly and ranks on different hosts as well as their clocks agree. Merge the ranks
into one file (and draw it as a PNG with the recipes' ``lit_dp_recipes.trace_render``)::

    python -m lit_dp.observability.trace merge DIR -o merged.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_dp.observability.stats import StepTimeline

COMPLETE = "X"
STEPS_TRACK = 0  # step markers, backward and exposed time; bucket K is drawn on track 1 + K


class TraceWriter:
    """Collects the traced steps of one rank and writes ``rank{R}.json`` once the last one arrives."""

    def __init__(self, directory: str | Path, rank: int, steps: tuple[int, int], names: Sequence[str]) -> None:
        self._path = Path(directory) / f"rank{rank}.json"
        self._names = list(names)  # the reducer's parameter names, by index
        self._rank = rank
        self._start, self._stop = steps
        # The monotonic clock is per-host and arbitrary; wall time lets ranks on different hosts line up.
        self._wall_offset = time.time() - time.monotonic()
        self._events: list[dict[str, Any]] = []
        self._tracks: set[int] = set()
        self._written = False

    @property
    def path(self) -> Path:
        return self._path

    def wants(self, step: int) -> bool:
        return self._start <= step < self._stop and not self._written

    def add(self, timeline: StepTimeline) -> None:
        if not self.wants(timeline.step):
            return
        self._events += self._step_events(timeline)
        if timeline.step == self._stop - 1:
            self.write()

    def write(self) -> None:
        """Write the steps collected so far (also called when training ends before ``stop``)."""
        if self._written or not self._events:
            return
        names = {STEPS_TRACK: "steps / backward"} | {track: f"bucket {track - 1}" for track in self._tracks if track}
        metadata = [{"ph": "M", "name": "process_name", "pid": self._rank, "args": {"name": f"rank {self._rank}"}}]
        metadata += [
            {"ph": "M", "name": "thread_name", "pid": self._rank, "tid": track, "args": {"name": name}}
            for track, name in sorted(names.items())
        ]
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._path.write_text(json.dumps({"traceEvents": metadata + self._events, "displayTimeUnit": "ms"}))
        self._written = True

    def _us(self, seconds: float) -> float:
        return round((seconds + self._wall_offset) * 1e6, 3)

    def _span(self, name: str, category: str, track: int, start: float, end: float, **args: Any) -> dict[str, Any]:
        return {
            "ph": COMPLETE,
            "name": name,
            "cat": category,
            "pid": self._rank,
            "tid": track,
            "ts": self._us(start),
            "dur": round(max(0.0, end - start) * 1e6, 3),
            "args": args,
        }

    def _step_events(self, timeline: StepTimeline) -> list[dict[str, Any]]:
        stats = timeline.stats()
        step_mark = {
            "ph": "i",
            "s": "p",
            "name": f"step {timeline.step}",
            "cat": "step",
            "pid": self._rank,
            "tid": STEPS_TRACK,
            "ts": self._us(timeline.start),
            "args": {"step": timeline.step},
        }
        backward = self._span(
            "backward", "backward", STEPS_TRACK, timeline.backward_start, timeline.backward_end, step=timeline.step
        )
        events: list[dict[str, Any]] = [step_mark, backward]
        for bucket in timeline.buckets:
            track = 1 + bucket.index
            self._tracks.add(track)
            events.append(
                self._span(
                    f"all_reduce bucket {bucket.index}",
                    "bucket",
                    track,
                    bucket.launch,
                    bucket.end,
                    step=timeline.step,
                    bucket=bucket.index,
                    bytes=bucket.bytes,
                    params=[self._names[i] for i in bucket.indices],
                )
            )
        last = max((bucket.end for bucket in timeline.buckets), default=timeline.backward_end)
        if last > timeline.backward_end:
            events.append(
                self._span(
                    "exposed communication",
                    "exposed",
                    STEPS_TRACK,
                    timeline.backward_end,
                    last,
                    step=timeline.step,
                    exposed_ms=stats.exposed_ms,
                    overlap=stats.overlap,
                )
            )
        return events


def merge(directory: str | Path, output: str | Path) -> Path:
    """Concatenate ``directory``'s ``rank{R}.json`` files into one trace (one process row per rank)."""
    files = sorted(Path(directory).glob("rank*.json"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        raise FileNotFoundError(f"no rank*.json trace files in {directory}")
    events = [event for path in files for event in json.loads(path.read_text())["traceEvents"]]
    output = Path(output)
    output.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return output


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_dp.observability.trace", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    merge_parser = commands.add_parser("merge", help="merge a trace_dir's rank{R}.json files into one trace")
    merge_parser.add_argument("directory")
    merge_parser.add_argument("-o", "--output", default="merged.json")
    args = parser.parse_args(argv)
    print(merge(args.directory, args.output))


if __name__ == "__main__":
    main()
