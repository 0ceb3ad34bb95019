"""A collective's tensors are kept until Gloo's worker lets go of them (``lit_dp.job.in_flight``),
so that the worker never frees a tensor's Python object: doing so as the interpreter ends aborts
the process (pytorch issue 190489). Real Gloo processes; a weak reference's callback says which
thread freed the tensor."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from lit_dp.job import in_flight
from tests.helpers.distributed import run_ranks

LATE_SECONDS = 1.0  # rank 1 joins the all-reduce this late: rank 0's worker holds the tensor meanwhile


def _all_reduce_joined_late(rank: int, kept: bool) -> tuple[int | None, str]:
    """Rank 0: how many collectives ``in_flight`` held while the all-reduce waited for rank 1, and
    which thread freed its tensor once the worker let go of it."""
    import torch.distributed as dist

    from lit_dp import init_parallel_env

    init_parallel_env()
    if rank == 1:
        time.sleep(LATE_SECONDS)
    freed_on: list[str] = []
    tensor = torch.ones(3)
    probe = weakref.ref(tensor, lambda _: freed_on.append(threading.current_thread().name))
    dist.all_reduce(tensor, async_op=True)  # its work dropped, as a feature's exchange dropped unread
    if kept:
        in_flight.keep(tensor)
    del tensor
    held_meanwhile = in_flight.held() if rank == 0 else None
    in_flight.wait_before_exit(timeout=60)
    deadline = time.monotonic() + 60  # a dropped tensor is freed by the worker, whenever it gets to it
    while probe() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return held_meanwhile, freed_on[0] if freed_on else "not freed"


@pytest.mark.timeout(300)
def test_a_kept_tensor_is_held_while_its_collective_runs_and_freed_by_python_not_by_the_worker():
    results = run_ranks(_all_reduce_joined_late, 2, True, timeout=120)
    assert results[0] == (1, threading.main_thread().name), results
    assert results[1][1] == threading.main_thread().name, results


@pytest.mark.timeout(300)
def test_without_it_the_worker_frees_the_tensor_which_is_what_aborts_an_ending_process():
    # The hazard on this torch: if the main thread frees it, torch no longer hands the tensor's
    # Python object to Gloo's worker and `lit_dp.job.in_flight` can go.
    results = run_ranks(_all_reduce_joined_late, 2, False, timeout=120)
    assert results[0][1] not in (threading.main_thread().name, "not freed"), results


def test_a_tensor_only_python_holds_is_let_go_at_once():
    tensor = torch.ones(2)
    in_flight.keep(tensor)
    assert in_flight.held() == 0
    started = time.monotonic()
    in_flight.wait_before_exit()
    assert time.monotonic() - started < in_flight.EXIT_WAIT_SECONDS
