"""Replica groups of many ranks: each group a torchrun job of 2 Gloo ranks, around a real lighthouse.

Each group runs ``tests/helpers/ft_replica.py`` under its own ``torchrun --nproc-per-node=2``: lit_dp's
reducer reduces inside the group and sends each rank's shard across groups
(``lit_dp.fault_tolerance.hierarchical``). The checks: every rank of every group holds the same
parameters after each committed step, bit for bit; they equal one process trained on the four
ranks' batches concatenated; each rank sent at most half of its gradients' bytes across groups;
a rank killed mid-run makes its torchrun restart the group, which recovers each rank's state
from the same rank of the other group, while the other group never restarts.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")

import lit_dp  # noqa: E402
from lit_dp.fault_tolerance.hierarchical import HierarchicalGroup  # noqa: E402
from tests.helpers import ft_replica  # noqa: E402
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.torchft import PYTHON, read_records, replica_groups  # noqa: E402

RANKS = 2  # per replica group


def run(tmp_path: Path, steps: int, *flags: str, **lighthouse) -> dict[tuple[int, int], list[dict]]:
    """Two replica groups of ``RANKS`` ranks each to ``steps`` committed steps; the records by (group, rank)."""
    command = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", "--max-restarts=3",
        "--monitor-interval=0.1", "-m", "tests.helpers.ft_replica", str(tmp_path), str(steps), *flags,
    ]
    with replica_groups(command, 2, tmp_path, **lighthouse) as replicas:
        replicas.start_all()
        replicas.wait_all(timeout=360)
    return {
        (group, rank): read_records(tmp_path / f"replica{group}{f'-rank{rank}' if rank else ''}.jsonl")
        for group in range(2)
        for rank in range(RANKS)
    }


def check_every_rank_equal_after_each_committed_step(records: dict[tuple[int, int], list[dict]], steps: int) -> None:
    after = defaultdict(set)
    for lines in records.values():
        for line in lines:
            if line["committed"]:
                after[line["step"]].add(line["after"])
    assert sorted(after) == list(range(steps))
    differing = {step: len(hashes) for step, hashes in after.items() if len(hashes) != 1}
    assert not differing, f"ranks differ after committed steps {differing}"


def test_groups_of_two_ranks_train_as_one_process_on_the_four_batches_and_send_half_across(tmp_path):
    steps = 3
    records = run(tmp_path, steps, "--min-replicas", "2", min_replicas=2)
    check_every_rank_equal_after_each_committed_step(records, steps)
    assert all(line["participants"] == 2 for lines in records.values() for line in lines if line["committed"])
    # Every rank built its model from its own seed; all started from group 0's rank 0's (torchft's
    # init_sync gives rank r of a group replica r % 2's rank r, then each group broadcasts its rank 0's).
    start = {line["before"] for lines in records.values() for line in lines if line["step"] == 0}
    seeds = [seed for seed in range(2 * RANKS) if ft_replica.parameters_hash(ft_replica.model(seed)) in start]
    assert len(start) == 1 and seeds == [0]
    # One process from that start, each step on the four ranks' batches concatenated.
    concatenated = []
    for step in range(steps):
        reads = {line["rank"]: line["indices"] for lines in records.values() for line in lines if line["step"] == step}
        assert sorted(reads) == list(range(2 * RANKS)), reads  # every rank of both groups read its own slice
        concatenated.append([index for rank in sorted(reads) for index in reads[rank]])
    reference = ft_replica.trained_on(0, concatenated)
    trained = torch.load(tmp_path / "replica1-rank1.pt")
    # fp32 sums in another order (per-rank means summed in two levels against one mean): a few
    # ulps, which 3 Adam steps of lr 0.01 carry into the parameters at about 1e-6.
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5)
    # Each rank's all-reduce across groups carried its shard: at most 1/2 of what it reduced,
    # plus less than one element per all-reduce where a bucket does not split evenly.
    for (group, rank), lines in records.items():
        last = lines[-1]
        assert last["across_bytes"] <= last["reduced_bytes"] / RANKS + 4 * last["allreduces"], (group, rank, last)
        assert last["across_bytes"] >= last["reduced_bytes"] / RANKS, (group, rank, last)


@pytest.mark.slow
def test_a_killed_rank_restarts_its_group_which_recovers_each_rank_from_its_peer_while_the_other_goes_on(tmp_path):
    steps, kill_at = 16, 5
    records = run(tmp_path, steps, "--kill", f"1:{kill_at}", "--alone-seconds", "1", "--restart-seconds", "5")
    check_every_rank_equal_after_each_committed_step(records, steps)
    # Group 1's last rank died: its torchrun restarted both ranks (a second run appends to the same records).
    assert (tmp_path / "replica1.died").exists()
    survivor = records[(0, 0)]
    killed = min(line["step"] for line in survivor if not line["committed"] and line["step"] >= kill_at)
    assert any(line["participants"] == 1 and line["committed"] and line["step"] > killed for line in survivor)
    # Group 0 never restarted: its steps are attempted once each, in order, but for the discarded one.
    attempted = [line["step"] for line in survivor]
    assert attempted == sorted(attempted) and len(attempted) == len(set(attempted)) + 1
    # Each rank of the restarted group came back holding its peer rank's parameters, bit for bit.
    for rank in range(RANKS):
        restarted = [line for line in records[(1, rank)] if line["step"] > killed]
        first = next(line for line in restarted if line["committed"])
        peer = next(line for line in records[(0, rank)] if line["step"] == first["step"] and line["committed"])
        assert first["after"] == peer["after"] and restarted[-1]["participants"] == 2
    final = [torch.load(tmp_path / f"replica{g}{f'-rank{r}' if r else ''}.pt") for g in range(2) for r in range(RANKS)]
    assert all(torch.equal(final[0][name], other[name]) for other in final[1:] for name in final[0])


class _Across:
    """The replica groups of a quorum, as one torch process group: what ``HierarchicalGroup`` asks of a
    ``FaultTolerantGroup`` (its all-reduce's work, its size and rank), for a test without a lighthouse."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def size(self) -> int:
        return self.group.size()

    def rank(self) -> int:
        return self.group.rank()

    def allreduce(self, tensors, op):
        return dist.all_reduce(tensors[0], group=self.group, async_op=True)


def test_hierarchical_all_reduce_of_uneven_tensors_sums_over_every_rank():
    run_ranks(_sum_over_every_rank, 4, timeout=120)


def _sum_over_every_rank(rank: int) -> None:
    # Ranks 0, 1 are one replica group and 2, 3 the other; rank r of a group meets rank r of the other.
    lit_dp.init_parallel_env("gloo")
    withins = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    acrosses = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = HierarchicalGroup(withins[rank // 2], _Across(acrosses[rank % 2]))
    assert (group.size(), group.rank()) == (4, rank)
    for numel in (1, 7, 10):  # fewer elements than ranks, an odd count, an even one
        tensor = torch.arange(numel, dtype=torch.float64) * (rank + 1)
        work = dist.all_reduce(tensor, group=group, async_op=True)
        work.wait()
        torch.testing.assert_close(tensor, torch.arange(numel, dtype=torch.float64) * 10, rtol=0, atol=0)
    # Each rank sent its half (rounded up) of every tensor across groups.
    assert group.traffic.across_bytes == 8 * (1 + 4 + 5)
    assert group.traffic.reduced_bytes == 8 * 18


@pytest.mark.slow
@pytest.mark.parametrize("diloco", [[], ["--local-sgd", "4"]], ids=["per_step", "diloco"])
def test_fabric_with_groups_of_two_ranks_ends_with_one_model_on_every_rank(tmp_path, diloco):
    command = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", "--monitor-interval=0.1",
        "-m", "tests.helpers.ft_fabric_group", str(tmp_path), "12", *diloco,
    ]
    with replica_groups(command, 2, tmp_path, min_replicas=2) as replicas:
        replicas.start_all()
        replicas.wait_all(timeout=240)
    finals = [torch.load(tmp_path / f"replica{group}-rank{rank}.pt") for group in range(2) for rank in range(RANKS)]
    assert all(torch.equal(finals[0][name], final[name]) for final in finals[1:] for name in finals[0])
    assert not torch.equal(finals[0]["0.weight"], ft_replica.model(0)[0].weight)  # it trained


class _QuorumlessManager:
    """What a model under torchft reads of its Manager before any quorum (no lighthouse needed)."""

    _replica_id = "0"
    _group_world_size = RANKS

    def register_state_dict_fn(self, key, load, save) -> None:
        pass

    def num_participants(self) -> int:
        return 0

    def participating_rank(self) -> int | None:
        return None


def test_inside_a_group_of_two_ranks_the_observers_compare_the_groups_own_ranks():
    run_ranks(_observers_on_the_group, RANKS, timeout=120)


def _observers_on_the_group(rank: int) -> None:
    lit_dp.init_parallel_env("gloo")
    model = lit_dp.DataParallel(torch.nn.Linear(4, 2), manager=_QuorumlessManager(), straggler_every_n_steps=5)
    try:
        assert isinstance(model.process_group, HierarchicalGroup)
        # The replica group's own ranks, on its own process group (torch's, the launcher's job's).
        assert model.straggler is not None and model.straggler._ranks == (0, 1)
        assert model.consistency is not None and model.consistency._ranks == (0, 1)
        assert model.watchdog is not None and model.watchdog._ranks == [0, 1]
        # Rank 0 hosts the store each rank's watchdog registers in: it stays until both have.
        dist.barrier()
    finally:
        if model.watchdog is not None:
            model.watchdog.close()
