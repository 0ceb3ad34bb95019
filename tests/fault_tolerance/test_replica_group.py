"""``lit_dp.DataParallel`` under a torchft Manager: real replica-group processes, a real lighthouse.

Each replica group runs ``tests/helpers/ft_replica.py`` (plain PyTorch, ``torchft.optim.OptimizerWrapper``)
and records every step attempt: whether it committed, which samples it read, and a hash of the
parameters' bytes before and after the optimizer. The checks: replicas equal bitwise after every
committed step, and equal a single process trained on their concatenated batches; a discarded
step changes no parameter; a SIGKILLed replica, started again, holds its peers' parameters
bitwise at its first committed step; the committed steps read each sample of an epoch once.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchft")

import lit_dp  # noqa: E402
from lit_dp.fault_tolerance.replica_group import (  # noqa: E402
    RENDEZVOUS_BOUNDED,
    RENDEZVOUS_SECONDS,
    STORE_PROBE_SECONDS,
    FaultTolerantGroup,
    check_comm_hook,
    replica_process_group,
)
from tests.helpers import ft_replica  # noqa: E402
from tests.helpers.distributed import free_port  # noqa: E402
from tests.helpers.torchft import PYTHON, read_records, replica_groups  # noqa: E402


def run(tmp_path: Path, steps: int, *flags: str, groups: int = 2, kill: tuple[int, int] | None = None, **lighthouse):
    """Run the replica groups to ``steps`` committed steps (restarting a killed one); their records by group."""
    command = [PYTHON, "-m", "tests.helpers.ft_replica", str(tmp_path), str(steps), *flags]
    if kill is not None:
        command += ["--kill", f"{kill[0]}:{kill[1]}"]
    with replica_groups(command, groups, tmp_path, **lighthouse) as replicas:
        replicas.start_all()
        if kill is not None:
            victim = replicas.replicas[kill[0]]
            replicas.wait_for(
                f"replica group {kill[0]} to kill itself at step {kill[1]}", lambda: victim.process.poll() is not None, 120
            )
            assert victim.process.returncode == -9, victim.tail()
            # Its launcher restarts it once the others went on without it (two steps committed), which a
            # fast restart would otherwise not leave them time for.
            others = [tmp_path / f"replica{group}.jsonl" for group in range(groups) if group != kill[0]]
            replicas.wait_for(
                f"the replica groups to go on without group {kill[0]}",
                lambda: all(_steps_without(path, groups - 1, kill[1]) >= 2 for path in others), 120, killed=victim
            )
            replicas.start(kill[0])
        replicas.wait_all(timeout=240)
    return {group: read_records(tmp_path / f"replica{group}.jsonl") for group in range(groups)}


def _steps_without(path: Path, participants: int, since: int) -> int:
    """Committed steps from ``since`` on that ``participants`` replica groups took, in ``path``'s records so far."""
    try:
        lines = read_records(path)
    except ValueError:  # a line being written
        return 0
    return sum(1 for line in lines if line["committed"] and line["participants"] == participants and line["step"] >= since)


def committed_hashes(records: dict[int, list[dict]]) -> dict[int, set[str]]:
    """Parameter hashes after each committed step, over every replica that committed it."""
    after = defaultdict(set)
    for lines in records.values():
        for line in lines:
            if line["committed"]:
                after[line["step"]].add(line["after"])
    return after


def committed_reads(records: dict[int, list[dict]], step: int) -> dict[int, list[int]]:
    """The samples each quorum rank read in committed step ``step``."""
    return {
        line["rank"]: line["indices"]
        for lines in records.values()
        for line in lines
        if line["step"] == step and line["committed"] and line["rank"] is not None
    }


def check_invariants(records: dict[int, list[dict]], steps: int) -> None:
    # Every committed step left every replica that took part with the same parameters, bit for bit.
    after = committed_hashes(records)
    assert sorted(after) == list(range(steps))
    differing = {step: hashes for step, hashes in after.items() if len(hashes) != 1}
    assert not differing, f"replicas differ after committed steps {sorted(differing)}"
    for group, lines in records.items():
        for line in lines:
            if not line["committed"]:
                assert line["voted"] == line["after"], f"replica group {group} applied discarded step {line['step']}"
    # The committed steps, in order, read the data stream's samples once each: none repeated, none skipped.
    read = []
    for step in range(steps):
        takers = committed_reads(records, step)
        read += [index for rank in sorted(takers) for index in takers[rank]]
    batches = lit_dp.ReplicaBatches(ft_replica.dataset(), ft_replica.BATCH, seed=0)
    assert read == batches.indices(0, len(read)).tolist()


def test_replicas_average_like_one_process_on_their_concatenated_batches(tmp_path):
    steps = 4
    records = run(tmp_path, steps, "--min-replicas", "2", min_replicas=2)
    check_invariants(records, steps)
    assert all(line["participants"] == 2 for lines in records.values() for line in lines if line["committed"])
    # torchft's init_sync gave both replicas one start (each built its model from its own seed).
    start = {line["before"] for lines in records.values() for line in lines if line["step"] == 0 and line["committed"]}
    seeds = [seed for seed in (0, 1) if ft_replica.parameters_hash(ft_replica.model(seed)) in start]
    assert len(start) == 1 and len(seeds) == 1
    # One process, the same start, each step on the replicas' batches concatenated.
    reads = [committed_reads(records, step) for step in range(steps)]
    reference = ft_replica.trained_on(seeds[0], [takers[0] + takers[1] for takers in reads])
    trained = torch.load(tmp_path / "replica0.pt")
    # fp32 sums in another order (two halves averaged vs one mean): differences of a few ulps,
    # which 4 Adam steps of lr 0.01 carry into the parameters at about 1e-6.
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("quorum", ["sync", "async"])
def test_a_killed_replica_recovers_its_peers_state_and_the_data_goes_on(tmp_path, quorum):
    steps, kill_at = 24, 6
    flags = ["--alone-seconds", "1"] + (["--async-quorum"] if quorum == "async" else [])
    records = run(tmp_path, steps, *flags, kill=(1, kill_at))
    check_invariants(records, steps)
    survivor, victim = records[0], records[1]
    # The step during which the replica died was discarded by the survivor, and trained again.
    killed = min(line["step"] for line in survivor if not line["committed"] and line["step"] >= kill_at)
    assert [line["committed"] for line in survivor if line["step"] == killed] == [False, True]
    # The survivor trained alone for a while; the restarted replica came back and took part.
    assert any(line["participants"] == 1 and line["committed"] and line["step"] > killed for line in survivor)
    restarted = [line for line in victim if line["step"] > killed]
    assert restarted and restarted[-1]["participants"] == 2
    # At its first committed step after the restart it holds its peers' parameters, bit for bit.
    first = next(line for line in restarted if line["committed"])
    peer = next(line for line in survivor if line["step"] == first["step"] and line["committed"])
    assert first["after"] == peer["after"]
    assert torch.load(tmp_path / "replica0.pt").keys() == torch.load(tmp_path / "replica1.pt").keys()
    final = [torch.load(tmp_path / f"replica{g}.pt") for g in (0, 1)]
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])


class _QuorumlessManager:
    """What ``FaultTolerantGroup`` and its commit protocol read of a Manager before any quorum (no lighthouse needed)."""

    _replica_id = "0"

    def register_state_dict_fn(self, key, load, save) -> None:
        pass

    def num_participants(self) -> int:
        return 0

    def participating_rank(self) -> int | None:
        return None


def test_under_a_manager_what_cannot_follow_replicas_is_refused_by_name():
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"sharding_stage=1 with DataParallel\(manager=...\) is not supported"):
        lit_dp.DataParallel(net, manager=_QuorumlessManager(), sharding_stage=1)
    with pytest.raises(ValueError, match=r"comm_buffer_size='auto' with DataParallel\(manager=...\)"):
        lit_dp.DataParallel(net, manager=_QuorumlessManager(), comm_buffer_size="auto")
    with pytest.raises(ValueError, match=r"comm_hook='powersgd' with DataParallel\(manager=...\)"):
        lit_dp.DataParallel(net, manager=_QuorumlessManager(), comm_hook="powersgd")
    with pytest.raises(ValueError, match=r"DataParallel\(process_group=.*, manager=...\) is invalid"):
        lit_dp.DataParallel(net, group=object(), manager=_QuorumlessManager())
    sparse = nn.Embedding(4, 2, sparse=True)
    with pytest.raises(ValueError, match="sparse gradients"):
        lit_dp.DataParallel(sparse, manager=_QuorumlessManager())
    model = lit_dp.DataParallel(net, manager=_QuorumlessManager())
    with pytest.raises(ValueError, match="Join .* not supported"):
        model.join()


def test_under_a_manager_the_buckets_keep_the_registration_order_and_a_hook_gets_the_replicas():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = lit_dp.DataParallel(net, manager=_QuorumlessManager(), comm_buffer_size=0.00001, last_comm_buffer_size=0.00001)
    group = model.reducer.group
    assert isinstance(group, FaultTolerantGroup) and group.name() == "torchft"
    # Launch order is the reverse of registration, one parameter a bucket; it never changes.
    assert model.reducer.bucket_indices == [[3], [2], [1], [0]]
    assert check_comm_hook(None, default_hooks.fp16_compress_hook, group, "x") is group
    assert check_comm_hook(None, default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook), group, "x") is group
    with pytest.raises(ValueError, match="powerSGD_hook with x is not supported"):
        check_comm_hook(None, default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook), group, "x")
    with pytest.raises(ValueError, match="comm_state=.* is invalid"):
        check_comm_hook(object(), default_hooks.allreduce_hook, group, "x")


def _quiet_hook(state, bucket):
    """A third party's hook that communicates only on the group it is given, as it declares."""
    return dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future().then(lambda f: f.value()[0])


def test_under_a_manager_a_named_hook_declared_stateless_gets_the_replicas_and_the_same_hook_by_hand_is_refused(
    monkeypatch,
):
    from lit_dp.options import comm_hooks

    monkeypatch.setattr(comm_hooks, "_REGISTRY", dict(comm_hooks._REGISTRY))  # the generated docs list lit_dp's own
    comm_hooks.register_named_hook(
        comm_hooks.NamedHook("quiet", "a test's hook", lambda o: (None, _quiet_hook), lambda o: "quiet", stateless=True)
    )
    model = lit_dp.DataParallel(nn.Linear(4, 4), manager=_QuorumlessManager(), comm_hook="quiet")
    assert model.comm_hook.hook is _quiet_hook and model.comm_hook.state is model.reducer.group
    by_hand = lit_dp.DataParallel(nn.Linear(4, 4), manager=_QuorumlessManager())
    with pytest.raises(ValueError, match=r"_quiet_hook with DataParallel\(manager=\.\.\.\) is not supported"):
        by_hand.register_comm_hook(None, _quiet_hook)


class _Quorum(_QuorumlessManager):
    """A Manager whose quorum says how many replica groups take part."""

    def __init__(self, participants: int) -> None:
        self.participants = participants

    def num_participants(self) -> int:
        return self.participants


def test_under_a_manager_each_forward_divides_by_the_replica_groups_of_its_quorum():
    from lit_dp.gradients.plan import Participation

    manager = _Quorum(0)
    model = lit_dp.DataParallel(nn.Linear(2, 2), manager=manager)
    assert model.step_plan(Participation.SYNC).divisor == 1  # before the first quorum torchft says 0
    manager.participants = 3  # the next step's quorum
    assert model.step_plan(Participation.SYNC).divisor == 3
    assert not model.will_sync_module_buffers()  # each replica group keeps its buffers


def test_a_quorum_led_by_a_dead_group_fails_at_once_instead_of_waiting_out_the_timeout():
    # The quorum's store is its leader's (nearly always group 0's): a port nothing answers on is
    # one whose group died after asking for the quorum. torch's store client would retry it for
    # the process group's whole timeout.
    group = replica_process_group(timeout=timedelta(seconds=60))
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=r"the quorum's store at 127.0.0.1:\d+ does not answer"):
        group.configure(f"127.0.0.1:{free_port()}/torchft/3/0", "1", 0, 2, 3, 0, 1, [0, 1])
    assert time.monotonic() - started < STORE_PROBE_SECONDS + 5


@pytest.mark.skipif(not RENDEZVOUS_BOUNDED, reason="torch < 2.9: Gloo's timeout cannot be set back after the "
                    "rendezvous, so the rendezvous waits the group's whole timeout (lit_dp.fault_tolerance)")
def test_a_rendezvous_missing_a_member_fails_within_its_bound_and_the_collectives_keep_the_timeout():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    seen = []
    group = replica_process_group(timeout=timedelta(seconds=60), on_quorum=seen.append)
    started = time.monotonic()
    with pytest.raises(Exception, match="wait timeout after 2000ms"):  # member 1 asked for the quorum, then died
        group.configure(f"127.0.0.1:{store.port}/torchft/1/0", "0", 0, 2, 1, 0, 1, [0, 1])
    assert time.monotonic() - started < RENDEZVOUS_SECONDS + 5
    assert seen == []
    group.configure(f"127.0.0.1:{store.port}/torchft/2/0", "0", 0, 1, 2, 0, 1, [4])  # alone: no one to wait for
    assert seen == [[4]]
    assert group.parent._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=60)
    tensor = torch.ones(3)
    group.allreduce([tensor], dist.AllreduceOptions()).wait()
    assert not group.connections_hung_up()
    group.abort()


def test_torchfts_own_servers_are_kept_out_of_the_connections_a_quorum_records():
    # A rank of the same replica group asking its Manager server, or a peer fetching a checkpoint,
    # may open a connection while the group is built: recorded, its close would read as a hang-up.
    group = replica_process_group()
    group.keep_out("http://lighthouse:29510", "http://vm:41791", "http://[::1]:5000/checkpoint/0")
    assert group._other_ports == {29510, 41791, 5000}
