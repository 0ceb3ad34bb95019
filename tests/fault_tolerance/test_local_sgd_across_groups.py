"""``lit_dp.LocalSGD`` across torchft's replica groups: the divisor, a failed sync, a peer's snapshot.

A replica-group process group (what ``FaultTolerantGroup`` and ``HierarchicalGroup`` offer LocalSGD:
``size``, ``allreduce``, ``step_failed``, ``void_last_commit``, ``for_syncs``) written here around
one process: the other replica group is played by what its all-reduce adds. The end-to-end runs,
with real groups and a real lighthouse, are tests/test_fault_tolerance_groups_launch.py's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import lit_dp


class _Done(dist.Work):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(tensors)

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class _ReplicaGroups(dist.ProcessGroup):
    """This replica group and ``present - 1`` others whose deltas are zero (they did not move since
    the last sync), each counted as taking part; ``failing``: the all-reduce fails as torchft's does
    (zeros, the step errored)."""

    def __init__(self, present: int = 2) -> None:
        super().__init__(0, 1)
        self.present = present
        self.failing = False
        self.voided = 0

    def size(self) -> int:
        return self.present

    def rank(self) -> int:
        return 0

    def allreduce(self, tensors, opts) -> dist.Work:
        for tensor in tensors:
            if self.failing:
                tensor.zero_()
            elif tensor.numel() == 1:  # the count of those taking part (the payloads are larger): each adds 1
                tensor.add_(self.present - 1)
        return _Done(tensors)

    def step_failed(self) -> bool:
        return self.failing

    def void_last_commit(self) -> None:
        self.voided += 1

    def for_syncs(self) -> _ReplicaGroups:
        return self


def _moved(net: nn.Module, by: float) -> list[torch.Tensor]:
    """The parameters before, then each moved by ``by`` (a local step)."""
    before = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(by)
    return before


def test_a_sync_divides_by_the_groups_that_took_part():
    for present in (1, 2, 3):
        net = nn.Linear(3, 2)
        local_sgd = lit_dp.LocalSGD(net, local_steps=1, group=_ReplicaGroups(present))
        before = _moved(net, 1.0)
        assert local_sgd.step()
        # Only this group moved: the mean of the groups' parameters moves by 1 / present.
        for param, start in zip(net.parameters(), before):
            torch.testing.assert_close(param.detach(), start + 1.0 / present)


def test_with_one_group_present_diloco_still_takes_its_outer_step():
    net = nn.Linear(3, 2)
    local_sgd = lit_dp.LocalSGD(net, local_steps=1, group=_ReplicaGroups(1), outer="nesterov", outer_lr=0.5, outer_momentum=0.5)
    before = _moved(net, 1.0)
    local_sgd.step()
    # Nesterov from zero momentum on the pseudo-gradient -1: s - lr * (g + momentum * g) = s + 0.75.
    for param, start in zip(net.parameters(), before):
        torch.testing.assert_close(param.detach(), start + 0.75)


def test_a_failed_sync_keeps_the_local_work_voids_the_commit_and_the_schedule_goes_on():
    groups = _ReplicaGroups(2)
    net = nn.Linear(3, 2)
    local_sgd = lit_dp.LocalSGD(net, local_steps=2, group=groups)
    before = _moved(net, 1.0)
    local_sgd.step()
    groups.failing = True
    assert local_sgd.step() is True  # its sync was due and attempted
    for param, start in zip(net.parameters(), before):
        torch.testing.assert_close(param.detach(), start + 1.0)  # nothing of the failed sync applied
    assert groups.voided == 1
    groups.failing = False
    assert not local_sgd.step()  # every group keeps the schedule: the next sync is the scheduled one
    _moved(net, 1.0)
    assert local_sgd.step() and local_sgd.last_average == 4
    # It carries both periods' work: this group moved by 2 since the snapshot, the other by nothing.
    for param, start in zip(net.parameters(), before):
        torch.testing.assert_close(param.detach(), start + 1.0)


def test_a_recovering_group_takes_a_peers_snapshot_with_averaging_too():
    peer_net, net = nn.Linear(3, 2), nn.Linear(3, 2)
    peer = lit_dp.LocalSGD(peer_net, local_steps=2, group=_ReplicaGroups(2))
    _moved(peer_net, 1.0)  # the peer's local progress since its snapshot
    peer.step()
    state = peer.state_dict()
    assert state["outer"]["snapshot"] is not None  # averaging's snapshot travels across replica groups
    # The recovering group: the peer's parameters, then its schedule and snapshot.
    net.load_state_dict(peer_net.state_dict())
    recovered = lit_dp.LocalSGD(net, local_steps=2, group=_ReplicaGroups(2))
    recovered.load_state_dict(state)
    peer.step()
    recovered.step()
    for mine, theirs in zip(net.parameters(), peer_net.parameters()):
        assert torch.equal(mine, theirs)
