"""A checkpoint as a tree: the entries each rank holds apart (``RankEntries``), walked and rebuilt.

A checkpoint is nested dicts, lists and tuples whose leaves are tensors and plain values. Most of
it is the same on every rank (data parallelism's model and optimizer). Some of it is not: a
``RankEntries`` dict holds only this rank's entries of a dict whose whole is spread over the ranks
(ZeRO's optimizer state, each parameter's on its owner; LocalSGD's models between syncs, each rank's
own). The job's checkpoint is every rank's tree with each ``RankEntries`` node replaced by the union
of all ranks' entries there; the writers (``lit_dp.checkpoint.full``, ``lit_dp.checkpoint.sharded``)
build that union without any rank holding it. A ``RankEntries`` node's keys are integers (a rank, a
parameter's index), and no rank gives a key another rank gives. A feature's per-rank entries sit
under a key named ``RANKS``, keyed by rank: a sharded checkpoint's reader takes its own rank's only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

Path = tuple  # the keys from the root to a node: str for a dict's, int for a list's or a RankEntries'
RANKS = "ranks"  # the key of a feature's RankEntries by rank (LocalSGD's models between syncs)


class RankEntries(dict):
    """This rank's entries of a dict spread over the ranks (see the module docstring); keys are integers."""


@dataclass(frozen=True)
class TensorSpec:
    """What a rank tells the writer of a tensor it will send: its shape, dtype and size in bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()

    def empty(self) -> torch.Tensor:
        """An uninitialised CPU tensor of this shape: no page of it is touched until written."""
        return torch.empty(self.shape, dtype=self.dtype)


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` rebuilt with ``fn(tensor)`` for each tensor in its dicts, lists and tuples: each container of
    the same type (``RankEntries`` kept; a module's ``state_dict()`` keeps its ``_metadata``); other objects
    are kept as they are, shared."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        rebuilt = {key: map_tensors(value, fn) for key, value in tree.items()}
        if type(tree) is dict:
            return rebuilt
        try:
            copy = type(tree)(rebuilt)
        except TypeError:  # a mapping that cannot be built from a dict: left as it is
            return tree
        if hasattr(tree, "_metadata"):  # torch's version record of each module of a state_dict()
            copy._metadata = tree._metadata  # type: ignore[attr-defined]
        return copy
    if isinstance(tree, list):
        return [map_tensors(value, fn) for value in tree]
    if isinstance(tree, tuple):
        values = [map_tensors(value, fn) for value in tree]
        return type(tree)(*values) if hasattr(tree, "_fields") else type(tree)(values)
    return tree


def tensors(tree: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor of ``tree`` with its path, depth first, in the containers' own order."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from tensors(value, path + (key,))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from tensors(value, path + (index,))


def rank_entries(tree: Any, path: Path = ()) -> Iterator[tuple[Path, RankEntries]]:
    """Every ``RankEntries`` node of ``tree`` with its path (none is looked for inside another)."""
    if isinstance(tree, RankEntries):
        yield path, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from rank_entries(value, path + (key,))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from rank_entries(value, path + (index,))


def only_rank_entries(tree: Any) -> Any:
    """``tree`` with only its ``RankEntries`` nodes and the containers on their way (a list's other elements None,
    so that paths stay as they were): what a rank other than 0 contributes to a full checkpoint."""
    if isinstance(tree, RankEntries):
        return tree
    if isinstance(tree, Mapping):
        kept = {key: only_rank_entries(value) for key, value in tree.items()}
        return {key: value for key, value in kept.items() if value is not None} or None
    if isinstance(tree, list):
        kept_list = [only_rank_entries(value) for value in tree]
        return kept_list if any(value is not None for value in kept_list) else None
    return None


def plain(tree: Any) -> Any:
    """``tree`` with every ``RankEntries`` a plain dict (nothing else copied): what a file may hold, so that
    reading it needs no lit_dp."""
    if isinstance(tree, RankEntries):
        return {key: plain(value) for key, value in tree.items()}
    if type(tree) is dict:
        return {key: plain(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [plain(value) for value in tree]
    return tree


def get(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def specs(tree: Any) -> Any:
    """``tree`` with each tensor a ``TensorSpec``: what it is, without its bytes (small, picklable)."""
    return map_tensors(tree, TensorSpec.of)


def placeholders(tree: Any) -> Any:
    """A tree of ``specs`` with each spec an uninitialised tensor of its shape (``TensorSpec.empty``)."""
    if isinstance(tree, TensorSpec):
        return tree.empty()
    if isinstance(tree, Mapping):
        return {key: placeholders(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [placeholders(value) for value in tree]
    if isinstance(tree, tuple):
        values = [placeholders(value) for value in tree]
        return type(tree)(*values) if hasattr(tree, "_fields") else type(tree)(values)
    return tree


def spec_order(tree: Any) -> list[TensorSpec]:
    """The specs of a ``specs`` tree in ``tensors``' order: the order a rank sends its tensors in."""
    found: list[TensorSpec] = []

    def walk(node: Any) -> None:
        if isinstance(node, TensorSpec):
            found.append(node)
        elif isinstance(node, Mapping):
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(tree)
    return found
