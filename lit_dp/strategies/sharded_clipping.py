"""``Trainer(gradient_clip_val=...)`` under sharding: clip by the norm over every rank's gradients."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision

from lit_dp.sharding import ShardedOptimizer


def clip_sharded_by_global_norm(plugin: Precision) -> None:
    """Make ``gradient_clip_val`` (algorithm ``norm``) clip a ``ShardedOptimizer`` by the global norm.

    Lightning clips through the precision plugin, with ``torch.nn.utils.clip_grad_norm_`` over
    the optimizer's parameters; under stage 2 a rank holds only its own gradients, so that norm
    would be this rank's. Lightning has no strategy hook for clipping (its FSDP and DeepSpeed
    strategies bring their own precision plugins), so the plugin instance in use gets this
    method for sharded optimizers, and keeps its own for any other.
    """
    clip_grad_by_norm = plugin.clip_grad_by_norm
    if getattr(clip_grad_by_norm, "sharded", False):
        return

    def clip_sharded_by_norm(optimizer: Any, clip_val: float) -> None:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, ShardedOptimizer):
            inner.clip_grad_norm_(clip_val)
        else:
            clip_grad_by_norm(optimizer, clip_val)

    clip_sharded_by_norm.sharded = True  # type: ignore[attr-defined]
    plugin.clip_grad_by_norm = clip_sharded_by_norm  # type: ignore[method-assign]
