"""Small models that exercise each reducer feature, with a loss that may depend on rank and step."""

from __future__ import annotations

import torch
from torch import nn

FEATURES = 6
BATCH_PER_RANK = 4


class Tied(nn.Module):
    """Registration order differs from use order (so buckets get rebuilt), and one weight is tied."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.middle = nn.Linear(8, 8)
        self.stem = nn.Linear(FEATURES, 8)
        self.decoder = nn.Linear(8, 8, bias=False)
        self.decoder.weight = self.middle.weight  # used twice in one forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.middle(h))
        h = torch.tanh(self.decoder(h))
        return self.head(h)


class MixedDtypes(nn.Module):
    """fp32, fp64, bf16 and fp16 parameters: each dtype gets its own buckets; one strided weight."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(FEATURES, 8)
        self.wide = nn.Linear(8, 8).double()
        self.scale_bf16 = nn.Parameter(torch.linspace(0.5, 1.5, 8).to(torch.bfloat16))
        self.scale_fp16 = nn.Parameter(torch.linspace(1.5, 0.5, 8).to(torch.float16))
        self.head = nn.Linear(8, 3)
        # Column-major: its gradient follows the parameter's strides, so it is not contiguous.
        self.head.weight = nn.Parameter(self.head.weight.detach().t().contiguous().t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.wide(h.double())).float()
        h = h * self.scale_bf16.float() * self.scale_fp16.float()
        return self.head(h)


class SparseEmbedding(nn.Module):
    """A sparse-gradient embedding next to dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x.abs() * 7).long().clamp(max=19)
        return self.head(self.embedding(tokens).mean(dim=1))


class Branches(nn.Module):
    """``always`` is used every step; ``sometimes`` when the caller says; ``never`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Linear(FEATURES, 3)
        self.sometimes = nn.Linear(FEATURES, 3)
        self.never = nn.Linear(FEATURES, 3)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        out = self.always(x)
        return out + self.sometimes(x) if use_sometimes else out


class ChannelsLast(nn.Module):
    """Convolutions whose weights are ``channels_last`` (non-contiguous but dense), as vision models
    converted with ``model.to(memory_format=torch.channels_last)`` have them; one of the weights
    is large enough to be all-reduced in place at a small threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(FEATURES, 4 * 4 * 4)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.wide = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, 3)
        self.conv.to(memory_format=torch.channels_last)
        self.wide.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = self.lift(x).view(-1, 4, 4, 4).contiguous(memory_format=torch.channels_last)
        features = torch.tanh(self.wide(torch.tanh(self.conv(image))))
        return self.head(features.mean(dim=(2, 3)))


class NormNet(nn.Module):
    """A BatchNorm between two layers: buffers (running statistics, a count) that differ per rank's data."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(FEATURES, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.stem(x))))


def batch(step: int, world_size: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(world_size * BATCH_PER_RANK, FEATURES, generator=generator)
    targets = torch.randn(world_size * BATCH_PER_RANK, 3, generator=generator)
    return inputs.to(device), targets.to(device)


def shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]


def uses_sometimes(rank: int, step: int) -> bool:
    """A used set that differs between ranks and between steps."""
    return (rank + step) % 2 == 0


def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    if isinstance(_inner(model), Branches):
        outputs = model(inputs, uses_sometimes(rank, step))
    else:
        outputs = model(inputs)
    return ((outputs - targets) ** 2).mean()


def reference_loss(model: nn.Module, step: int, world_size: int, device: str = "cpu") -> torch.Tensor:
    """What one process computes on the concatenated batch: the mean of the ranks' losses."""
    inputs, targets = batch(step, world_size, device)
    per_rank = [loss(model, shard(inputs, r), shard(targets, r), r, step) for r in range(world_size)]
    return torch.stack(per_rank).mean()


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


MODELS = {
    "tied": Tied,
    "mixed": MixedDtypes,
    "sparse": SparseEmbedding,
    "branches": Branches,
    "channels_last": ChannelsLast,
}
