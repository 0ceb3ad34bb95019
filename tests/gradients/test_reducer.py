"""The reducer on real gloo processes (through ``DataParallel``): exact against one process on the
whole batch and against torch DDP, for every feature; overlap, rebuild order, views, in place,
missing gradients. Tolerances: see ``tests.helpers.equivalence``.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.equivalence import IN_PLACE_BYTES, TINY_MB, assert_same_gradients, equivalence_cases
from tests.helpers.models import MODELS, batch, loss, reference_loss, shard


# (model, comm MB, last MB, find_unused, gradient_as_bucket_view, accumulate[, in-place threshold])
ALL_IN_PLACE = ("branches", 25, 1, True, True, 1, 1)  # the flat buffers carry only flags
TWO_RANK_CASES = [
    ("tied", 25, 1, False, False, 1),
    ("tied", TINY_MB, TINY_MB, False, False, 1),
    ("tied", TINY_MB, TINY_MB, False, True, 1),
    ("mixed", TINY_MB, TINY_MB, False, False, 1),
    ("mixed", 25, 1, False, True, 1),
    ("sparse", TINY_MB, TINY_MB, False, False, 1),
    ("branches", TINY_MB, TINY_MB, True, False, 1),
    ("branches", 25, 1, True, True, 1),
    ("tied", TINY_MB, TINY_MB, False, False, 3),
    # `sometimes` is used only in some micro-steps of a rank, some of them under no_sync.
    ("branches", TINY_MB, TINY_MB, True, False, 2),
    ("branches", TINY_MB, TINY_MB, True, True, 2),
    ("sparse", 25, 1, True, False, 2),
    # Gradients all-reduced in place next to flat ones, in every combination above.
    ("tied", 25, 1, False, False, 1, IN_PLACE_BYTES),
    ("tied", TINY_MB, TINY_MB, False, True, 2, IN_PLACE_BYTES),
    ("mixed", TINY_MB, TINY_MB, False, False, 1, IN_PLACE_BYTES),
    ("branches", TINY_MB, TINY_MB, True, False, 2, IN_PLACE_BYTES),
    ALL_IN_PLACE,
    ("sparse", 25, 1, True, False, 1, IN_PLACE_BYTES),
]


def test_two_ranks_match_single_process_and_ddp():
    results = run_ranks(equivalence_cases, 2, TWO_RANK_CASES, timeout=240)
    # Rebuilt buckets are identical on every rank (rank 0's ready order was agreed).
    assert results[0] == results[1]


def test_three_ranks_match_single_process_and_ddp():
    cases = [c for c in TWO_RANK_CASES if c[0] in ("tied", "branches") and c[5] == 1][:3] + [ALL_IN_PLACE]
    results = run_ranks(equivalence_cases, 3, cases, timeout=240)
    assert results[0] == results[1] == results[2]


def test_two_rings_spread_buckets_and_stay_exact():
    results = run_ranks(equivalence_cases, 2, [("tied", TINY_MB, TINY_MB, False, False, 1)], FLAGS_nccl_nrings="2")
    assert results[0] == results[1]
    [(_, rings_used)] = results[0]
    assert rings_used == 2


def features_on_two_ranks(rank):
    """Overlap, rebuild order, views, no_sync parameters, state_dict, fused all-reduce."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    torch.manual_seed(0)
    report = {}

    # Overlap: when the input's gradient is computed, backward is not over; some buckets must
    # already have started their all-reduce by then.
    model = lit_dp.DataParallel(MODELS["tied"](), comm_buffer_size=TINY_MB, last_comm_buffer_size=TINY_MB)
    reducer = model.reducer
    inputs, targets = batch(0, 2)
    x = shard(inputs, rank).clone().requires_grad_()
    launched_when_input_grad_ready = []
    x.register_hook(lambda grad: launched_when_input_grad_ready.append(reducer.launched_buckets))
    loss(model, x, shard(targets, rank), rank, 0).backward()
    report["launched_mid_backward"] = launched_when_input_grad_ready[0]
    report["buckets"] = len(reducer.bucket_indices)
    report["launched_at_end"] = reducer.launched_buckets
    # The rebuild takes effect at the next synchronised forward.
    loss(model, shard(inputs, rank), shard(targets, rank), rank, 1).backward()
    # Rebuilt launch order follows gradient readiness: head (last in forward) first, stem last.
    names = [n for n, _ in model.module.named_parameters()]
    report["rebuilt_order"] = [[names[i] for i in bucket] for bucket in reducer.bucket_indices]
    report["rings"] = len(lit_dp.get_rings())

    # Gradient views: after a synchronised backward every .grad lives in a bucket buffer.
    viewed = lit_dp.DataParallel(MODELS["tied"](), gradient_as_bucket_view=True)
    for step in range(2):
        viewed.zero_grad(set_to_none=True)
        loss(viewed, shard(inputs, rank), shard(targets, rank), rank, step).backward()
    buffers = [bucket.buffer for bucket in viewed.reducer.buckets]
    report["views"] = all(
        any(p.grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
        for p in viewed.parameters()
    )

    # In place: a 4 MB weight is averaged in the very tensor autograd produced, and no bucket
    # buffer holds a copy of it.
    torch.manual_seed(2)
    big = lit_dp.DataParallel(nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 3)))
    reference = copy.deepcopy(big.module)
    weight = big.module[0].weight
    produced = []
    weight.register_post_accumulate_grad_hook(lambda param: produced.append(param.grad.data_ptr()))
    data = torch.randn(2 * len(inputs), 1024, generator=torch.Generator().manual_seed(5))
    big(data[rank::2]).square().mean().backward()
    torch.stack([reference(data[r::2]).square().mean() for r in range(2)]).mean().backward()
    assert_same_gradients(big.module, reference, "in place")
    report["in_place"] = produced == [weight.grad.data_ptr()]
    report["buffer_numel"] = sum(bucket.buffer.numel() for bucket in big.reducer.buckets)

    # no_sync parameters: neither broadcast nor reduced.
    experts = MODELS["tied"]()
    experts.head.weight.no_sync = True
    with torch.no_grad():
        experts.head.weight.fill_(float(rank + 1))
    wrapped = lit_dp.DataParallel(experts)
    assert torch.all(experts.head.weight == rank + 1), "a no_sync parameter was broadcast"
    loss(wrapped, shard(inputs, rank), shard(targets, rank), rank, 0).backward()
    local = MODELS["tied"]()
    local.load_state_dict(experts.state_dict())
    loss(local, shard(inputs, rank), shard(targets, rank), rank, 0).backward()
    torch.testing.assert_close(experts.head.weight.grad, local.head.weight.grad)
    report["expert_bias_is_averaged"] = not torch.equal(experts.head.bias.grad, local.head.bias.grad)

    # state_dict: DDP's keys (module.*); the wrapper loads its own form and the plain module's.
    state = wrapped.state_dict()
    report["state_keys"] = sorted(state) == sorted(f"module.{key}" for key in experts.state_dict())
    wrapped.load_state_dict(MODELS["tied"]().state_dict())
    wrapped.load_state_dict(state)

    # fused_allreduce_gradients after no_sync equals the synchronised gradient.
    torch.manual_seed(1)
    manual = lit_dp.DataParallel(MODELS["branches"](), find_unused_parameters=True)
    reference = copy.deepcopy(manual.module)
    with manual.no_sync():
        loss(manual, shard(inputs, rank), shard(targets, rank), rank, 0).backward()
    lit_dp.fused_allreduce_gradients(list(manual.parameters()))
    reference_loss(reference, 0, dist.get_world_size()).backward()
    assert_same_gradients(manual.module, reference, "fused_allreduce_gradients")
    return report


def test_overlap_rebuild_views_no_sync_params_and_state_dict():
    results = run_ranks(features_on_two_ranks, 2)
    for rank, report in results.items():
        assert report["buckets"] >= 3
        assert 0 < report["launched_mid_backward"] < report["buckets"], f"rank {rank}: no overlap: {report}"
        assert report["launched_at_end"] == report["buckets"]
        order = [name for bucket in report["rebuilt_order"] for name in bucket]
        assert order.index("head.weight") < order.index("middle.weight") < order.index("stem.weight")
        assert report["views"] and report["expert_bias_is_averaged"] and report["state_keys"]
        assert report["rings"] == 1
        assert report["in_place"], f"rank {rank}: the 4 MB gradient was copied"
        assert report["buffer_numel"] < 1024 * 1024, f"rank {rank}: a bucket buffer holds the 4 MB gradient"
    assert results[0]["rebuilt_order"] == results[1]["rebuilt_order"]


def missing_gradient(rank, in_place_bytes):
    import lit_dp.gradients.dense

    lit_dp.init_parallel_env()
    with mock.patch.dict(lit_dp.gradients.dense.IN_PLACE_MIN_BYTES, cpu=in_place_bytes):
        model = lit_dp.DataParallel(MODELS["branches"](), find_unused_parameters=False)
    inputs, targets = batch(0, 2)
    outputs = model(shard(inputs, rank), use_sometimes=rank == 0)
    ((outputs - shard(targets, rank)) ** 2).mean().backward()


@pytest.mark.parametrize("in_place_bytes", [4 * 2**20, 1], ids=["flat", "in_place"])
def test_unused_parameter_without_find_unused_raises_on_every_rank(in_place_bytes):
    failures = run_ranks(missing_gradient, 2, in_place_bytes, expect_failure=True, timeout=60)
    assert sorted(failures) == [0, 1], "every rank must raise, none may hang"
    for rank, trace in failures.items():
        assert "never.weight (missing on 2 of 2 ranks, including this one)" in trace
        expected = "sometimes.weight (missing on 1 of 2 ranks" + (", including this one)" if rank == 1 else ")")
        assert expected in trace
        assert "find_unused_parameters=True" in trace
