"""The multi-process harness itself: a hung or crashed rank fails the test by name, never hangs it."""

import os
import time

import pytest

from tests.helpers.distributed import run_ranks


def rank_one_hangs(rank):
    if rank == 1:
        time.sleep(3600)
    return rank


def rank_one_dies(rank):
    if rank == 1:
        os._exit(3)
    return rank


def rank_one_raises(rank):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


@pytest.mark.slow
def test_a_hung_rank_is_named_and_killed():
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] did not finish within 10s"):
        run_ranks(rank_one_hangs, 2, timeout=10)
    assert time.monotonic() - started < 30


def test_a_dead_rank_is_named_with_its_exit_code():
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] exited with code\(s\) \[3\]"):
        run_ranks(rank_one_dies, 2, timeout=60)


def test_a_raising_rank_shows_its_traceback():
    with pytest.raises(AssertionError, match=r"rank 1 failed:(.|\n)*ValueError: boom on rank 1"):
        run_ranks(rank_one_raises, 2, timeout=60)
