"""DenseBucket's data path in one process: which gradients go in place, the flat buffer's layout,
the flags, the copy in and out, the write-back. The multi-rank numerics are in test_reducer.py."""

from __future__ import annotations

from unittest import mock

import torch
from torch import nn

import lit_dp.gradients.dense
from lit_dp.gradients.dense import DenseBucket
from lit_dp.gradients.plan import Participation, StepPlan
from tests.helpers.groups import one_rank_group

MISSING_HERE = StepPlan.decide(Participation.SYNC, find_unused_parameters=False, divisor=1)
USED_HERE = StepPlan.decide(Participation.SYNC, find_unused_parameters=True, divisor=1)


def parameters() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(3))]


def bucket_with_in_place_threshold(params: list[nn.Parameter], threshold: int, as_view: bool = False) -> DenseBucket:
    with mock.patch.dict(lit_dp.gradients.dense.IN_PLACE_MIN_BYTES, cpu=threshold):
        bucket = DenseBucket([0, 1, 2], params, one_rank_group(), as_view)
    bucket.alone = False  # exercise the collectives and copies a group of one rank would skip
    return bucket


def test_large_gradients_go_in_place_and_the_rest_share_a_buffer_with_the_flags():
    params = parameters()
    bucket = bucket_with_in_place_threshold(params, threshold=64 * 64 * 4)
    assert bucket.in_place == [1] and bucket.flat == [0, 2]
    assert bucket.buffer.numel() == 16 + 3 + 3  # the flat gradients, then one flag per member
    views = bucket.views
    assert views[1] is None and views[0].shape == (4, 4) and views[2].shape == (3,)
    assert views[0].untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
    assert bucket.sent_bytes() == sum(p.numel() * 4 for p in params)


def test_a_launch_reduces_present_gradients_flags_the_missing_and_writes_averages_back():
    params = parameters()
    bucket = bucket_with_in_place_threshold(params, threshold=64 * 64 * 4)
    grads = [torch.full_like(p, 2.0) for p in params]
    params[0].grad, params[1].grad = grads[0].clone(), grads[1].clone()  # params[2] got no gradient
    used = bytearray([1, 1, 0])
    bucket.start(MISSING_HERE, used)
    assert len(bucket.futures()) == 2  # the in-place gradient's all-reduce and the buffer's
    bucket.wait()
    assert bucket.flags.tolist() == [0.0, 0.0, 1.0]  # "missing here" counts, summed over one rank
    bucket.write_back(as_view=False, skipped={2})
    torch.testing.assert_close(params[0].grad, grads[0])
    torch.testing.assert_close(params[1].grad, grads[1])
    assert params[2].grad is None  # skipped: left as it was


def test_a_complete_bucket_copies_back_into_the_gradients_it_launched_with():
    params = parameters()
    bucket = bucket_with_in_place_threshold(params, threshold=1 << 30)  # everything flat
    for p in params:
        p.grad = torch.ones_like(p)
    launched = [p.grad for p in params]
    bucket.start(USED_HERE, bytearray([1, 1, 1]), complete=True)
    bucket.buffer[:16].mul_(3.0)  # stands in for what the other ranks would add
    bucket.wait()
    bucket.write_back(as_view=False, skipped=())
    assert all(p.grad is grad for p, grad in zip(params, launched)), "the same tensors, written in place"
    torch.testing.assert_close(params[0].grad, torch.full((4, 4), 3.0))


def test_gradient_views_become_the_buffer_itself():
    params = parameters()
    bucket = bucket_with_in_place_threshold(params, threshold=1 << 30, as_view=True)
    params[0].grad = torch.ones(4, 4)
    bucket.start(USED_HERE, bytearray([1, 0, 0]))
    bucket.wait()
    bucket.write_back(as_view=True, skipped=())
    assert params[0].grad.data_ptr() == bucket.views[0].data_ptr()
    torch.testing.assert_close(params[0].grad, torch.ones(4, 4))
