"""A named communication hook of the tests' own, declared and registered by this module alone.

``comm_hook="chunked_allreduce"``: torch's ``allreduce_hook`` applied to pieces of each bucket
of at most ``chunked_allreduce.elements`` elements (one all-reduce per piece, so no message is
larger than that). It is what docs/comm_hooks.md describes: after ``import`` of this module,
the hook and its option work at every front door and in the recipes' Hydra schema.

Registration is process-wide: import this module only in a process of its own (the tests'
spawned ranks), never in the test runner, whose generated docs must list lit_dp's hooks only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lit_dp.options import EVERYWHERE, NamedHook, option, register_named_hook
from lit_dp.options.declare import count


@dataclasses.dataclass(frozen=True)
class ChunkedAllreduceOptions:
    elements: int = option(
        default=1024,
        help="the most elements one all-reduce carries",
        check=count(1),
        scope=EVERYWHERE,
        config=int,
    )


class ChunkedState:
    """The hook's state: its piece size, and the size of every piece it all-reduced."""

    def __init__(self, elements: int) -> None:
        self.elements = elements
        self.pieces: list[int] = []


class _Piece:
    """What ``allreduce_hook`` reads of a bucket: ``buffer()``, here a view into the real one."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor


def chunked_allreduce_hook(state: ChunkedState, bucket) -> torch.futures.Future:
    buffer = bucket.buffer()
    pieces = buffer.split(state.elements)  # views: each averaged in place
    state.pieces += [piece.numel() for piece in pieces]
    futures = [default_hooks.allreduce_hook(None, _Piece(piece)) for piece in pieces]
    return torch.futures.collect_all(futures).then(lambda _: buffer)


CHUNKED_ALLREDUCE = register_named_hook(
    NamedHook(
        name="chunked_allreduce",
        help="torch's allreduce_hook on pieces of at most chunked_allreduce.elements elements",
        build=lambda options: (ChunkedState(options.elements), chunked_allreduce_hook),
        describe=lambda options: f"chunked_allreduce_hook(elements={options.elements})",
        options=ChunkedAllreduceOptions,
    )
)
