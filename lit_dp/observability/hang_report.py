"""The hang watchdog's report: where a rank's main thread is, one line per rank, who is behind.

Pure formatting over the reports the ranks publish (``lit_dp.observability.watchdog``), tested
without processes.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from typing import Any

# Frames under these directories are machinery (installed packages, the standard library,
# lit_dp itself); the innermost frame outside them is the user's.
_LIBRARY_ROOTS = tuple(
    os.path.join(path, "")
    for path in (
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["stdlib"],
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
)


def main_thread_position() -> str:
    """``file:line in function`` of the main thread's innermost frame and of its innermost user frame."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "unknown"
    innermost = _frame_text(frame)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_ROOTS):
        frame = frame.f_back
    if frame is None:
        return innermost
    user = _frame_text(frame)
    if user == innermost or threading.current_thread() is threading.main_thread():
        return user  # answering from the main thread: its innermost frames are the diagnosis itself
    return f"{user} (innermost: {innermost})"


def _frame_text(frame: Any) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def describe_rank(rank: int, report: dict[str, Any] | None, reply_seconds: float) -> str:
    if report is None:
        return (
            f"rank {rank}: did not answer within {reply_seconds:g}s: outside lit_dp's collectives and unable to run "
            "Python (C code holding the GIL), or gone"
        )
    launched = (
        "no bucket of it launched yet"
        if report["launched"] < 0
        else f"launched buckets 0-{report['launched']} of {report['buckets']}"
    )
    return (
        f"rank {rank} ({report['host']}, pid {report['pid']}): step {report['step']}, {launched}; {report['state']}; "
        f"at {report['where']}"
    )


def behind_lines(ranks: list[int], reports: dict[int, dict[str, Any]], waited: tuple[int, int] | None) -> list[str]:
    """One line per rank behind the bucket waited for, or what else explains the wait."""
    silent = [rank for rank in ranks if rank not in reports]
    if waited is None:
        outside = [rank for rank, report in reports.items() if report["state"].startswith("outside")]
        culprits = sorted(outside + silent)
        return [f"Not in lit_dp's collectives: rank(s) {culprits}."] if culprits else []
    step, bucket = waited
    lines = []
    for rank, report in sorted(reports.items()):
        their_step, their_bucket = report["step"], report["launched"]
        if (their_step, their_bucket) >= (step, bucket):
            continue
        if their_step == step:
            last = f"its last was bucket {their_bucket}" if their_bucket >= 0 else "it launched none of that step"
        else:
            last = f"its last was bucket {their_bucket} of step {their_step}"
        lines.append(f"Behind: rank {rank} never launched bucket {bucket} of step {step}; {last}.")
    if silent:
        lines.append(f"Silent: rank(s) {silent} (see above).")
    if not lines:
        lines.append("Every rank that answered launched that bucket: the collective itself is stuck (network or backend).")
    return lines
