"""Where lit_dp keeps its own bookkeeping: the job's rendezvous store, one namespace per feature and group.

Outside the collectives, lit_dp's hang watchdog and Join talk through the store the default
group was built on (rank 0's ``TCPStore``, or torchrun's agent's): a rank that hangs in a
collective can still answer there.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

# Longer descriptions of a group's members become a digest in store keys.
_MAX_MEMBERS_TEXT = 64


def rendezvous_store() -> dist.Store | None:
    """The default group's store (the rendezvous TCPStore behind torch's prefix), for lit_dp's
    bookkeeping outside the collectives (the hang watchdog, Join's verdicts); None without a group.

    Keys written there must stay in their own ``lit_dp/<feature>/`` namespace, per group
    (``group_store_prefix``) when they concern one group.
    """
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # a group built without a store (e.g. torch's "fake" backend)
        return None


def group_store_prefix(feature: str, group: dist.ProcessGroup | None = None) -> str:
    """``lit_dp/<feature>/ranks_<members>``: where ``feature`` keeps the store keys of ``group``
    (default: the default group) apart from every other group's.

    lit_dp numbers its hang watchdogs and Join contexts with counters in the rendezvous store,
    which every group of the job shares: each member bumps a counter once per instance, and the
    count divided by the group's size numbers the instance alike on every member. Two disjoint
    groups bumping one counter would mix their counts. Groups with the same members share a
    prefix, which is safe: the same ranks create their instances in the same order.
    """
    ranks = sorted(dist.get_process_group_ranks(group or dist.group.WORLD))
    return f"lit_dp/{feature}/ranks_{_describe_members(ranks)}"


def _describe_members(ranks: list[int]) -> str:
    """``0-3``, ``0_2_4``, ``0-1_4-5``: runs of consecutive ranks; a digest when that grows long."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = "_".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    if len(text) <= _MAX_MEMBERS_TEXT:
        return text
    return f"{len(ranks)}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
