from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

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
    # A CUDA build on a machine without a GPU, or a CPU build, which has no NCCL at all.
    expected = "backend='nccl' needs CUDA" if dist.is_nccl_available() else "this torch build has no NCCL"
    with pytest.raises(ValueError, match=expected):
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


def _rank_env(rank, port):
    return ParallelEnv(
        {"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )


def _torchrun_attempt(restart, port):
    from lit_dp.job.restart import JobAttempt, Restart

    return JobAttempt("torchrun-job", (Restart("torchrun", restart, 2),), agent_store=("127.0.0.1", port))


def test_restarted_attempts_on_torchruns_agent_store_never_meet_earlier_keys():
    """Two ranks rendezvous on a store that outlives them (torchrun's agent store): each attempt,
    and each rendezvous within one, sees only its own keys; an attempt missing a rank fails naming it."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from lit_dp.job.process_group import _rendezvous
    from tests.helpers.distributed import free_port

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the agent's

    def both_ranks(attempt):
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_rendezvous, _rank_env(r, port), timedelta(seconds=20), None, attempt) for r in (0, 1)]
            return [future.result(timeout=30) for future in futures]

    first = both_ranks(_torchrun_attempt(0, port))
    first[1].set("address/1", "attempt 0's listening socket")  # what Gloo publishes for rank 1
    again = both_ranks(_torchrun_attempt(0, port))  # a second fit of the same attempt
    restarted = both_ranks(_torchrun_attempt(1, port))
    for stores in (again, restarted):
        assert not any(store.check(["address/1"]) for store in stores)
    assert first[0].check(["address/1"])

    # Attempt 2 without rank 1: attempt 0's and 1's arrivals must not count for it.
    with pytest.raises(RuntimeError) as error:
        _rendezvous(_rank_env(0, port), timedelta(seconds=1), None, _torchrun_attempt(2, port))
    message = str(error.value)
    assert "rank(s) [1] of world size 2 did not arrive" in message
    assert "(restart 2 of 2) within 1s" in message
    del agent_store


def allreduce_after_a_late_rank_zero(rank):
    import os
    import time

    import torch.distributed as dist

    if rank == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        time.sleep(2)  # rank 1 of the restart reaches Gloo's address exchange first
    init_parallel_env(timeout=30)
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return tensor.item()


def test_restarted_workers_build_the_process_group_on_the_agents_store():
    """Two attempts of a 2-rank job on one agent store, as under torchrun: before the attempt
    prefix, rank 1 of attempt 1 read rank 0's Gloo address from attempt 0 and failed with
    'Connection refused' in connectFullMesh."""
    import torch.distributed as dist

    from tests.helpers.distributed import free_port

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "1"}
    for restart in ("0", "1"):
        results = run_ranks(allreduce_after_a_late_rank_zero, 2, timeout=60, TORCHELASTIC_RESTART_COUNT=restart, **torchrun)
        assert results == {0: 3.0, 1: 3.0}
    del agent_store
