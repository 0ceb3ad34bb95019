"""Gradient-equivalence training: lit_dp, torch DDP and one process on the whole batch in lockstep.

Tolerances: torch.testing.assert_close's per-dtype defaults. Data-parallel averaging only
reorders floating-point sums (and rounds once more per rank in bf16/fp16), which those
defaults cover; a wrong bucket pairing or a missed average is off by O(1).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from unittest import mock

import torch
from torch import nn

from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

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


def assert_layout_contract(model: nn.Module, label: str) -> None:
    """Each dense gradient has its parameter's strides (the gradient layout contract, lit_dp.gradients.dense)."""
    for name, param in model.named_parameters():
        if param.grad is not None and not param.grad.is_sparse:
            assert param.grad.stride() == param.stride(), (
                f"{label}: {name}.grad has strides {param.grad.stride()}, its parameter {param.stride()}"
            )


def assert_same_parameters(model: nn.Module, reference: nn.Module, label: str) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, msg=lambda m: f"{label}: {name}: {m}")


def train_side_by_side(
    rank, name, comm_mb, last_mb, find_unused, as_view, accumulate=1, in_place_bytes=None, device="cpu"
):
    """Train lit_dp, torch DDP and a single-process reference in lockstep; compare every step."""
    import lit_dp.gradients.dense

    lit_dp.init_parallel_env()
    kind = torch.device(device).type
    threshold = lit_dp.gradients.dense.IN_PLACE_MIN_BYTES[kind] if in_place_bytes is None else in_place_bytes
    with mock.patch.dict(lit_dp.gradients.dense.IN_PLACE_MIN_BYTES, {kind: threshold}):
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
        assert_layout_contract(ours, label)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert_same_parameters(ours, reference, f"{name} after {STEPS} steps")
    rings_used = len({id(bucket.ring) for bucket in ours.reducer.buckets})
    return ours.reducer.bucket_indices, rings_used


def equivalence_cases(rank, cases, device="cpu"):
    return [train_side_by_side(rank, *case, device=device) for case in cases]
