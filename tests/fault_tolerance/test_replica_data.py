"""``ReplicaBatches``: the data dealt step by step to the replica groups present (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from lit_dp.fault_tolerance.replica_data import ReplicaBatches

SIZE, BATCH = 40, 3


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(SIZE))


def replicas(count: int, **kwargs) -> list[ReplicaBatches]:
    return [ReplicaBatches(dataset(), BATCH, seed=5, **kwargs) for _ in range(count)]


def take_step(members: dict[int, ReplicaBatches], step: int, accumulate: int = 1) -> list[int]:
    """Every member plans ``step``; the samples they read, in quorum-rank order."""
    read = []
    for rank, batches in enumerate(members.values()):
        batches.start_step(step, rank, len(members))
        for _ in range(accumulate):
            (samples,) = batches.next_batch()
            read.append((rank, samples.tolist()))
    return [i for _, samples in sorted(read, key=lambda item: item[0]) for i in samples]


def test_committed_steps_read_each_sample_of_an_epoch_once_whoever_is_present():
    groups = replicas(3)
    # (replica groups present, committed?): a replica leaves, a step is discarded, one comes back.
    schedule = [((0, 1, 2), True), ((0, 1, 2), False), ((0, 1), True), ((0,), True), ((0, 2), False), ((0, 2), True)]
    schedule += [((0, 1, 2), True)] * 8
    step, trained, previous = 0, [], (0, 1, 2)
    for present, committed in schedule:
        for group in set(present) - set(previous):  # behind: torchft heals it with a peer's state
            groups[group].load_state_dict(groups[previous[0]].state_dict())
        read = take_step({g: groups[g] for g in present}, step)
        previous = present
        if committed:
            trained += read
            step += 1
    assert trained == groups[0].indices(0, len(trained)).tolist()
    first_epoch = trained[:SIZE]
    assert sorted(first_epoch) == list(range(SIZE)) and first_epoch != list(range(SIZE))  # each once, shuffled
    assert sorted(trained[SIZE : 2 * SIZE]) == list(range(SIZE)) and trained[SIZE : 2 * SIZE] != first_epoch


def test_micro_batches_of_a_step_take_consecutive_slices_and_the_epoch_end_is_reported():
    groups = replicas(2, accumulate=2, shuffle=False)
    ends = []
    for step in range(5):
        read = take_step(dict(enumerate(groups)), step, accumulate=2)
        # micro-batch 0 of ranks 0 and 1, then micro-batch 1 of ranks 0 and 1: 12 consecutive samples
        assert sorted(read) == sorted(i % SIZE for i in range(step * 12, step * 12 + 12))
        ends.append(groups[0].step_ends_epoch())
    assert ends == [False, False, False, True, False]  # samples 36..47 cross the end of epoch 0 (40)
    with pytest.raises(RuntimeError, match="already had its accumulate=2 micro-batches"):
        groups[0].next_batch()


def test_a_replica_recovering_under_the_asynchronous_quorum_keeps_the_step_it_planned():
    peer, recovering = replicas(2)
    for step in range(3):
        take_step({0: peer}, step)
    # Step 3: the peer's state is taken at the start of the step (its step 2 not yet settled), the
    # recovering replica planned step 3 without taking part, then loads that state and both commit.
    state = peer.state_dict()
    peer.start_step(3, 0, 1)
    recovering.start_step(3, None, 1)
    recovering.load_state_dict(state)
    for batches in (peer, recovering):
        batches.start_step(4, 0, 1)
    assert peer.position == recovering.position == 4 * BATCH


def test_what_cannot_be_dealt_is_refused():
    with pytest.raises(ValueError, match="batch_size=0 is invalid"):
        ReplicaBatches(dataset(), 0)
    with pytest.raises(ValueError, match="dataset=.* is invalid"):
        ReplicaBatches(TensorDataset(torch.arange(0)), 2)
    batches = ReplicaBatches(dataset(), 2)
    with pytest.raises(RuntimeError, match="before start_step"):
        batches.next_batch()
    with pytest.raises(ValueError, match="rank=2 of participants=2 is invalid"):
        batches.start_step(0, 2, 2)
