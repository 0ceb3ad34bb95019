"""The hang watchdog's report: where a rank's main thread is, one line per rank, who is behind,
and the files a rank leaves beside it (its stacks, torch's flight-recorder trace).

Formatting over the reports the ranks publish (``lit_dp.observability.watchdog``), tested
without processes.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import sysconfig
import threading
from typing import Any

import torch

FLIGHT_RECORDER_PREFIX = "fr_trace_rank_"  # torch's analyser: fr_trace <dir> -p fr_trace_rank_
# torch's flight recorder records each process group's collectives when one of these is > 0
# (TORCH_NCCL_TRACE_BUFFER_SIZE is its older, NCCL-only name).
FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")

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
    phase = f"in phase '{report['phase']}'; " if report.get("phase") else ""
    return (
        f"rank {rank} ({report['host']}, pid {report['pid']}): step {report['step']}, {launched}; {report['state']}; "
        f"{phase}at {report['where']}"
    )


def format_summary(
    opening: str,
    ranks: list[int],
    reports: dict[int, dict[str, Any]],
    waited: tuple[int, int] | None,
    reply_seconds: float,
    folder: str,
) -> str:
    """The diagnosis: ``opening``, one line per rank, who is behind, where the stacks and traces are."""
    lines = [opening]
    lines += [f"  {describe_rank(rank, reports.get(rank), reply_seconds)}" for rank in ranks]
    lines += behind_lines(ranks, reports, waited)
    lines.append(
        f"Stacks: {folder}/rank<R>.txt for the ranks that answered; a rank that could not run Python gets its "
        "stack on its stderr (faulthandler, signalled by a rank on its host)."
    )
    lines.append(flight_recorder_line(folder))
    return "\n".join(lines)


def furthest_bucket(reports: dict[int, dict[str, Any]], step: int) -> tuple[int, int] | None:
    """The furthest bucket of ``step`` any rank launched: on NCCL, where a rank's own wait cannot
    tell which bucket is stuck, the ranks behind it are the ones the others wait for."""
    furthest = -1
    for report in reports.values():
        if report["step"] > step:  # it launched every bucket of that step
            furthest = max(furthest, report["buckets"] - 1)
        elif report["step"] == step:
            furthest = max(furthest, report["launched"])
    return (step, furthest) if furthest >= 0 else None


def write_stacks(path: str, header: dict[str, Any]) -> str | None:
    """``header`` then every thread's Python stack (``faulthandler``) into ``path``; None if it cannot be written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as file:
            file.write(f"{json.dumps(header)}\n\n")
            file.flush()
            faulthandler.dump_traceback(file, all_threads=True)
    except OSError:
        return None
    return path


def flight_recorder_on() -> bool:
    for variable in FLIGHT_RECORDER_VARIABLES:
        value = os.environ.get(variable, "")
        if value.strip():
            return value.strip().isdigit() and int(value) > 0
    return False


def dump_flight_recorder(folder: str, rank: int) -> str | None:
    """torch's flight-recorder trace of this process's collectives (when on) into ``folder``."""
    if not flight_recorder_on():
        return None
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    path = os.path.join(folder, f"{FLIGHT_RECORDER_PREFIX}{rank}")
    try:
        trace = dump()
        os.makedirs(folder, exist_ok=True)
        with open(path, "wb") as file:
            file.write(trace)
    except (OSError, RuntimeError):
        return None
    return path


def flight_recorder_line(folder: str) -> str:
    if flight_recorder_on():
        return (
            f"Flight recorder: {folder}/{FLIGHT_RECORDER_PREFIX}<R> for the ranks that answered (torch's trace of "
            f"their collectives: python -m torch.distributed.flight_recorder.fr_trace {folder} "
            f"-p {FLIGHT_RECORDER_PREFIX} -j)."
        )
    return (
        f"Flight recorder: off (set {FLIGHT_RECORDER_VARIABLES[0]}=2000 for torch's trace of every collective "
        "beside the stacks)."
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
