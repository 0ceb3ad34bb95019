"""``DataParallel`` itself: without a process group, and its options."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn


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
