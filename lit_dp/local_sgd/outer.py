"""What LocalSGD keeps between syncs: each fragment's buckets with their snapshots, and the outer optimizer.

A snapshot is a deltas' bucket's parameters at its fragment's last sync; with ``outer="nesterov"``
(DiLoCo) ``torch.optim.SGD`` steps the snapshots with the mean delta as their gradient, and every
rank then takes them as its parameters. Checkpoints hold the snapshot and momentum per parameter
(CPU tensors, the same on every rank), so that a resumed run can rebuild the buckets in any size;
with error feedback, each rank's residual per parameter too (``residuals``), which is its own.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_dp.gradients.buckets import assign_group_by_size
from lit_dp.local_sgd.transport import DELTA, FROM_FIRST_RANK, MEAN, SyncBucket, state_device
from lit_dp.local_sgd.wire import WireFormat


class OuterState:
    """Each fragment's buckets (the buffers' with the last), their snapshots, and the outer optimizer."""

    def __init__(
        self,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        fragment_indices: list[list[int]],
        bucket_bytes: int,
        *,
        wire: WireFormat | None,
        error_feedback: bool,
        offload: bool,
        outer: str,
        outer_settings: dict[str, float],
        broadcast_other_buffers: bool,
        revertible: bool = False,
        resumed: dict[str, Any] | None = None,
    ) -> None:
        """Snapshots taken now (every rank must hold the same parameters), or ``resumed`` from a checkpoint.
        ``broadcast_other_buffers``: the integer buffers (BatchNorm's counts) travel from the first rank;
        False keeps each rank's (across replica groups, each group keeps its own). ``error_feedback``: the
        deltas' buckets keep what ``wire`` drops, starting at zero; ``revertible``: a sync may be voided after it
        started (across replica groups), which then gives the residuals back as it found them (``drop``)."""
        self._param_index = {id(p): index for index, p in enumerate(params)}
        float_buffers = [b for b in buffers if b.is_floating_point()]
        other_buffers = [b for b in buffers if not b.is_floating_point()]
        self.fragments: list[list[SyncBucket]] = [[] for _ in fragment_indices]
        groups = [(f, DELTA, [params[i] for i in indices]) for f, indices in enumerate(fragment_indices)]
        last = len(self.fragments) - 1
        groups += [(last, MEAN, float_buffers)]
        if broadcast_other_buffers:
            groups += [(last, FROM_FIRST_RANK, other_buffers)]
        for fragment, kind, tensors in groups:
            if not tensors:
                continue
            for indices in assign_group_by_size(tensors, [False] * len(tensors), [bucket_bytes]):
                bucket_tensors = [tensors[i] for i in indices]
                device = state_device(bucket_tensors[0].device, offload)
                self.fragments[fragment].append(SyncBucket(kind, bucket_tensors, wire, device, error_feedback, revertible))
        self.optimizer: torch.optim.SGD | None = None
        snapshots = [b.snapshot for b in self.buckets() if b.snapshot is not None]
        if outer == "nesterov" and snapshots:
            # Nesterov needs momentum (torch's SGD refuses it without): momentum 0 is plain outer SGD.
            nesterov = outer_settings["momentum"] > 0
            self.optimizer = torch.optim.SGD(snapshots, nesterov=nesterov, **outer_settings)
        if resumed is not None:
            self._restore(resumed)

    def buckets(self) -> list[SyncBucket]:
        return [bucket for fragment in self.fragments for bucket in fragment]

    def apply(self, fragment: int, participants: int, keep: float) -> None:
        """A fragment's summed payloads, divided by the ranks that took part, become its parameters: their
        mean, or the snapshot stepped by the outer optimizer; ``keep``: the local parameters' weight."""
        buckets = self.fragments[fragment]
        outer = self.optimizer is not None
        for bucket in buckets:
            if participants:
                bucket.apply(participants, outer, keep)
            else:
                bucket.drop()
        if outer and participants:
            # Steps only the snapshots with a pseudo-gradient: this fragment's (and its momentum).
            self.optimizer.step()
            for bucket in buckets:
                bucket.take_snapshot(keep)

    def drop(self, fragment: int) -> None:
        """Nothing of a fragment's sync is applied (its residuals back as the sync found them)."""
        for bucket in self.fragments[fragment]:
            bucket.drop()

    def wire_bytes(self, fragment: int, ranks: int) -> int:
        """The bytes of a fragment's sync on ``ranks`` ranks as they travel (``SyncBucket.wire_bytes``)."""
        return sum(bucket.wire_bytes(ranks) for bucket in self.fragments[fragment])

    def restore_parameters(self) -> None:
        """Every synced parameter set to its snapshot: the model of its fragment's last sync."""
        for bucket in self.buckets():
            if bucket.snapshot is None:
                continue
            for tensor, snapshot in zip(bucket.tensors, bucket.snapshot.split(bucket.numels)):
                tensor.detach().copy_(snapshot.view_as(tensor).to(tensor.device))

    def state_dict(self) -> dict[str, Any]:
        """The snapshot and, with an outer optimizer, its momentum (None without), one CPU tensor per parameter."""
        count = len(self._param_index)
        snapshots: list[torch.Tensor | None] = [None] * count
        momenta: list[torch.Tensor | None] = [None] * count
        optimizer_state = self.optimizer.state if self.optimizer is not None else {}
        for bucket in self.buckets():
            if bucket.snapshot is None:
                continue
            momentum = optimizer_state.get(bucket.snapshot, {}).get("momentum_buffer")
            buffers = momentum.split(bucket.numels) if momentum is not None else [None] * len(bucket.numels)
            for tensor, snapshot, buffer in zip(bucket.tensors, bucket.snapshot.split(bucket.numels), buffers):
                index = self._param_index[id(tensor)]
                snapshots[index] = snapshot.detach().cpu().clone()
                momenta[index] = buffer.cpu().clone() if buffer is not None else None
        return {"snapshot": snapshots, "momentum": momenta}

    def residuals(self) -> list[torch.Tensor | None]:
        """This rank's error-feedback residual, one CPU tensor per parameter (None for a parameter whose bucket
        has none: error feedback off, or its dtype travels unchanged)."""
        residuals: list[torch.Tensor | None] = [None] * len(self._param_index)
        for bucket in self.buckets():
            if bucket.residual is None:
                continue
            for tensor, residual in zip(bucket.tensors, bucket.residual.split(bucket.numels)):
                residuals[self._param_index[id(tensor)]] = residual.cpu().clone()
        return residuals

    def restore_residuals(self, residuals: list[torch.Tensor | None] | None) -> None:
        """This rank's residuals from ``residuals`` (a checkpoint's), or zero (None: a rank that joins, heals,
        or resumes without its own); a parameter saved without one starts at zero too."""
        if residuals is not None and len(residuals) != len(self._param_index):
            raise ValueError(
                f"the LocalSGD error-feedback state holds {len(residuals)} parameters, the model "
                f"{len(self._param_index)}: expected a checkpoint of this model."
            )
        for bucket in self.buckets():
            if bucket.residual is None:
                continue
            saved = [residuals[self._param_index[id(t)]] if residuals is not None else None for t in bucket.tensors]
            zeros = [torch.zeros(n, dtype=bucket.residual.dtype) for n in bucket.numels]
            pieces = [s.reshape(-1) if s is not None else zero for s, zero in zip(saved, zeros)]
            bucket.residual.copy_(torch.cat(pieces))

    def _restore(self, state: dict[str, Any]) -> None:
        """A checkpoint's snapshot and momentum (per parameter) into the buckets' flat tensors."""
        if len(state["snapshot"]) != len(self._param_index):
            raise ValueError(
                f"the LocalSGD outer state holds {len(state['snapshot'])} parameters, the model "
                f"{len(self._param_index)}: expected a checkpoint of this model."
            )
        for bucket in self.buckets():
            if bucket.snapshot is None:
                continue
            indices = [self._param_index[id(t)] for t in bucket.tensors]
            bucket.snapshot.copy_(torch.cat([state["snapshot"][i].reshape(-1) for i in indices]))
            momenta = [state["momentum"][i] for i in indices]
            if self.optimizer is not None and all(m is not None for m in momenta):
                buffer = torch.cat([m.reshape(-1) for m in momenta]).to(bucket.snapshot.device)
                self.optimizer.state[bucket.snapshot]["momentum_buffer"] = buffer

    def held_bytes(self) -> dict[str, dict[str, int]]:
        """The memory held, by what (``snapshot``; ``momentum``; ``error_feedback``, the residuals;
        ``sync``, payloads of a sync in flight) and by device (``str(device)``), in bytes."""
        held: dict[str, dict[str, int]] = {"snapshot": {}, "momentum": {}, "error_feedback": {}, "sync": {}}

        def add(what: str, tensor: torch.Tensor) -> None:
            device = str(tensor.device)
            held[what][device] = held[what].get(device, 0) + tensor.numel() * tensor.element_size()

        for bucket in self.buckets():
            if bucket.snapshot is not None:
                add("snapshot", bucket.snapshot)
            if bucket.residual is not None:
                add("error_feedback", bucket.residual)
            for tensor in bucket.in_flight():
                add("sync", tensor)
        for state in self.optimizer.state.values() if self.optimizer is not None else ():
            if state.get("momentum_buffer") is not None:
                add("momentum", state["momentum_buffer"])
        return held
