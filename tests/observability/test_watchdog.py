"""The hang watchdog: a stuck rank is named, with where it is, and its stack lands in the log directory.

Real gloo processes with ``hang_timeout=2``: one rank is made to sleep (it can still run
Python, so its watchdog thread answers) or to sit in a C call that holds the GIL (it cannot).
The others must end with an error naming them, long before the process group's timeout.
(The Trainer's case, a rank asleep in ``training_step``: ``tests/strategies/test_hang_watchdog.py``.)
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch
from torch import nn

import lit_dp
from lit_dp.gradients.waiting import CollectiveHangError
from lit_dp.observability.hang_report import behind_lines
from lit_dp.observability.watchdog import HANG_DIRECTORY
from tests.helpers.distributed import run_ranks

HANG_TIMEOUT = 2.0


def sleep_before_backward(rank: int, directory: str) -> None:
    """Rank 1 sleeps (answers), rank 2 holds the GIL in C (silent), at step 3."""
    lit_dp.init_parallel_env()
    torch.manual_seed(0)
    model = lit_dp.DataParallel(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), hang_timeout=HANG_TIMEOUT, comm_buffer_size=1e-4
    )
    model.watchdog.directory = directory
    for step in range(5):
        loss = model(torch.randn(4, 6)).square().mean()
        # Asleep past the deadline and the answer; in C past the deadline and the reply window (3 s).
        if step == 3 and rank == 1:
            time.sleep(HANG_TIMEOUT + 2)
        if step == 3 and rank == 2:
            ctypes.PyDLL(None).sleep(int(HANG_TIMEOUT + 5))  # a C call that keeps the GIL
        loss.backward()


def test_a_sleeping_and_a_silent_rank_are_named_and_the_waiting_rank_raises(tmp_path):
    started = time.monotonic()
    failures = run_ranks(sleep_before_backward, 3, str(tmp_path), timeout=90, expect_failure=True)
    message = failures[0]
    assert CollectiveHangError.__name__ in message, message
    assert "bucket 0 of synchronised step 3 waited" in message and "hang_timeout=2s" in message, message
    assert "rank 1 never launched bucket 0 of step 3" in message, message
    assert "rank 1 (" in message and "outside lit_dp's collectives" in message and "in sleep_before_backward" in message
    assert "rank 2: did not answer" in message, message
    hang_dir = tmp_path / HANG_DIRECTORY
    assert "sleep_before_backward" in (hang_dir / "rank1.txt").read_text()
    assert (hang_dir / "summary_rank0.txt").read_text().strip() in message
    assert time.monotonic() - started < 60, "the job must end within seconds of hang_timeout"


def leave_early_then_sleep(rank: int, directory: str) -> None:
    """Rank 0 joins after one step and waits in torch's Join loop; rank 1 sleeps before step 2."""
    lit_dp.init_parallel_env()
    model = lit_dp.DataParallel(nn.Linear(6, 3), hang_timeout=HANG_TIMEOUT)
    model.watchdog.directory = directory
    with model.join():
        for step in range(1 if rank == 0 else 3):
            if rank == 1 and step == 2:
                time.sleep(HANG_TIMEOUT + 4)  # the thread polls every 0.1 s, then diagnoses within 3 s
            model(torch.randn(4, 6)).sum().backward()


def test_a_wait_in_torchs_join_loop_is_watched_by_the_thread_which_ends_the_process(tmp_path):
    with pytest.raises(AssertionError, match=r"rank\(s\) \[0\] exited with code\(s\) \[1\]"):
        run_ranks(leave_early_then_sleep, 2, str(tmp_path), timeout=60, expect_failure=True)
    summary = (tmp_path / HANG_DIRECTORY / "summary_rank0.txt").read_text()
    assert "the next step of the ranks still in (torch's Join loop)" in summary, summary
    assert "rank 1 (" in summary and "outside lit_dp's collectives" in summary, summary


def test_the_summary_names_who_is_behind_and_who_is_silent():
    reports = {
        0: {"step": 7, "launched": 4, "state": "waiting"},
        1: {"step": 7, "launched": 2, "state": "outside lit_dp's collectives"},
        2: {"step": 6, "launched": 5, "state": "outside lit_dp's collectives"},
    }
    lines = behind_lines([0, 1, 2, 3], reports, (7, 3))
    assert lines == [
        "Behind: rank 1 never launched bucket 3 of step 7; its last was bucket 2.",
        "Behind: rank 2 never launched bucket 3 of step 7; its last was bucket 5 of step 6.",
        "Silent: rank(s) [3] (see above).",
    ]
    assert behind_lines([0, 1], {0: reports[0], 1: {"step": 7, "launched": 4, "state": "waiting"}}, (7, 3)) == [
        "Every rank that answered launched that bucket: the collective itself is stuck (network or backend)."
    ]
    assert behind_lines([0, 1, 2], reports, None) == ["Not in lit_dp's collectives: rank(s) [1, 2]."]
