"""A small GPT-style byte-level language model on the Python standard library's own source.

The text is on every machine that runs Python, so the recipe needs no download.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256  # bytes


def stdlib_text(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of the standard library's .py files, in a stable (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class Windows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: input and next-byte targets."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    def __init__(self, max_bytes: int = 1_000_000, block_size: int = 64, batch_size: int = 32, val_fraction: float = 0.1):
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction!r} is invalid: expected a number in (0, 1).")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction

    def setup(self, stage: str | None = None) -> None:
        data = torch.frombuffer(bytearray(stdlib_text(self.max_bytes)), dtype=torch.uint8)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = Windows(data[:split], self.block_size)
        self.val_set = Windows(data[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: with N(0, 1) embeddings the tied head starts with huge logits.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CharGPT(pl.LightningModule):
    """nanoGPT's shape, small: token and position embeddings, pre-norm blocks, a tied output head."""

    def __init__(
        self,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is invalid: expected a multiple of model.n_head={n_head}.")
        self.save_hyperparameters()
        self.tokens = nn.Embedding(VOCAB_SIZE, n_embd)
        self.positions = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        self.head.weight = self.tokens.weight  # weight tying: one parameter used twice per step
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.tokens(tokens) + self.positions(positions))
        return self.head(self.norm(x))

    def _loss(self, batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)
        self.log("val_bits_per_byte", loss / math.log(2), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
