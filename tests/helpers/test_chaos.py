"""The chaos fixture's own checks: its plans, and a fault injected on a real torchft process group.

Two processes build torchft's ``ProcessGroupGloo`` (what the Manager holds across replica groups)
and install the fixture's injector on it. A fault planned for rank 0 fails that rank's collective
only after the collective completed: rank 0's work and future raise, rank 1's succeed, and both
hold the sum. The fault is logged once, with its kind and ordinal, and never fires twice.
"""

from __future__ import annotations

import json
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.chaos import (
    FAULTS_ENV,
    Fault,
    _Injector,
    random_faults,
    read_collectives,
    read_failures,
    read_fault_log,
    read_plan,
    read_trained,
)
from tests.helpers.distributed import free_port, run_ranks

pytest.importorskip("torchft")


def test_a_plan_is_read_from_the_environment_and_a_malformed_one_is_named():
    plan = [Fault(group=1, rank=0, kind="sync-count", step=96), Fault(group=2, rank=1, kind="bucket", skip=1)]
    text = json.dumps([vars(fault) for fault in plan])
    assert read_plan({FAULTS_ENV: text}) == plan
    assert read_plan({}) == []
    with pytest.raises(ValueError, match=rf"{FAULTS_ENV}=.*expected a JSON list"):
        read_plan({FAULTS_ENV: '{"group": 1}'})
    with pytest.raises(ValueError, match="kind='gradient'.*expected one of bucket, sync-count"):
        read_plan({FAULTS_ENV: '[{"group": 1, "rank": 0, "kind": "gradient"}]'})


def test_a_random_plan_is_reproducible_draws_every_kind_and_never_two_faults_at_one_step():
    kinds = ["sync-count", "sync-payload", "heal"]
    plan = random_faults(seed=3, count=6, groups=[0, 1, 2], ranks=2, kinds=kinds, steps=(20, 540))
    assert plan == random_faults(seed=3, count=6, groups=[0, 1, 2], ranks=2, kinds=kinds, steps=(20, 540))
    assert sorted(fault.kind for fault in plan) == sorted(kinds * 2)
    assert len({fault.step for fault in plan}) == 6 and all(20 <= fault.step < 540 for fault in plan)
    assert {fault.rank for fault in plan} <= {0, 1} and {fault.group for fault in plan} <= {0, 1, 2}


def reduce_with_a_fault(rank: int, port: int, log: str) -> dict:
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    group = ProcessGroupGloo(timeout=timedelta(seconds=30))
    group.configure(f"127.0.0.1:{port}/chaos", str(rank), rank, 2)
    heals = []
    transport = types.SimpleNamespace(send_checkpoint=lambda **kw: None, recv_checkpoint=lambda **kw: heals.append(kw))
    manager = types.SimpleNamespace(_pg=group, _checkpoint_transport=transport)
    plan = [Fault(group=0, rank=0, kind="bucket", step=3), Fault(group=0, rank=0, kind="heal")]
    injector = _Injector(group=0, rank=rank, plan=plan, log=Path(log), restarted=False)
    injector.install(manager)
    outcomes = []
    for step in range(6):
        injector.step = step
        if step == 5:  # a peer's state received at step 5: the next collective is during a heal
            transport.recv_checkpoint(src_rank=1, metadata="", step=5, timeout=None)
        tensor = torch.full((3,), float(rank + 1))
        work = group.allreduce([tensor], dist.AllreduceOptions())
        try:
            work.get_future().wait()
            outcomes.append("ok")
        except RuntimeError as error:
            outcomes.append(str(error))
        outcomes.append(tensor.tolist())
    injector.write_collectives(restarts=0)
    del store
    return {"outcomes": outcomes, "heals": len(heals), "counts": injector.counts}


@pytest.mark.timeout(120)
def test_a_fault_completes_the_collective_everywhere_and_fails_it_on_its_rank_only(tmp_path):
    log = tmp_path / "faults.jsonl"
    results = run_ranks(reduce_with_a_fault, 2, free_port(), str(log), timeout=90)
    summed = [3.0, 3.0, 3.0]
    rank0, rank1 = results[0]["outcomes"], results[1]["outcomes"]
    assert rank1 == ["ok", summed] * 6  # the peer saw every collective complete
    assert rank0[1::2] == [summed] * 6  # and so did the faulty rank's tensors
    failed = [index for index, outcome in enumerate(rank0[::2]) if outcome != "ok"]
    assert failed == [3, 5], rank0  # the bucket at step 3, and the first collective after the heal
    assert "replica group 0, rank 0: its bucket collective number 4" in rank0[6]
    assert "its heal collective number 1" in rank0[10]
    assert results[0]["heals"] == 1
    collectives = {record["rank"]: record for record in read_collectives(tmp_path)}
    assert collectives[0]["counts"] == collectives[1]["counts"] == {"bucket": 6, "heal": 1}
    assert collectives[0]["failures"] == [["bucket", 3], ["bucket", 5]] and collectives[1]["failures"] == []
    failures = [(r["rank"], r["kind"], r["step"]) for r in read_failures(tmp_path)]
    assert failures == [(0, "bucket", 3), (0, "bucket", 5)]  # logged as they happened
    records = read_fault_log(log)
    assert [(r["fault"], r["kind"], r["step"], r["ordinal"], r["rank"]) for r in records] == [
        (0, "bucket", 3, 4, 0),
        (1, "heal", 5, 1, 0),
    ]


def test_a_fault_already_logged_does_not_fire_again_in_a_restarted_worker(tmp_path):
    log = tmp_path / "faults.jsonl"
    log.write_text(json.dumps({"fault": 0, "group": 1, "rank": 0, "kind": "bucket"}) + "\n")
    injector = _Injector(group=1, rank=0, plan=[Fault(group=1, rank=0, kind="bucket")], log=log, restarted=True)
    tensors = [torch.zeros(4)]
    assert injector.collective(tensors) == (
        "bucket",
        0,
        None,
    )  # a restarted worker: its first collective counts as a heal too
    assert injector.counts == {"bucket": 1, "heal": 1}
    assert read_trained(tmp_path, group=1) == -1
    injector.note_trained(7)
    assert read_trained(tmp_path, group=1) == 7 and read_trained(tmp_path, group=0) == -1
