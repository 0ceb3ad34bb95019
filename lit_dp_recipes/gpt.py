"""A GPT in nanoGPT's shape, with the GPT trainer's usual parts, as a LightningModule.

The model: token and position embeddings, pre-norm blocks, a head tied to the token
embedding. ``GPT()`` is the small CPU recipe's model (2 layers x 128, bytes);
``n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304`` is GPT-2 small.

The trainer's parts, as nanoGPT's ``train.py`` has them: AdamW with weight decay on matrices
only (embeddings and linear weights; not biases or norms), fused where the device has a fused
kernel; a linear warm-up then a cosine decay to ``min_lr``, stepped every optimizer step
(Lightning keeps its step count in checkpoints, so a resumed run continues the schedule).
Clipping and gradient accumulation are the Trainer's (``trainer.gradient_clip_val``,
``trainer.accumulate_grad_batches``).

For speed, ``forward(tokens, targets)`` returns the loss: the recipes' ``compile=true``
compiles this forward, the cross-entropy over the vocabulary included, and nothing of
``training_step`` (logging stays eager). The loss is logged as a tensor, never read back on
the host inside a step: Lightning converts it when it writes its logs.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from lit_dp_recipes.config import is_number


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


class GPT(pl.LightningModule):
    """nanoGPT's GPT and its training recipe (see the module docstring)."""

    METRICS = ("train_loss", "val_loss")  # what it logs (a test keeps them equal): the names `monitor` may take

    def __init__(
        self,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        vocab_size: int = 256,
        lr: float = 3e-3,
        min_lr: float = 3e-4,
        warmup_steps: int = 0,
        lr_decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        _check_model(block_size, n_layer, n_head, n_embd, dropout, vocab_size)
        _check_schedule(lr, min_lr, warmup_steps, lr_decay_steps, weight_decay, betas)
        self.save_hyperparameters()
        self.tokens = nn.Embedding(vocab_size, n_embd)
        self.positions = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # weight tying: one parameter used twice per step
        self.apply(_init_weights)
        # GPT-2's scaled initialisation of the projections into the residual stream.
        for block in self.blocks:
            for layer in (block.proj, block.mlp[-1]):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits, or with ``targets`` the mean cross-entropy (the logits then never leave the graph)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.tokens(tokens) + self.positions(positions))
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def flops_per_token(self, length: int) -> float:
        """Training FLOPs per token at sequence length ``length``: nanoGPT's ``estimate_mfu``.

        6 FLOPs per parameter and token (forward 2, backward 4; PaLM, appendix B) for the
        parameters outside the position embedding, plus the attention scores and their use,
        12 * layers * width * length, which no parameter accounts for.
        """
        matmul_params = sum(p.numel() for p in self.parameters()) - self.positions.weight.numel()
        return 6 * matmul_params + 12 * self.hparams.n_layer * self.hparams.n_embd * length

    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        self.log("train_loss", loss)  # a tensor, not on the progress bar: that would read it back every step
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(*batch), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = adamw(self, hp.lr, hp.weight_decay, hp.betas, self.device)
        decay_steps = hp.lr_decay_steps if hp.lr_decay_steps is not None else self.trainer.estimated_stepping_batches
        if not math.isfinite(decay_steps):
            raise ValueError(
                "model.lr_decay_steps=null needs a finite run to decay over: set trainer.max_steps or "
                "trainer.max_epochs, or model.lr_decay_steps."
            )
        decay_steps = int(decay_steps)

        # A function, not a callable object: LambdaLR leaves it out of checkpoints, so a resumed
        # run computes its rates from the config in force and the restored step count.
        def factor(step: int) -> float:
            return lr_at(step, hp.lr, hp.min_lr, hp.warmup_steps, decay_steps) / hp.lr

        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": LambdaLR(optimizer, factor), "interval": "step"}}


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """nanoGPT's ``get_lr``: linear warm-up over ``warmup_steps``, cosine down to ``min_lr`` at ``decay_steps``, then flat."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's split: weight decay on tensors of 2 or more dimensions (matmul weights, embeddings) only."""
    params = [p for p in module.parameters() if p.requires_grad]  # a tied parameter appears once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, "name": "decay"},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "name": "no_decay"},
    ]


def adamw(module: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], device: torch.device):
    """AdamW over ``decay_groups``, with the fused kernel where ``device`` has one (torch's own list)."""
    fused = device.type in _get_fused_kernels_supported_devices()
    return torch.optim.AdamW(decay_groups(module, weight_decay), lr=lr, betas=tuple(betas), fused=fused)


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: with N(0, 1) embeddings the tied head starts with huge logits.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _check_model(block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float, vocab_size: int) -> None:
    for option, value in (
        ("block_size", block_size), ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd), ("vocab_size", vocab_size)
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{option}={value!r} is invalid: expected a positive integer.")
    if n_embd % n_head:
        raise ValueError(f"model.n_embd={n_embd} is invalid: expected a multiple of model.n_head={n_head}.")
    if not (is_number(dropout) and 0 <= dropout < 1):
        raise ValueError(f"model.dropout={dropout!r} is invalid: expected a probability in [0, 1).")


def _check_schedule(
    lr: float, min_lr: float, warmup_steps: int, lr_decay_steps: int | None, weight_decay: float, betas
) -> None:
    if not (is_number(lr) and lr > 0):
        raise ValueError(f"model.lr={lr!r} is invalid: expected a positive learning rate.")
    if not (is_number(min_lr) and 0 <= min_lr <= lr):
        raise ValueError(f"model.min_lr={min_lr!r} is invalid: expected a rate in [0, model.lr={lr}].")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"model.warmup_steps={warmup_steps!r} is invalid: expected an integer >= 0.")
    if lr_decay_steps is not None and (
        isinstance(lr_decay_steps, bool) or not isinstance(lr_decay_steps, int) or lr_decay_steps < warmup_steps
    ):
        raise ValueError(
            f"model.lr_decay_steps={lr_decay_steps!r} is invalid: expected null (the run's length) or an integer "
            f">= model.warmup_steps={warmup_steps}."
        )
    if not (is_number(weight_decay) and weight_decay >= 0):
        raise ValueError(f"model.weight_decay={weight_decay!r} is invalid: expected a number >= 0.")
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"model.betas={list(betas)!r} is invalid: expected two numbers in [0, 1).")
