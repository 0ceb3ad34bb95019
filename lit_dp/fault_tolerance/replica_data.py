"""``ReplicaBatches``: a dataset dealt step by step to the replica groups present (torchft).

Under fault tolerance the replica groups that train a step are known only once its quorum is
in, and change when one fails or recovers. A sampler that splits the data by a fixed world size
(torch's ``DistributedSampler``, torchft's own) would then leave the samples of a missing
replica untrained and, when it comes back, have it start its shard over. Here the data is one
stream shared by every replica instead, and each step takes the next slice of it:

- the stream is the dataset's epochs one after the other, each shuffled by ``seed + epoch``
  (as ``DistributedSampler`` does) or in order;
- a step with ``n`` replica groups and ``accumulate`` micro-batches takes the next
  ``n * accumulate * batch_size`` samples: micro-batch ``j`` of the replica of rank ``r`` in
  the quorum reads ``batch_size`` samples at ``start + (j * n + r) * batch_size``;
- the position moves on only when the step commits. A discarded step's samples are read again
  by the next step, dealt to whoever is present then.

So every sample of an epoch is trained once, by one replica, in committed steps, however the
replicas come and go: nothing is repeated or skipped because of a failure.

In LocalSGD's local phase across replica groups the steps between two syncs take no quorum
(``start_local_step``): each is dealt by the last quorum's members and ranks, and its samples are
taken at once, since no vote discards a step of a group's own. A failed sync keeps the period's
work, so its samples stay taken. Members change only at a sync's quorum, which deals the next
period; a group that dies between syncs takes the rest of its slices of the period with it (its
work is lost with it), and one that joins at a sync is dealt its slices from the next period on. A step may straddle
two epochs (the stream has no last, smaller batch); ``step_ends_epoch`` says when it does.

The position is the samples committed so far plus the steps not yet known to have committed
(the Manager's step count says: a step committed if the count moved past it). It travels with
the rest of a replica's state to a recovering one (``state_dict``), so every participant of a
quorum deals the same way. Plain PyTorch with torchft::

    batches = lit_dp.ReplicaBatches(dataset, batch_size=32, seed=0)
    manager.register_state_dict_fn("data", batches.load_state_dict, batches.state_dict)
    while manager.current_step() < steps:
        optimizer.zero_grad()  # torchft's OptimizerWrapper: the step's quorum
        manager.wait_quorum()  # then current_step() is the quorum's (a recovering replica's jumps to it)
        batches.start_step(manager.current_step(), manager.participating_rank(), manager.num_participants())
        inputs, targets = batches.next_batch()
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate


class ReplicaBatches:
    """The samples of a map-style ``dataset`` dealt to the replica groups of each step (see the module docstring).

    Args:
        dataset: any map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per micro-batch and replica group.
        shuffle: each epoch in its own order (``seed + epoch``), else in the dataset's order.
        seed: the same on every replica.
        collate_fn: makes a batch of samples (torch's ``default_collate``).
        accumulate: micro-batches per step (gradient accumulation).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        accumulate: int = 1,
    ) -> None:
        if not isinstance(dataset, Sized) or len(dataset) == 0:
            raise ValueError(f"ReplicaBatches: dataset={dataset!r} is invalid: expected a map-style dataset with samples.")
        for name, value in (("batch_size", batch_size), ("accumulate", accumulate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ReplicaBatches: {name}={value!r} is invalid: expected a positive integer.")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.collate_fn = collate_fn or default_collate
        self.accumulate = accumulate
        self._offset = 0  # samples of the stream taken by steps known to have committed
        self._pending: list[tuple[int, int]] = []  # (step, samples) of steps not yet known to have committed
        self._plan: tuple[int, int, int | None, int] | None = None  # (start, participants, rank, step)
        self._micro = 0
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def epoch_length(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    @property
    def position(self) -> int:
        """Samples of the stream taken by the steps known to have committed."""
        return self._offset

    @property
    def epoch(self) -> int:
        """The epoch the next step reads from (counted from 0)."""
        return self._offset // self.epoch_length

    def start_step(self, step: int, rank: int | None, participants: int) -> None:
        """Plan step ``step`` (the Manager's count of committed steps) for this replica, of quorum rank
        ``rank`` among ``participants``. ``rank=None``: not taking part (torchft's recovering
        replica, whose gradients are zeroed): it reads rank 0's samples and deals nothing."""
        if participants < 1 or (rank is not None and not 0 <= rank < participants):
            raise ValueError(
                f"ReplicaBatches.start_step: rank={rank!r} of participants={participants!r} is invalid: expected "
                "0 <= rank < participants (or rank=None for a replica that does not take part)."
            )
        self._settle(step)
        self._plan = (self._offset, participants, rank, step)
        self._micro = 0
        self._pending.append((step, self.samples_per_step(participants)))

    def start_local_step(self, step: int, rank: int | None, participants: int) -> None:
        """Plan a step that no vote decides (LocalSGD's local phase across replica groups: a group's own
        step), dealt as ``start_step`` deals by the last quorum (``step``: the Manager's count, which settles
        the steps planned before), its samples taken at once: nothing discards it."""
        self.start_step(step, rank, participants)
        self._offset += self._pending.pop()[1]

    def samples_per_step(self, participants: int) -> int:
        return participants * self.accumulate * self.batch_size

    def next_batch(self) -> Any:
        """This replica's next micro-batch of the planned step."""
        if self._plan is None:
            raise RuntimeError("ReplicaBatches.next_batch() before start_step(): the step's quorum decides the batch.")
        if self._micro >= self.accumulate:
            raise RuntimeError(
                f"ReplicaBatches.next_batch(): the step already had its accumulate={self.accumulate} micro-batches; "
                "call start_step() for the next step."
            )
        start, participants, rank, _ = self._plan
        first = start + (self._micro * participants + (rank or 0)) * self.batch_size
        self._micro += 1
        return self.collate_fn([self.dataset[int(i)] for i in self.indices(first, self.batch_size)])

    def indices(self, first: int, count: int) -> torch.Tensor:
        """The dataset indices of stream positions ``first`` .. ``first + count - 1``."""
        positions = torch.arange(first, first + count)
        epochs = positions // self.epoch_length
        out = torch.empty(count, dtype=torch.long)
        for epoch in epochs.unique().tolist():
            chosen = epochs == epoch
            out[chosen] = self._order(epoch)[positions[chosen] % self.epoch_length]
        return out

    def step_ends_epoch(self) -> bool:
        """Whether the planned step, once committed, completes an epoch (its samples reach or cross its end)."""
        if self._plan is None:
            return False
        start, participants, _, _ = self._plan
        end = start + self.samples_per_step(participants)
        return end // self.epoch_length > start // self.epoch_length

    def _settle(self, step: int) -> None:
        """Steps planned before ``step`` committed (the count moved past them); one planned at ``step`` did not."""
        committed = [samples for planned, samples in self._pending if planned < step]
        self._offset += sum(committed)
        self._pending = [(planned, samples) for planned, samples in self._pending if planned > step]

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) > 1:
                self._orders.pop(min(self._orders))
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._orders[epoch] = torch.randperm(self.epoch_length, generator=generator)
            else:
                self._orders[epoch] = torch.arange(self.epoch_length)
        return self._orders[epoch]

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self._offset, "pending": list(self._pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A peer's position. Steps this replica planned after the peer's last one stay pending: under
        torchft's asynchronous quorum a recovering replica loads the state taken at the start of a
        step it already planned (without taking part), and that step commits for it too."""
        received = [tuple(entry) for entry in state["pending"]]
        last = max((step for step, _ in received), default=-1)
        self._offset = int(state["offset"])
        self._pending = received + [(step, samples) for step, samples in self._pending if step > last]
