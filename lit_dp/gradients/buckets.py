"""Bucket assignment: which gradients travel together in one all-reduce.

Pure functions, tested without processes: Paddle's ``core.eager_assign_group_by_size``, the owners
of sharding, and the fragments streaming LocalSGD syncs in turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lit_dp.options.declare import megabytes

MB = 1024 * 1024


def megabytes_to_bytes(option: str, size: float) -> int:
    """Validate a bucket size given in MB (fractions allowed) and convert it to bytes."""
    return max(1, int(megabytes(option, size) * MB))


def assign_group_by_size(
    tensors: Sequence[torch.Tensor],
    is_sparse: Sequence[bool],
    group_size_limits: Sequence[int],
) -> list[list[int]]:
    """Group tensor indices into buckets bounded in bytes.

    Tensors are taken in the given (forward) order. Each (dtype, device) pair fills its own open
    group, so groups never mix dtypes or devices; a group closes once its size reaches its limit
    (the tensor that crosses the limit stays in it). The first group closed for a pair is bounded
    by ``group_size_limits[0]``, later ones by the next limit, the last limit repeating. Each
    sparse tensor is a group of its own. Groups come back ordered by their first index.

    The first group in forward order is the last one reduced in backward; a small first limit
    (Paddle's ``last_comm_buffer_size``) keeps the communication left after backward short.

    Args:
        tensors: the tensors (usually parameters) in forward order.
        is_sparse: one flag per tensor: its gradient is sparse.
        group_size_limits: byte limits, e.g. ``[1 * MB, 25 * MB]``.

    Returns:
        Lists of indices into ``tensors``; every index appears exactly once.
    """
    if len(is_sparse) != len(tensors):
        raise ValueError(
            f"is_sparse has {len(is_sparse)} entries but tensors has {len(tensors)}: expected one flag per tensor."
        )
    if not group_size_limits:
        raise ValueError("group_size_limits is empty: expected at least one positive byte limit.")
    for limit in group_size_limits:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(
                f"group_size_limits={list(group_size_limits)!r} is invalid: expected positive integers (bytes)."
            )

    groups: list[list[int]] = []
    open_groups: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    limit_index: dict[tuple[torch.dtype, torch.device], int] = {}
    last_limit = len(group_size_limits) - 1
    for index, tensor in enumerate(tensors):
        if is_sparse[index]:
            groups.append([index])
            continue
        key = (tensor.dtype, tensor.device)
        members, size = open_groups.get(key, ([], 0))
        members.append(index)
        size += tensor.numel() * tensor.element_size()
        level = limit_index.setdefault(key, 0)
        if size >= group_size_limits[level]:
            groups.append(members)
            limit_index[key] = min(level + 1, last_limit)
            open_groups.pop(key, None)
        else:
            open_groups[key] = (members, size)
    groups.extend(members for members, _ in open_groups.values())
    groups.sort(key=lambda group: group[0])
    return groups


def assign_owners(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that owns each tensor under sharding, balanced by bytes (parameter-wise).

    Largest first, each tensor goes to the rank holding the fewest bytes so far (the lowest such
    rank on a tie; equal sizes keep their given order): the greedy rule of Paddle's
    ``DygraphShardingOptimizer._partition_parameters`` and torch's ``ZeroRedundancyOptimizer``.
    A rank receives a tensor only while it holds no more than the average, so no rank ends more
    than one tensor's bytes above an even split: ``max(load) <= sum(sizes) / world_size +
    max(sizes)``. A pure function of its inputs, so every rank computes the same owners.

    Args:
        sizes: bytes per tensor, e.g. ``numel * element_size`` of each parameter.
        world_size: how many ranks share the tensors.

    Returns:
        One rank in ``[0, world_size)`` per tensor, in the order of ``sizes``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid: expected an integer >= 1.")
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = loads.index(min(loads))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def assign_fragments(nbytes: list[int], fragments: int) -> list[list[int]]:
    """Indices ``0..len(nbytes)-1`` cut into ``fragments`` contiguous, non-empty runs of about equal
    bytes: each boundary goes where the running total comes closest to its share of the whole."""
    if fragments > max(len(nbytes), 1):
        raise ValueError(
            f"fragments={fragments} is invalid for a model of {len(nbytes)} trainable tensors: a fragment holds whole "
            "tensors; expected at most as many fragments as tensors."
        )
    total, groups, start, running = sum(nbytes), [], 0, 0
    for f in range(fragments - 1):
        target = total * (f + 1) / fragments
        running += nbytes[start]
        end = start + 1
        # Grow while that brings the running total closer to the target, leaving a tensor per fragment to come.
        while end < len(nbytes) - (fragments - 1 - f) and abs(running + nbytes[end] - target) <= abs(running - target):
            running += nbytes[end]
            end += 1
        groups.append(list(range(start, end)))
        start = end
    groups.append(list(range(start, len(nbytes))))
    return groups


def shard_owners(
    named: list[tuple[str, torch.nn.Parameter]], sparse_ids: set[int], stage: int | None, world_size: int
) -> list[int] | None:
    """Each parameter's owning rank, balanced by bytes (``assign_owners``); None without sharding."""
    if stage is None:
        return None
    sparse = [name for name, param in named if id(param) in sparse_ids]
    if stage == 2 and sparse:
        raise ValueError(
            f"sharding_stage=2 with sparse gradients (parameter {sparse[0]!r}, an embedding built with sparse=True) "
            "is invalid: a sparse gradient has no fixed layout to reduce to its owner's segment; expected "
            "sharding_stage=1, or sparse=False."
        )
    return assign_owners([param.numel() * param.element_size() for _, param in named], world_size)
