"""``lit_dp.LocalSGD`` across torchft's replica groups: each sync a transaction, the divisor, a failed sync, a heal.

A replica-group process group (what ``FaultTolerantGroup`` and ``HierarchicalGroup`` offer LocalSGD:
``size``, ``allreduce`` and ``commit``, the commit protocol) written here around one process: the
other replica groups are played by what the all-reduce adds, and the protocol by a recorder of its
transactions whose vote the test decides. The end-to-end runs, with real groups, a real lighthouse
and faults injected at torchft's process group, are tests/fault_tolerance/test_transient_faults.py's.
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


class _Protocol:
    """The transactions LocalSGD starts and votes on; ``passes``: the vote's outcome, ``heals``: whether the
    next quorum gives this group a peer's state."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.votes = 0
        self.passes = True
        self.heals = False
        self.every_step: bool | None = None
        self.take_part = None
        self.open = None
        self.peers = None  # the transaction a heal brings this group into, when not its own
        self.peers_ended = False  # a heal at the peers' last quorum, after their last step
        self.manager = None  # lit_dp's own Manager: every group of the quorum takes part
        self.replica_group = "0"

    def start(self, transaction) -> bool:
        self.started.append(transaction.name)
        self.open = None if self.peers_ended else self.peers or transaction
        return self.heals

    def vote(self) -> bool:
        self.votes += 1
        self.open = None
        return self.passes

    def follow_syncs(self, take_part) -> None:
        self.take_part = take_part

    def cross_groups_every_step(self, every_step: bool) -> None:
        self.every_step = every_step

    def reconcile(self) -> None:
        self.started.append("reconcile")


class _ReplicaGroups(dist.ProcessGroup):
    """This replica group and ``present - 1`` others whose deltas are zero (they did not move since
    the last sync), each counted as taking part."""

    def __init__(self, present: int = 2) -> None:
        super().__init__(0, 1)
        self.present = present
        self.commit = _Protocol()
        self.counts: list[float] = []  # what this group said of itself in each sync's count

    def size(self) -> int:
        return self.present

    def rank(self) -> int:
        return 0

    def allreduce(self, tensors, opts) -> dist.Work:
        for tensor in tensors:
            if tensor.numel() == 1:  # the count of those taking part (the payloads are larger): each adds 1
                self.counts.append(tensor.item())
                tensor.add_(self.present - 1)
        return _Done(tensors)


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
    local_sgd = lit_dp.LocalSGD(
        net, local_steps=1, group=_ReplicaGroups(1), outer="nesterov", outer_lr=0.5, outer_momentum=0.5
    )
    before = _moved(net, 1.0)
    local_sgd.step()
    # Nesterov from zero momentum on the pseudo-gradient -1: s - lr * (g + momentum * g) = s + 0.75.
    for param, start in zip(net.parameters(), before):
        torch.testing.assert_close(param.detach(), start + 0.75)


def test_each_sync_is_one_transaction_and_the_steps_between_take_none():
    groups = _ReplicaGroups(2)
    local_sgd = lit_dp.LocalSGD(nn.Linear(3, 2), local_steps=3, warmup_steps=2, group=groups)
    protocol = groups.commit
    assert protocol.every_step is True and protocol.take_part is not None  # warm-up: each step crosses groups
    local_sgd.step()
    local_sgd.step()
    assert protocol.every_step is False  # the local phase: only the syncs do
    for _ in range(6):
        local_sgd.step()
    assert protocol.started == ["the sync after step 5", "the sync after step 8"] and protocol.votes == 2


def test_a_failed_vote_keeps_the_local_work_and_the_next_sync_carries_both_periods():
    groups = _ReplicaGroups(2)
    net = nn.Linear(3, 2)
    local_sgd = lit_dp.LocalSGD(net, local_steps=2, group=groups)
    before = _moved(net, 1.0)
    local_sgd.step()
    groups.commit.passes = False
    assert local_sgd.step() is True  # its sync was due and attempted
    for param, start in zip(net.parameters(), before):
        torch.testing.assert_close(param.detach(), start + 1.0)  # nothing of the failed sync applied
    groups.commit.passes = True
    assert not local_sgd.step()  # every group keeps the schedule: the next sync is the scheduled one
    _moved(net, 1.0)
    assert local_sgd.step() and local_sgd.last_average == 4
    # It carries both periods' work: this group moved by 2 since the snapshot, the other by nothing.
    for param, start in zip(net.parameters(), before):
        torch.testing.assert_close(param.detach(), start + 1.0)


def test_a_group_that_heals_at_a_sync_sends_nothing_of_its_own_and_takes_the_result():
    groups = _ReplicaGroups(3)
    net = nn.Linear(3, 2)
    local_sgd = lit_dp.LocalSGD(net, local_steps=1, group=groups)
    before = _moved(net, 1.0)  # the work of a state that the heal replaces (here: kept, the heal is the test's)
    groups.commit.heals = True
    local_sgd.step()
    assert groups.counts == [0.0]  # it does not count: the two others' mean is taken
    for param, start in zip(net.parameters(), before):
        torch.testing.assert_close(param.detach(), start)  # the others did not move: the snapshot stays


def test_a_group_that_healed_into_its_peers_sync_takes_part_in_it():
    groups = _ReplicaGroups(2)
    net = nn.Linear(3, 2)
    local_sgd = lit_dp.LocalSGD(net, local_steps=2, group=groups)
    local_sgd.step()
    local_sgd.step()  # the first sync, after step 2
    before = _moved(net, 1.0)
    local_sgd.step()
    # A peer's state from inside its sync after step 4 (the heal loads it), then its part in that sync.
    local_sgd._schedule.step += 1
    groups.commit.take_part(0)
    assert groups.counts[-1] == 0.0 and local_sgd.last_average == 4 and groups.commit.votes == 2
    assert groups.commit.started == ["the sync after step 2"]  # no quorum of its own: it took the peers'
    for param, start in zip(net.parameters(), before):
        torch.testing.assert_close(param.detach(), start)


def test_a_group_left_out_of_its_syncs_quorum_syncs_the_fragment_of_its_peers_next_sync():
    from lit_dp.fault_tolerance.commit import Transaction

    groups = _ReplicaGroups(2)
    local_sgd = lit_dp.LocalSGD(nn.Linear(3, 2), local_steps=2, fragments=2, group=groups)
    local_sgd.step()  # fragment 0's sync after step 1
    # At fragment 1's sync after step 2 this group heals into its peers' next one, fragment 0's after
    # step 3 (the heal would load their schedule; here the steps are this object's own).
    groups.commit.heals, groups.commit.peers = True, Transaction("the sync after step 3 (fragment 0)", sync=0)
    local_sgd.step()
    assert local_sgd._schedule.last_syncs == [2, 0] and groups.counts[-1] == 0.0


def test_a_group_that_meets_its_peers_after_their_last_step_syncs_nothing():
    groups = _ReplicaGroups(2)
    local_sgd = lit_dp.LocalSGD(nn.Linear(3, 2), local_steps=1, group=groups)
    groups.commit.heals, groups.commit.peers_ended = True, True
    local_sgd.step()
    assert groups.counts == [] and groups.commit.votes == 0  # no collective, no vote: it holds their final state


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


def test_finish_reconciles_the_groups_after_its_last_syncs():
    groups = _ReplicaGroups(2)
    local_sgd = lit_dp.LocalSGD(nn.Linear(3, 2), local_steps=4, group=groups)
    local_sgd.step()
    local_sgd.finish()
    assert groups.commit.started == ["the sync after step 1", "reconcile"]


class _WireReplicaGroups(_ReplicaGroups):
    """This replica group alone in the quorum, with the two collectives a sync in a wire format adds (what
    ``FaultTolerantGroup`` offers): one rank's all-to-all and all-gather hand its chunks back."""

    def __init__(self) -> None:
        super().__init__(1)

    def alltoall_base(self, output, tensor, output_splits, input_splits, opts) -> dist.Work:
        output.copy_(tensor)
        return _Done([output])

    def allgather_into_tensor_coalesced(self, outputs, tensors, opts) -> dist.Work:
        for output, tensor in zip(outputs, tensors):
            output.copy_(tensor)
        return _Done(outputs)


def _residuals(local_sgd) -> list[torch.Tensor]:
    return local_sgd.rank_state_dict()["error_feedback"]["residuals"]


def _drift(net: nn.Module, seed: int) -> None:
    """A local period's work that int4 cannot carry whole: its residuals are not zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in net.parameters():
            param.add_(torch.randn(param.shape, generator=generator))


def test_a_failed_vote_gives_the_residuals_back_as_the_sync_found_them():
    groups = _WireReplicaGroups()
    net = nn.Linear(5, 4)
    local_sgd = lit_dp.LocalSGD(net, local_steps=1, group=groups, sync_dtype="int4")  # error feedback: on
    _drift(net, 0)
    local_sgd.step()
    found = [r.clone() for r in _residuals(local_sgd)]
    assert any(r.abs().sum() > 0 for r in found)
    _drift(net, 1)
    kept = [p.detach().clone() for p in net.parameters()]
    groups.commit.passes = False
    assert local_sgd.step()  # the sync ran, fed back what int4 dropped, and its vote failed
    assert all(torch.equal(a, b) for a, b in zip(_residuals(local_sgd), found))
    assert all(torch.equal(p.detach(), k) for p, k in zip(net.parameters(), kept))


def test_a_group_that_heals_takes_no_residuals_from_its_peer_and_its_own_resume_does():
    peer_groups = _WireReplicaGroups()
    peer_net = nn.Linear(5, 4)
    peer = lit_dp.LocalSGD(peer_net, local_steps=1, group=peer_groups, sync_dtype="int8")
    _drift(peer_net, 0)
    peer.step()
    state = peer.state_dict()  # what a healing group receives from its peer (group 0), residuals included
    assert any(r.abs().sum() > 0 for r in state["error_feedback"]["residuals"])
    healing_groups = _WireReplicaGroups()
    healing_groups.commit.replica_group = "1"
    healing = lit_dp.LocalSGD(nn.Linear(5, 4), local_steps=1, group=healing_groups, sync_dtype="int8")
    healing.load_state_dict(state)
    assert all(not r.any() for r in _residuals(healing))  # the peer's residuals are its own: zero here
    resumed = lit_dp.LocalSGD(nn.Linear(5, 4), local_steps=1, group=_WireReplicaGroups(), sync_dtype="int8")
    resumed.load_state_dict(state)  # group 0's own state (its checkpoint): its residuals come back
    assert all(torch.equal(a, b) for a, b in zip(_residuals(resumed), state["error_feedback"]["residuals"]))
