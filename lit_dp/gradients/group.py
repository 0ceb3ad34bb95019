"""What lit_dp asks of a process group, whether torch created it or it is written in Python.

torch's bookkeeping functions (``dist.get_backend``, ``dist.get_process_group_ranks``,
``dist.get_global_rank``, a collective's global ``src=``) know only the groups that
``init_process_group`` and ``new_group`` registered. A group written in Python (a subclass of
``dist.ProcessGroup``, as torchft's are) is not registered, and its works may be Python objects
whose ``wait`` takes a timeout. torch DDP talks to any group through the group's own methods and
its works' futures; lit_dp does too, through these functions: ranks are the group's own
(``group.rank()``, ``group_src=``), and a Python group's works are awaited through their futures.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from lit_dp.gradients.waiting import Waiter

_NO_TIMEOUT = timedelta(0)  # c10d's Work::wait default (kNoTimeout)
_one_rank_shortcuts = True  # see as_if_many_ranks


def written_in_python(group: dist.ProcessGroup) -> bool:
    """A subclass of ``dist.ProcessGroup`` (torch's own groups are that class itself)."""
    return type(group) is not dist.ProcessGroup


def is_registered(group: dist.ProcessGroup) -> bool:
    """Whether torch's bookkeeping knows ``group`` (it was made by ``init_process_group`` or ``new_group``)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def backend_name(group: dist.ProcessGroup) -> str:
    """``dist.get_backend(group)`` for a registered group; otherwise the group's own name (its ``getBackendName``)."""
    return dist.get_backend(group) if is_registered(group) else group.name()


def device_of(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor for ``group``'s collectives lives: the current CUDA device for NCCL, else the CPU."""
    if backend_name(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def trivially_alone(group: dist.ProcessGroup) -> bool:
    """One rank of torch's own: its collectives change nothing, so lit_dp skips them, and no
    communication can overlap a backward. A group written in Python always gets them (it may do
    more than reduce: torchft's groups track their quorum)."""
    return _one_rank_shortcuts and group.size() == 1 and not written_in_python(group)


@contextmanager
def as_if_many_ranks() -> Iterator[None]:
    """Inside, a one-rank group is not ``trivially_alone``: models built and trained there take
    the path of many ranks (every bucket's collective, the buffer broadcast, graph breaks at bucket
    boundaries). One GPU cannot run two NCCL ranks; this is how it measures what each of many ranks
    pays (benchmarks/gpt_recipe.py's ``multi_rank`` variant)."""
    global _one_rank_shortcuts
    previous, _one_rank_shortcuts = _one_rank_shortcuts, False
    try:
        yield
    finally:
        _one_rank_shortcuts = previous


def wait(waiter: Waiter, work: dist.Work, group: dist.ProcessGroup, what: str = "") -> None:
    """Wait for ``work`` of ``group`` through ``waiter``.

    A Python group's work is waited for as torch's C++ side does it, ``wait(timeout)`` with the
    "no timeout" value (its Python ``wait`` may require the argument), then through its future.
    """
    if written_in_python(group):
        work.wait(_NO_TIMEOUT)
        waiter.wait_future(work.get_future(), what)
    else:
        waiter.wait(work, what)
