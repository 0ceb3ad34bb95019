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
    """nanoGPT's shape: token and position embeddings, pre-norm blocks, a tied output head.

    Small by default (the CPU recipe); ``n_layer=12, n_head=12, n_embd=768, block_size=1024``
    is GPT-2 small, with ``vocab_size=50304`` (GPT-2's 50257 padded to a multiple of 64) or
    the byte vocabulary of 256.
    """

    def __init__(
        self,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is invalid: expected a multiple of model.n_head={n_head}.")
        if vocab_size < 1:
            raise ValueError(f"model.vocab_size={vocab_size} is invalid: expected a positive number of tokens.")
        self.save_hyperparameters()
        self.tokens = nn.Embedding(vocab_size, n_embd)
        self.positions = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # weight tying: one parameter used twice per step
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.tokens(tokens) + self.positions(positions))
        return self.head(self.norm(x))

    def flops_per_token(self, length: int) -> float:
        """Training FLOPs per token at sequence length ``length``: nanoGPT's ``estimate_mfu``.

        6 FLOPs per parameter and token (forward 2, backward 4; PaLM, appendix B) for the
        parameters outside the position embedding, plus the attention scores and their use,
        12 * layers * width * length, which no parameter accounts for.
        """
        matmul_params = sum(p.numel() for p in self.parameters()) - self.positions.weight.numel()
        return 6 * matmul_params + 12 * self.hparams.n_layer * self.hparams.n_embd * length

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
