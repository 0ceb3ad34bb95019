import os
import warnings
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lit_dp import ParallelEnv, get_rings, init_parallel_env
from lit_dp.job.launcher import describe_job
from lit_dp.job.process_group import backends_agree, resolve_backend, resolve_timeout
from tests.helpers.distributed import free_port, run_ranks


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


@pytest.mark.slow
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


@pytest.mark.slow
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


def train_one_step_under_the_launcher(rank):
    """A world of two from the launcher's variables: no warning, one all-reduce, averaged gradients."""
    import os
    import warnings

    import torch.distributed as dist
    from torch import nn

    import lit_dp

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = init_parallel_env(timeout=60)
    alone = [str(warning.message) for warning in caught if "world size is 1" in str(warning.message)]
    model = lit_dp.DataParallel(nn.Linear(1, 1, bias=False))
    model(torch.tensor([[float(rank + 1)]])).sum().backward()
    return {
        "group": (dist.get_rank(group), dist.get_world_size(group)),
        "alone": alone,
        "gradient": model.module.weight.grad.item(),
        "rendezvous": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_torchruns_and_slurms_variables_bring_up_one_world_never_lone_ranks(launcher):
    results = run_ranks(train_one_step_under_the_launcher, 2, timeout=120, launcher=launcher)
    assert [results[rank]["group"] for rank in (0, 1)] == [(0, 2), (1, 2)]
    assert all(not result["alone"] for result in results.values())
    assert all(result["gradient"] == 1.5 for result in results.values())  # the mean of 1 and 2, on both ranks
    if launcher == "slurm":  # derived by Lightning's SLURMEnvironment, which exports them as it does under the Trainer
        job_id = int(results[0]["rendezvous"][1]) - 15000
        assert results[0]["rendezvous"] == results[1]["rendezvous"] == ("localhost", str(15000 + job_id))


def adopt_or_refuse_an_existing_group(rank):
    """First a group of one per rank (a wrong layout), then torch's own env:// group of two."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        init_parallel_env()
    except RuntimeError as error:
        refusal = str(error)
    else:
        refusal = None
    dist.destroy_process_group()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # reads RANK, WORLD_SIZE, MASTER_* as under torchrun
    adopted = init_parallel_env(backend="gloo") is dist.group.WORLD
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return refusal, adopted, tensor.item()


def test_an_existing_group_is_adopted_when_it_agrees_and_refused_by_name_when_not():
    results = run_ranks(adopt_or_refuse_an_existing_group, 2, timeout=120, launcher="torchrun")
    prefix = "init_parallel_env: a process group of world size 1 exists (rank 0, gloo), but torchrun describes world size 2 (WORLD_SIZE=2)"
    assert results[0][0].startswith(prefix + ". Create the group from the launcher's own values"), results[0][0]
    assert results[1][0].startswith(prefix + " and rank 1 (RANK=1)."), results[1][0]
    assert [results[rank][1:] for rank in (0, 1)] == [(True, 3.0), (True, 3.0)]


def test_without_launcher_variables_an_existing_group_is_simply_adopted():
    from tests.helpers.groups import one_rank_group

    with mock.patch.dict(os.environ, {"PATH": os.environ.get("PATH", "")}, clear=True):
        group = one_rank_group()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            assert init_parallel_env() is group


def test_an_existing_group_on_another_backend_than_asked_for_is_named():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    with pytest.raises(RuntimeError) as error:
        init_parallel_env(backend="gloo", parallel_env=ParallelEnv({}))
    assert "a process group of world size 1 exists (rank 0, fake), but backend='gloo' was asked for (the backend argument)" in str(
        error.value
    )


@pytest.mark.parametrize(
    ("running", "asked", "agree"),
    [
        ("cpu:gloo,cuda:gloo", "gloo", True),
        ("cpu:gloo,cuda:nccl", "nccl", True),  # torch's default group runs NCCL for CUDA tensors
        ("cpu:gloo,cuda:nccl", "gloo", False),  # CUDA tensors would go through NCCL, not Gloo
        ("cpu:gloo", "cpu:gloo,cuda:nccl", True),
        ("cpu:gloo", "nccl", False),  # no device type in common
    ],
)
def test_backends_agree_on_every_device_type_both_name(running, asked, agree):
    assert backends_agree(running, asked) is agree


def test_a_torchrun_world_of_one_gets_a_group_as_from_init_process_group():
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "job"}
    with mock.patch.dict(os.environ, torchrun, clear=True):
        group = init_parallel_env(backend="gloo")
    assert group is dist.group.WORLD and dist.get_world_size(group) == 1


def test_one_rank_with_an_address_meets_there_as_ddp_does_and_leaves_the_environment_as_it_was():
    """The strategies' group of one rank: torch's env:// rendezvous at the launcher's address, the
    call Lightning's "ddp" makes; without an address, an in-memory store and no port bound."""
    port = free_port()
    with mock.patch.dict(os.environ, {"MASTER_PORT": "1"}, clear=True):
        init_parallel_env(backend="gloo", parallel_env=describe_job(0, 1, "127.0.0.1", port, 0), one_process_group=True)
        assert dict(os.environ) == {"MASTER_PORT": "1"}
    # The group's store listens at the address given: a client reaches it there.
    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)).set("reached", "yes")
    dist.destroy_process_group()
    with mock.patch("torch.distributed.init_process_group") as init:
        init_parallel_env(backend="gloo", parallel_env=describe_job(0, 1, None, None, 0), one_process_group=True)
    assert isinstance(init.call_args.kwargs["store"], dist.HashStore)


def _mocked_cuda_init(environ, **kwargs):
    """Run init_parallel_env as if on a machine with two GPUs and NCCL, recording what torch is asked."""
    with (
        mock.patch.dict(os.environ, environ, clear=True),
        mock.patch("torch.distributed.is_backend_available", return_value=True),
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.device_count", return_value=2),
        mock.patch("torch.cuda.set_device") as set_device,
        mock.patch("lit_dp.job.process_group.cuda_device_identity", return_value="host/GPU-1 (cuda:1)"),
        mock.patch("lit_dp.job.process_group._rendezvous", return_value=dist.HashStore()),
        mock.patch("torch.distributed.init_process_group") as init,
    ):
        init_parallel_env(**kwargs)
    return set_device, init


def test_nccl_gets_the_ranks_cuda_device_as_device_id_like_lightnings_ddp():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "job"}
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        set_device, init = _mocked_cuda_init(torchrun, backend=backend)
        set_device.assert_called_once_with(1)  # LOCAL_RANK, as Lightning's parallel_devices[local_rank]
        assert init.call_args.kwargs["device_id"] == torch.device("cuda", 1)
        assert (init.call_args.kwargs["rank"], init.call_args.kwargs["world_size"]) == (1, 2)
    _, init = _mocked_cuda_init(torchrun, backend="gloo")
    assert init.call_args.kwargs["device_id"] is None  # Gloo on CPU tensors: no device to bind


def test_a_cuda_device_the_process_cannot_see_names_the_variable_that_chose_it():
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "job"}
    with pytest.raises(ValueError, match=r"LOCAL_RANK=3 selects CUDA device 3, but this process sees 2 CUDA device\(s\)"):
        _mocked_cuda_init(torchrun, backend="nccl")


def test_an_adopted_group_gets_the_rings_flags_nccl_nrings_asks_for():
    from tests.helpers.groups import one_rank_group

    group = one_rank_group()
    assert init_parallel_env(parallel_env=ParallelEnv({"FLAGS_nccl_nrings": "3"})) is group
    rings = get_rings()
    assert len(rings) == 3 and rings[0] is group
    assert init_parallel_env(parallel_env=ParallelEnv({"FLAGS_nccl_nrings": "3"})) is group
    assert get_rings()[1:] == rings[1:], "a second call keeps the rings it made"
