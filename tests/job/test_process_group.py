from datetime import timedelta

import pytest
import torch

from lit_dp import ParallelEnv, get_rings, init_parallel_env
from lit_dp.job.process_group import resolve_backend, resolve_timeout
from tests.helpers.distributed import run_ranks


def allreduce_on_every_ring(rank):
    import torch.distributed as dist

    group = init_parallel_env(timeout=60)
    assert init_parallel_env() is group, "a second call must return the existing group"
    assert (dist.get_rank(), dist.get_world_size()) == (rank, int(ParallelEnv().world_size))
    rings = get_rings()
    assert len(rings) == ParallelEnv().nrings and rings[0] is group
    sums = []
    for ring in rings:
        tensor = torch.tensor([float(rank + 1)])
        dist.all_reduce(tensor, group=ring)
        sums.append(tensor.item())
    return sums


def test_two_ranks_with_two_rings():
    results = run_ranks(allreduce_on_every_ring, 2, FLAGS_nccl_nrings="2")
    assert results == {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_three_ranks():
    results = run_ranks(allreduce_on_every_ring, 3)
    assert results == {rank: [6.0] for rank in range(3)}


def init_and_report(rank):
    init_parallel_env()


def test_missing_rank_is_named_within_the_timeout():
    failures = run_ranks(init_and_report, 3, ranks=[0, 1], expect_failure=True, timeout=60, PADDLE_PG_TIMEOUT="3000")
    assert sorted(failures) == [0, 1]
    for trace in failures.values():
        assert "rank(s) [2] of world size 3 did not arrive" in trace
        assert "within 3s" in trace


def test_missing_rank_zero_means_no_rendezvous_host():
    failures = run_ranks(init_and_report, 2, ranks=[1], expect_failure=True, timeout=60, PADDLE_PG_TIMEOUT="3000")
    assert "rank 1 could not reach the rendezvous store at 127.0.0.1:" in failures[1]


def test_world_size_one_warns_and_returns_none():
    with pytest.warns(UserWarning, match="world size is 1"):
        assert init_parallel_env(parallel_env=ParallelEnv({})) is None
    assert get_rings() == []


def test_no_rendezvous_address_is_a_clear_error():
    env = ParallelEnv({"PADDLE_TRAINERS_NUM": "2", "PADDLE_DISTRI_BACKEND": "gloo"})
    with pytest.raises(ValueError, match="no rendezvous address.*MASTER_ADDR and MASTER_PORT"):
        init_parallel_env(parallel_env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
        resolve_backend("nccl")
    assert resolve_backend("auto") == "gloo"


def test_unknown_backend_argument():
    with pytest.raises(ValueError, match="backend='nope' is invalid: expected 'auto', a backend torch.distributed"):
        resolve_backend("nope")


@pytest.mark.parametrize("bad", [0, -1, "10", timedelta(0)])
def test_bad_timeout_argument(bad):
    with pytest.raises(ValueError, match="timeout=.* is invalid"):
        resolve_timeout(bad, ParallelEnv({}))


def test_timeout_defaults_to_paddle_pg_timeout_milliseconds():
    assert resolve_timeout(None, ParallelEnv({"PADDLE_PG_TIMEOUT": "1500"})) == timedelta(seconds=1.5)
    assert resolve_timeout(2.5, ParallelEnv({})) == timedelta(seconds=2.5)


def test_two_ranks_on_one_cuda_device_are_named_before_nccl_starts():
    import torch.distributed as dist

    from lit_dp.job.process_group import check_device_unshared, register_device

    store = dist.HashStore()
    devices = {0: "node-a/GPU-1111 (cuda:0)", 1: "node-a/GPU-1111 (cuda:0)", 2: "node-a/GPU-2222 (cuda:1)"}
    for rank, device in devices.items():
        register_device(store, rank, device)
    environ = {"PADDLE_TRAINERS_NUM": "3"}
    check_device_unshared(store, ParallelEnv({**environ, "PADDLE_TRAINER_ID": "2"}), devices[2])
    for rank in (0, 1):
        with pytest.raises(ValueError) as error:
            check_device_unshared(store, ParallelEnv({**environ, "PADDLE_TRAINER_ID": str(rank)}), devices[rank])
        message = str(error.value)
        assert f"rank {rank}: ranks [0, 1] all resolve to the same CUDA device node-a/GPU-1111 (cuda:0)" in message
        assert all(variable in message for variable in ("FLAGS_selected_gpus", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"))
