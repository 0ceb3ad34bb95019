"""The multi-GPU lane: NCCL with 2 ranks, one GPU each (docs/reliability.md, "Stuck ranks").

    python -m pytest -m cuda tests/test_multi_gpu.py

On a node with 2 or more CUDA devices: the hang watchdog on NCCL (a collective is judged by its
device completion, not its future, which NCCL completes at enqueue), gradient equivalence with
NCCL's ``ReduceOp.AVG`` and in-place buckets, and sharding stage 2's ``reduce_scatter``, each
against one process on the whole batch. Skipped, saying why, with fewer devices; the CUDA event
that watches a collective after its wait needs one device only. (The single-GPU paths:
``tests/test_cuda.py``.)
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.equivalence import IN_PLACE_BYTES, TINY_MB, equivalence_cases
from tests.helpers.jobs import run_job
from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.cuda
needs_two_gpus = pytest.mark.skipif(
    GPUS < 2,
    reason=f"needs 2 CUDA devices for NCCL with 2 ranks, one each (found {GPUS}); on a multi-GPU node run "
    "python -m pytest -m cuda tests/test_multi_gpu.py",
)
NCCL = {"PADDLE_DISTRI_BACKEND": "nccl", "PADDLE_PG_TIMEOUT": "120000"}
HANG_TIMEOUT = 2.0


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_after_its_wait_a_collective_is_watched_by_a_cuda_event_on_the_current_stream():
    from lit_dp.gradients.waiting import Waiter

    class Enqueued:  # an NCCL work: done at enqueue for the host, pending on the device
        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return False

    waiter = Waiter()
    waiter.watch(1.0, lambda what, since: None, bounded=False, device=torch.device("cuda"))
    torch.cuda._sleep(2_000_000_000)  # the stream is busy for about a second: the collective "runs"
    waiter.wait(Enqueued(), "bucket 0")
    assert waiter.overdue(time.monotonic() + 2) is not None, "the device has not reached the event yet"
    torch.cuda.synchronize()
    assert waiter.overdue(time.monotonic() + 2) is None, "the event completed with the stream"


def _on_own_gpu(rank: int) -> None:
    os.environ["FLAGS_selected_gpus"] = str(rank)  # in the rank's own process


def equivalence_on_nccl(rank: int) -> list:
    from lit_dp.gradients.dense import averaging_op

    _on_own_gpu(rank)
    cases = [
        ("tied", TINY_MB, TINY_MB, False, False, 1, IN_PLACE_BYTES),  # in-place members beside flat ones
        ("tied", TINY_MB, TINY_MB, False, True, 2, IN_PLACE_BYTES),  # bucket views, no_sync
        ("branches", 25, 1, True, False, 2, IN_PLACE_BYTES),  # find_unused
        ("mixed", TINY_MB, TINY_MB, False, False, 1),  # fp32/fp64/bf16/fp16 buckets
    ]
    results = equivalence_cases(rank, cases, "cuda")
    import torch.distributed as dist

    assert dist.get_backend() == "nccl" and averaging_op(dist.group.WORLD) == dist.ReduceOp.AVG
    return results


@needs_two_gpus
def test_nccl_ranks_average_with_avg_and_in_place_buckets_as_one_process_and_ddp():
    results = run_ranks(equivalence_on_nccl, 2, timeout=300, **NCCL)
    assert results[0] == results[1]


def sharded_on_nccl(rank: int) -> None:
    import lit_dp
    from lit_dp.gradients.scatter import ScatterBucket

    _on_own_gpu(rank)
    lit_dp.init_parallel_env()
    torch.manual_seed(0)
    base = MODELS["tied"]().cuda()
    reference = copy.deepcopy(base)
    model = lit_dp.DataParallel(base, sharding_stage=2, comm_buffer_size=TINY_MB, last_comm_buffer_size=TINY_MB)
    scatters = [bucket for bucket in model.reducer.buckets if isinstance(bucket, ScatterBucket)]
    assert scatters and all(bucket.reduce_scatter for bucket in scatters), "stage 2 on NCCL reduce-scatters"
    optimizer = lit_dp.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(3):
        inputs, targets = batch(step, 2, "cuda")
        loss(model, shard(inputs, rank), shard(targets, rank), rank, step).backward()
        reference_loss(reference, step, 2, "cuda").backward()
        for each in (optimizer, reference_optimizer):
            each.step()
            each.zero_grad()
    for (name, ours), theirs in zip(base.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, msg=lambda m: f"{name}: {m}")


@needs_two_gpus
def test_nccl_sharding_stage_2_reduce_scatters_and_matches_one_process():
    run_ranks(sharded_on_nccl, 2, timeout=300, **NCCL)


def stuck_on_nccl(rank: int, directory: str) -> None:
    import lit_dp

    _on_own_gpu(rank)
    lit_dp.init_parallel_env()
    model = lit_dp.DataParallel(nn.Linear(64, 64).cuda(), hang_timeout=HANG_TIMEOUT)
    model.watchdog.directory = directory
    for step in range(50):
        if step == 3 and rank == 1:
            time.sleep(60)  # stuck in user code; rank 0's host goes on, its GPU waits in the all-reduce
        model(torch.randn(8, 64, device="cuda")).square().mean().backward()
        model.module.weight.grad.sum().item()  # a host synchronisation, as logging a loss would be


@needs_two_gpus
def test_on_nccl_a_stuck_rank_is_caught_by_the_device_completion_and_every_rank_ends(tmp_path):
    ends = run_job(stuck_on_nccl, 2, tmp_path, str(tmp_path), timeout=180, **NCCL)
    summary = ends[0].stderr
    assert "a bucket of synchronised step 3 waited" in summary, summary
    assert "rank 1 never launched bucket" in summary and "in stuck_on_nccl" in summary, summary
    for rank, end in ends.items():
        assert end.ok is not True and (end.ok is False or end.exitcode == 1), (rank, end)
