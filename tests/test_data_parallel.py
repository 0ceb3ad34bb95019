"""lit_dp.DataParallel on real gloo processes, against one process on the whole batch and torch DDP.

Tolerances: torch.testing.assert_close's per-dtype defaults. Data-parallel averaging only
reorders floating-point sums (and rounds once more per rank in bf16/fp16), which those
defaults cover; a wrong bucket pairing or a missed average is off by O(1).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.models import MODELS, batch, loss, reference_loss, shard

TINY_MB = 64 / 2**20  # 64-byte buckets: nearly one bucket per parameter
# Test parameters are far below the default in-place threshold (4 MB on CPU); at 64 bytes most
# weights are all-reduced in place while biases and small scales share the flat buffer.
IN_PLACE_BYTES = 64
STEPS = 3


def assert_same_gradients(model: nn.Module, reference: nn.Module, label: str) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        if ref.grad is None:
            assert param.grad is None, f"{label}: {name} should have no gradient"
            continue
        assert param.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(param.grad.to_dense(), ref.grad.to_dense(), msg=lambda m: f"{label}: {name}: {m}")


def assert_same_parameters(model: nn.Module, reference: nn.Module, label: str) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, msg=lambda m: f"{label}: {name}: {m}")


def train_side_by_side(
    rank, name, comm_mb, last_mb, find_unused, as_view, accumulate=1, in_place_bytes=None, device="cpu"
):
    """Train lit_dp, torch DDP and a single-process reference in lockstep; compare every step."""
    import lit_dp.dense

    lit_dp.init_parallel_env()
    kind = torch.device(device).type
    threshold = lit_dp.dense.IN_PLACE_MIN_BYTES[kind] if in_place_bytes is None else in_place_bytes
    with mock.patch.dict(lit_dp.dense.IN_PLACE_MIN_BYTES, {kind: threshold}):
        return _train_side_by_side(rank, name, comm_mb, last_mb, find_unused, as_view, accumulate, device)


def _train_side_by_side(rank, name, comm_mb, last_mb, find_unused, as_view, accumulate, device):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp

    world_size = dist.get_world_size()
    torch.manual_seed(0)
    base = MODELS[name]().to(device)
    reference, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    if rank > 0:  # a different initialisation on other ranks: construction must broadcast rank 0's
        with torch.no_grad():
            for param in base.parameters():
                param.add_(1.0)
    ours = lit_dp.DataParallel(
        base,
        comm_buffer_size=comm_mb,
        last_comm_buffer_size=last_mb,
        find_unused_parameters=find_unused,
        gradient_as_bucket_view=as_view,
    )
    ddp = DistributedDataParallel(ddp_model, bucket_cap_mb=comm_mb, find_unused_parameters=find_unused)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ddp, reference)]
    for step in range(STEPS):
        for micro in range(accumulate):
            seed = step * accumulate + micro
            inputs, targets = batch(seed, world_size, device)
            for model in (ours, ddp):
                last = micro == accumulate - 1
                with model.no_sync() if not last else nullcontext():
                    loss(model, shard(inputs, rank), shard(targets, rank), rank, seed).backward()
            reference_loss(reference, seed, world_size, device).backward()
        label = f"{name} step {step} rank {rank}"
        assert_same_gradients(ours, reference, f"{label} vs single process")
        assert_same_gradients(ours, ddp, f"{label} vs DDP")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert_same_parameters(ours, reference, f"{name} after {STEPS} steps")
    rings_used = len({id(bucket.ring) for bucket in ours.reducer._buckets})
    return ours.reducer.bucket_indices, rings_used


def equivalence_cases(rank, cases, device="cpu"):
    return [train_side_by_side(rank, *case, device=device) for case in cases]


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


@pytest.mark.slow
def test_two_ranks_match_single_process_and_ddp():
    results = run_ranks(equivalence_cases, 2, TWO_RANK_CASES, timeout=240)
    # Rebuilt buckets are identical on every rank (rank 0's ready order was agreed).
    assert results[0] == results[1]


@pytest.mark.slow
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
    buffers = [bucket.buffer for bucket in viewed.reducer._buckets]
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
    report["buffer_numel"] = sum(bucket.buffer.numel() for bucket in big.reducer._buckets)

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

    # state_dict: the inner module's keys, loadable into the plain model and back.
    state = wrapped.state_dict()
    report["state_keys"] = sorted(state) == sorted(experts.state_dict())
    wrapped.load_state_dict(MODELS["tied"]().state_dict())

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
    import lit_dp.dense

    lit_dp.init_parallel_env()
    with mock.patch.dict(lit_dp.dense.IN_PLACE_MIN_BYTES, cpu=in_place_bytes):
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


def different_models(rank):
    import lit_dp

    lit_dp.init_parallel_env()
    lit_dp.DataParallel(nn.Linear(4, 4 + rank))


def test_models_that_differ_between_ranks_fail_on_every_rank_by_name():
    failures = run_ranks(different_models, 2, expect_failure=True, timeout=60)
    assert sorted(failures) == [0, 1]
    for trace in failures.values():
        assert "ranks [1] differ from rank 0" in trace
        assert "weight: rank 0 has shape [4, 4] torch.float32, rank 1 has shape [5, 4] torch.float32" in trace


def sparse_allgather_matches_allreduce(rank):
    import torch.distributed as dist

    import lit_dp
    from lit_dp.sparse import allgather_sparse_sum

    lit_dp.init_parallel_env()
    indices = torch.tensor([[rank, 3, 5 + rank]])
    gradient = torch.sparse_coo_tensor(indices, torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)), (9, 4))
    gathered = allgather_sparse_sum(gradient, dist.group.WORLD)
    reduced = gradient.coalesce()
    dist.all_reduce(reduced)
    torch.testing.assert_close(gathered.to_dense(), reduced.to_dense())


def test_sparse_allgather_path_equals_gloo_sparse_allreduce():
    run_ranks(sparse_allgather_matches_allreduce, 3)


def test_world_size_one_runs_the_module_unchanged():
    module = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="world size is 1"):
        wrapped = __import__("lit_dp").DataParallel(module)
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapped(x), module(x))
    assert wrapped.reducer is None
    with wrapped.no_sync():
        wrapped(x).sum().backward()
    assert module.weight.grad is not None


@pytest.mark.parametrize(("option", "value"), [("comm_buffer_size", 0), ("last_comm_buffer_size", -1)])
def test_bucket_size_options_are_validated(option, value):
    with warnings.catch_warnings(), pytest.raises(ValueError, match=f"{option}={value} is invalid"):
        warnings.simplefilter("ignore")
        __import__("lit_dp").DataParallel(nn.Linear(2, 2), **{option: value})
