"""Sharding stage 2 in the reducer (``ScatterBucket``): each rank ends backward with its own averages only.

Real gloo processes, 2 and 3 ranks. Oracle: one process on the whole batch; every owned
gradient equals its gradient there (torch.testing's per-dtype tolerances: averaging only
reorders sums), every other gradient is None, and the gradient storage a rank keeps is exactly
the bytes of the parameters it owns. Weights stay fixed (no optimizer here: stepping is
tests/test_sharding.py's), so each step checks the reduction afresh, across the ready-order
rebuild and the autotuner's rebuilds.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.equivalence import IN_PLACE_BYTES, TINY_MB
from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

STEPS = 3
KB = 1024 / 2**20
# (model, find_unused_parameters, micro-batches per step, collective): "reduce" is Gloo's own
# path (one reduce per owner); "reduce_scatter" is NCCL's, forced onto Gloo here.
CASES = [
    ("tied", False, 1, "reduce"),
    ("tied", False, 2, "reduce_scatter"),
    ("mixed", False, 1, "reduce"),
    ("mixed", False, 1, "reduce_scatter"),
    ("branches", True, 2, "reduce"),
    ("branches", True, 1, "reduce_scatter"),
]


def storage_bytes(grads: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``grads`` (views into one buffer count once)."""
    storages = {grad.untyped_storage().data_ptr(): grad.untyped_storage().nbytes() for grad in grads}
    return sum(storages.values())


def check_step(model, reference, rank: int, label: str) -> None:
    sizes = [p.numel() * p.element_size() for p in model.module.parameters()]
    owned = sum(size for size, p in zip(sizes, model.module.parameters()) if model.owner_of(p) == rank)
    assert owned <= sum(sizes) / dist.get_world_size() + max(sizes), f"{label}: {owned} bytes owned of {sizes}"
    owned_bytes, grads = 0, []
    for (name, param), ref in zip(model.module.named_parameters(), reference.parameters()):
        if model.owner_of(param) != rank:
            assert param.grad is None, f"{label}: {name} is not owned here but kept its gradient"
            continue
        if ref.grad is None:  # no rank used it: left untouched, as without sharding
            assert param.grad is None, f"{label}: {name} got a gradient no rank produced"
            continue
        torch.testing.assert_close(param.grad, ref.grad, msg=lambda m: f"{label}: {name}: {m}")
        owned_bytes += param.numel() * param.element_size()
        grads.append(param.grad)
    assert storage_bytes(grads) == owned_bytes, (
        f"{label}: gradient storage {storage_bytes(grads)} != owned {owned_bytes}"
    )


def train(rank, world_size, name, find_unused, accumulate, model, reference, steps=STEPS, label=""):
    for step in range(steps):
        for micro in range(accumulate):
            seed = step * accumulate + micro
            inputs, targets = batch(seed, world_size)
            with model.no_sync() if micro < accumulate - 1 else nullcontext():
                loss(model, shard(inputs, rank), shard(targets, rank), rank, seed).backward()
            reference_loss(reference, seed, world_size).backward()
        check_step(model, reference, rank, f"{label}{name} step {step} rank {rank}")
        for module in (model, reference):
            module.zero_grad(set_to_none=step % 2 == 0)  # both kinds of zero_grad keep working


def scatter_cases(rank: int) -> dict:
    import lit_dp
    import lit_dp.gradients.dense
    import lit_dp.gradients.scatter
    import lit_dp.observability.autotune

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    with mock.patch.dict(lit_dp.gradients.dense.IN_PLACE_MIN_BYTES, {"cpu": IN_PLACE_BYTES}):
        for name, find_unused, accumulate, path in CASES:
            backends = {"nccl", "gloo"} if path == "reduce_scatter" else {"nccl"}
            with mock.patch.object(lit_dp.gradients.scatter, "REDUCE_SCATTER_BACKENDS", frozenset(backends)):
                torch.manual_seed(0)
                base = MODELS[name]()
                reference = copy.deepcopy(base)
                model = lit_dp.DataParallel(
                    base, comm_buffer_size=TINY_MB, last_comm_buffer_size=TINY_MB,
                    find_unused_parameters=find_unused, sharding_stage=2,
                )  # fmt: skip
                train(rank, world_size, name, find_unused, accumulate, model, reference, label=f"{path} ")

        if world_size > 2:  # the autotuner's part runs on 2 ranks only: 3 processes share 2 cores here
            return {}
        # Statistics see the reduce-to-owner buckets; the autotuner's rebuilds keep gradients exact.
        torch.manual_seed(0)
        hidden = [layer for _ in range(3) for layer in (nn.Linear(64, 64), nn.Tanh())]
        base = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), *hidden, nn.Linear(64, 3))
        reference = copy.deepcopy(base)
        with mock.patch.multiple(lit_dp.observability.autotune, CANDIDATES_MB=(4 * KB, 1.0), TUNING_STEPS=20):
            model = lit_dp.DataParallel(
                base, comm_buffer_size="auto", last_comm_buffer_size=4 * KB, comm_stats=True, sharding_stage=2
            )
        layouts = set()
        steps = 0
        while model.autotuner.chosen_mb is None and steps < 40:
            train(rank, world_size, "auto", False, 1, model, reference, steps=1, label=f"step {steps} ")
            layouts.add(tuple(map(tuple, model.reducer.bucket_indices)))
            steps += 1
        stats = model.comm_stats()
    gradient_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    return {"layouts": len(layouts), "chosen": model.comm_buffer_size, "bytes": stats.bytes, "expected": gradient_bytes}


@pytest.mark.slow
def test_stage_two_keeps_only_owned_averages_on_two_and_three_ranks():
    run_ranks(scatter_cases, 3, timeout=120)
    for result in run_ranks(scatter_cases, 2, timeout=120).values():
        assert result["chosen"] in (4 * KB, 1.0), result
        assert result["layouts"] >= 2, f"the autotuner never rebuilt the buckets: {result}"
        assert result["bytes"] == result["expected"], result
