"""The gradient layout contract (``lit_dp.gradients.dense``): gradients keep their parameters' strides.

Pure checks of the layout helpers, then ``channels_last`` convolutions on real gloo processes:
gradients equal torch DDP's and the single process's (``tests.helpers.equivalence``, which also
checks every ``.grad``'s strides against its parameter's), through the flat buffers, as bucket
views and all-reduced in place; an in-place gradient is reduced in the very tensor autograd made,
and a hook's ``bucket.gradients()`` have the parameters' strides.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from lit_dp.gradients.hooks import GradBucket
from lit_dp.gradients.strides import flat_alias, is_dense, like_param, shaped_like
from tests.helpers.distributed import run_ranks
from tests.helpers.equivalence import IN_PLACE_BYTES, TINY_MB, equivalence_cases
from tests.helpers.models import MODELS, batch, loss, shard

CHANNELS_LAST = torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    ("tensor", "dense"),
    [
        (torch.randn(8, 4, 3, 3), True),
        (CHANNELS_LAST, True),
        (torch.randn(5, 7).t(), True),
        (torch.randn(1, 6, 1), True),
        (torch.randn(6, 1).expand(6, 4), False),  # stride 0: overlapping
        (torch.randn(6, 8)[:, :4], False),  # a slice: gaps
    ],
    ids=["contiguous", "channels_last", "transposed", "size-1 dims", "expanded", "sliced"],
)
def test_dense_layouts_are_recognised(tensor, dense):
    assert is_dense(tensor) is dense


def test_views_take_their_parameters_strides_over_one_slice_of_the_buffer():
    buffer = torch.arange(2 * CHANNELS_LAST.numel(), dtype=torch.float32)
    piece = buffer[CHANNELS_LAST.numel() :]
    view = shaped_like(piece, CHANNELS_LAST)
    assert view.stride() == CHANNELS_LAST.stride() and view.shape == CHANNELS_LAST.shape
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert sorted(view.reshape(-1).tolist()) == piece.tolist(), "the view covers its slice exactly"
    assert shaped_like(buffer[:24], torch.randn(6, 8)[:, :4]).is_contiguous(), "not dense: contiguous"
    alias = flat_alias(CHANNELS_LAST)
    assert alias.is_contiguous() and alias.data_ptr() == CHANNELS_LAST.data_ptr()
    assert sorted(alias.tolist()) == sorted(CHANNELS_LAST.reshape(-1).tolist())
    assert like_param(CHANNELS_LAST, CHANNELS_LAST) is CHANNELS_LAST, "the contract's layout: no copy"
    contiguous = CHANNELS_LAST.contiguous()
    relaid = like_param(contiguous, CHANNELS_LAST)
    assert relaid.stride() == CHANNELS_LAST.stride() and torch.equal(relaid, contiguous)


def test_hook_bucket_gradients_have_their_parameters_strides():
    params = [nn.Parameter(torch.randn(3)), nn.Parameter(CHANNELS_LAST.clone())]
    bucket = GradBucket(0, 1, torch.zeros(3 + CHANNELS_LAST.numel()), params)
    assert [g.stride() for g in bucket.gradients()] == [p.stride() for p in params]


# (model, comm MB, last MB, find_unused, gradient_as_bucket_view, accumulate[, in-place threshold])
CASES = [
    ("channels_last", 25, 1, False, False, 1),
    ("channels_last", TINY_MB, TINY_MB, False, True, 1),
    ("channels_last", 25, 1, False, False, 1, IN_PLACE_BYTES),
    ("channels_last", TINY_MB, TINY_MB, False, True, 2, IN_PLACE_BYTES),
]


def no_copies(rank):
    """The in-place member is reduced in autograd's own tensor; a bucket view is ``.grad``, with
    the parameter's strides, and a hook sees views with them."""
    import lit_dp
    import lit_dp.gradients.dense

    inputs, targets = batch(0, 2)
    report = {}
    with mock.patch.dict(lit_dp.gradients.dense.IN_PLACE_MIN_BYTES, cpu=IN_PLACE_BYTES):
        model = lit_dp.DataParallel(MODELS["channels_last"]())
    weight = model.module.wide.weight
    produced = []
    weight.register_post_accumulate_grad_hook(lambda param: produced.append(param.grad.data_ptr()))
    loss(model, shard(inputs, rank), shard(targets, rank), rank, 0).backward()
    report["in_place_kept"] = produced == [weight.grad.data_ptr()]

    viewed = lit_dp.DataParallel(MODELS["channels_last"](), gradient_as_bucket_view=True)
    for step in range(2):  # the second step runs on the buckets rebuilt in ready order
        viewed.zero_grad(set_to_none=True)
        loss(viewed, shard(inputs, rank), shard(targets, rank), rank, step).backward()
    buffers = {bucket.buffer.untyped_storage().data_ptr() for bucket in viewed.reducer.buckets}
    conv = viewed.module.conv.weight
    report["view"] = conv.grad.untyped_storage().data_ptr() in buffers and conv.grad.stride() == conv.stride()

    hooked = lit_dp.DataParallel(MODELS["channels_last"]())
    seen = []

    def record(state, bucket):
        seen.append([g.stride() == p.stride() for g, p in zip(bucket.gradients(), bucket.parameters())])
        future = torch.futures.Future()
        future.set_result(bucket.buffer() / 2)  # (not averaged: only the layout is looked at)
        return future

    hooked.register_comm_hook(None, record)
    loss(hooked, shard(inputs, rank), shard(targets, rank), rank, 0).backward()
    report["hook"] = bool(seen) and all(all(flags) for flags in seen)
    return report


def channels_last_cases(rank):
    equivalence_cases(rank, CASES)  # brings the process group up
    return no_copies(rank)


def test_channels_last_gradients_keep_their_strides_and_match_ddp_and_one_process():
    for rank, report in run_ranks(channels_last_cases, 2, timeout=240).items():
        assert report["in_place_kept"], f"rank {rank}: the channels_last gradient was copied to be reduced"
        assert report["view"], f"rank {rank}: .grad is not the bucket view in the parameter's layout"
        assert report["hook"], f"rank {rank}: bucket.gradients() lost the parameters' strides"
