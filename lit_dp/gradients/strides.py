"""Views laid out like their parameters: the helpers of the gradient layout contract.

The contract itself, what a bucket view and a reduced gradient promise, is written where the
buckets keep it: ``lit_dp.gradients.dense``'s module docstring. The dense and scatter buckets
and the communication hooks' ``GradBucket.gradients()`` use these helpers.
"""

from __future__ import annotations

import torch


def is_dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill one block of memory exactly, in some order of
    dimensions (contiguous and ``channels_last`` are two such orders)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def shaped_like(piece: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``piece`` (a 1-D slice of ``param.numel()`` elements) viewed with ``param``'s sizes, and its
    strides when it is dense, else contiguous ones."""
    if is_dense(param):
        return piece.as_strided(param.shape, param.stride())
    return piece.view(param.shape)


def flat_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as one contiguous 1-D tensor (same storage, no copy)."""
    return tensor.as_strided((tensor.numel(),), (1,))


def like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` itself when it has ``param``'s layout and that layout is dense, else a copy in it."""
    if grad.stride() == param.stride() and is_dense(param):
        return grad
    return zeros_like_param(param).copy_(grad)  # rare: a gradient set by hand in another layout


def zeros_like_param(param: torch.Tensor) -> torch.Tensor:
    """Zeros in ``param``'s layout when it is dense, else contiguous."""
    return torch.zeros_like(param) if is_dense(param) else param.new_zeros(param.shape)
