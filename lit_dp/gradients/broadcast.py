"""Making every rank of a group start from one rank's parameters and buffers (Paddle's ``sync_params_buffers``)."""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
import torch.distributed as dist
from torch import nn

BROADCAST_GROUP_BYTES = 128 * 1024 * 1024


def sync_params_buffers(
    module: nn.Module,
    group: dist.ProcessGroup | None = None,
    src_rank: int | None = None,
    fuse_params: bool = True,
    params_and_buffers_to_ignore: Collection[str] | None = None,
) -> None:
    """Broadcast ``module``'s parameters and buffers over ``group`` (default: the default group).

    ``src_rank`` is the global rank to copy from, one of the group's; by default the group's
    first rank (``dist.get_global_rank(group, 0)``), which is global rank 0 only when the group
    holds it, as DDP's initial broadcast. Tensors are coalesced per dtype and device into flat
    groups of at most 128 MB (``fuse_params=False`` sends them one by one). Parameters marked
    ``no_sync = True`` stay local, as do the parameters and buffers named in
    ``params_and_buffers_to_ignore`` (default: those torch DDP ignores, ``ddp_ignored``). Before anything is sent, the ranks compare names, shapes and
    dtypes with the source's; a difference raises the same error on every rank, naming the
    tensors and the ranks that differ.
    """
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if src_rank is None:
        src_rank = ranks[0]
    elif src_rank not in ranks:
        raise ValueError(f"src_rank={src_rank!r} is invalid: expected one of the group's global ranks {ranks}.")
    ignore = ddp_ignored(module) if params_and_buffers_to_ignore is None else params_and_buffers_to_ignore
    named = list(_tensors_to_sync(module, ignore))
    _check_same_structure(named, group, ranks, src_rank)

    tensors = [tensor for _, tensor in named]
    with torch.no_grad():
        if not fuse_params:
            for tensor in tensors:
                dist.broadcast(tensor, src=src_rank, group=group)
            return
        for chunk in _coalesced_chunks(tensors):
            flat = torch.cat([tensor.reshape(-1) for tensor in chunk])
            dist.broadcast(flat, src=src_rank, group=group)
            pieces = flat.split([tensor.numel() for tensor in chunk])
            torch._foreach_copy_(chunk, [piece.view_as(tensor) for piece, tensor in zip(pieces, chunk)])


def ddp_ignored(module: nn.Module) -> set[str]:
    """The fully qualified names of ``module``'s parameters and buffers that torch DDP neither
    reduces nor broadcasts: those ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    recorded on it (``_ddp_params_and_buffers_to_ignore``); scripts and libraries written for DDP set it."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def synced_parameters(module: nn.Module, ignore: Collection[str]) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters kept equal across ranks: all but those marked ``no_sync`` (Paddle's mark) or named in ``ignore``."""
    for name, param in module.named_parameters():
        if not getattr(param, "no_sync", False) and name not in ignore:
            yield name, param


def trainable_parameters(module: nn.Module, ignore: Collection[str]) -> list[tuple[str, nn.Parameter]]:
    """The parameters the reducer averages: trainable, not marked ``no_sync`` nor ignored (DDP's list), each once."""
    return [(name, param) for name, param in synced_parameters(module, ignore) if param.requires_grad]


def synced_buffers(module: nn.Module, ignore: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers broadcast from one rank: all but those named in ``ignore``."""
    for name, buffer in module.named_buffers():
        if name not in ignore:
            yield name, buffer


def _tensors_to_sync(module: nn.Module, ignore: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in synced_parameters(module, ignore):
        yield name, param.data
    yield from synced_buffers(module, ignore)


def _check_same_structure(
    named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, ranks: list[int], src_rank: int
) -> None:
    signature = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    gathered: list[list[tuple[str, tuple[int, ...], str]] | None] = [None] * len(ranks)
    dist.all_gather_object(gathered, signature, group=group)
    reference = gathered[ranks.index(src_rank)]
    differing = {ranks[i]: sig for i, sig in enumerate(gathered) if sig != reference}
    if not differing:
        return
    expected = {name: (shape, dtype) for name, shape, dtype in reference}
    lines = []
    for rank, sig in differing.items():
        actual = {name: (shape, dtype) for name, shape, dtype in sig}
        names = [name for name in sorted(expected.keys() | actual.keys()) if expected.get(name) != actual.get(name)]
        lines += [
            f"  {name}: rank {src_rank} has {_describe(expected.get(name))}, rank {rank} has {_describe(actual.get(name))}"
            for name in names
        ]
        if not names:
            lines.append(f"  rank {rank} registers the same tensors in a different order")
    raise RuntimeError(
        f"sync_params_buffers: the model differs between ranks (ranks {sorted(differing)} differ from rank "
        f"{src_rank}); every rank must build the same model:\n" + "\n".join(lines[:20])
    )


def _describe(entry: tuple[tuple[int, ...], str] | None) -> str:
    if entry is None:
        return "no such tensor"
    shape, dtype = entry
    return f"shape {list(shape)} {dtype}"


def _coalesced_chunks(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Tensors grouped by (dtype, device), each group cut into chunks of at most 128 MB."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same_kind in by_kind.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for tensor in same_kind:
            nbytes = tensor.numel() * tensor.element_size()
            if chunk and size + nbytes > BROADCAST_GROUP_BYTES:
                yield chunk
                chunk, size = [], 0
            chunk.append(tensor)
            size += nbytes
        if chunk:
            yield chunk
