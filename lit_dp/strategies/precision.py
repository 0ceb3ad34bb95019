"""The Trainer strategy's precision plugins: Lightning's, with the clipping data parallelism needs.

Lightning clips gradients through the precision plugin (``Trainer(gradient_clip_val=...)``,
``LightningModule.clip_gradients``) and has no strategy hook for it; a strategy that clips its own
way brings its own plugin, as Lightning's FSDP strategy brings ``FSDPPrecision``.
``lit_dp.PaddleDPStrategy`` turns the plugin the Trainer made for ``precision=`` into the matching
one of these (``for_data_parallel``); they differ from Lightning's in clipping only:

- a ``lit_dp.ShardedOptimizer`` (``sharding_stage``) is clipped by the norm over every rank's
  gradients (``ShardedOptimizer.clip_grad_norm_``): under stage 2 a rank holds only its own;
- an optimizer that unscales inside its step (``AdamW(fused=True)``; torch marks it with
  ``_step_supports_amp_scaling``) can be clipped under mixed precision. Lightning's
  ``MixedPrecision`` refuses to clip one even under ``bf16-mixed``, which has no scaler and
  nothing to unscale. Under ``16-mixed`` Lightning leaves its gradients scaled for the step to
  unscale; here they are unscaled after backward, as Lightning unscales every other optimizer's,
  so clipping and ``on_before_optimizer_step`` see the true gradients (Lightning's documented
  contract for that hook), and ``GradScaler.step`` then hands the fused step no scale, only the
  inf check (torch supports ``unscale_`` before ``step`` for these optimizers).

A plugin of the user's own class (a subclass of Lightning's, or another plugin) is kept as given,
with Lightning's clipping, as under ``"ddp"``; to have lit_dp's clipping, derive it from
``DataParallelClipping`` as well (``class MyPrecision(DataParallelClipping, MixedPrecision)``).
Under ``sharding_stage=2`` such a plugin would clip by this rank's norm only, so
``check_sharded_clipping`` refuses it with ``gradient_clip_val``.

Checkpoints keep the plugin's state under Lightning's class name (``"MixedPrecision"``: the
scaler), so a checkpoint moves between ``"ddp"`` and ``"paddle_dp"`` with its scaler.

Fabric has a strategy hook for clipping, so its strategy (``lit_dp.strategies.fabric``) clips
there, with Fabric's own plugins, unscaling with ``unscale_for_clipping`` from here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer
from typing_extensions import override

from lit_dp.sharding import ShardedOptimizer

log = logging.getLogger(__name__)


def handles_unscaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales gradients inside its step (``fused=True``): torch's mark on such optimizers."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def unscale_for_clipping(precision: Any, optimizer: Any) -> None:
    """Fabric: ``optimizer``'s gradients unscaled by ``precision`` (Fabric's plugin) before clipping, also an
    optimizer's that unscales in its step (``fused=True``).

    Fabric's ``MixedPrecision`` refuses those; torch lets ``GradScaler.unscale_`` run before ``step`` for
    them too, and the step then gets only the inf check, no scale.
    """
    scaler = getattr(precision, "scaler", None)
    if scaler is not None and handles_unscaling(optimizer):
        scaler.unscale_(optimizer)
    else:
        precision.unscale_gradients(optimizer)


class DataParallelClipping:
    """Clipping by the global norm for ``lit_dp.ShardedOptimizer``; put it before a Lightning plugin in the bases."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, ShardedOptimizer):
            inner.clip_grad_norm_(clip_val)  # one all-reduce of the owned gradients' norms
        else:
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning stores the state under `type(plugin).__qualname__`; "ddp" reads it under Lightning's
        # class's name, for which this module's plugins stand in.
        state = checkpoint.pop(type(self).__qualname__, None) if self._stands_in_for else None
        if state is not None:
            checkpoint[self._stands_in_for] = state
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Called before Lightning looks for this class's own name, which it does not find.
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        if self._stands_in_for and self._stands_in_for in checkpoint:
            self.load_state_dict(checkpoint[self._stands_in_for])  # type: ignore[attr-defined]

    @property
    def _stands_in_for(self) -> str | None:
        """For this module's plugins, the name of the Lightning class among their bases (``MixedPrecision``)."""
        if type(self).__module__ != __name__:
            return None  # a user's class keeps its own name, as under "ddp"
        return next(c for c in type(self).__mro__ if c.__module__.startswith("lightning.")).__qualname__


class DataParallelPrecision(DataParallelClipping, Precision):
    """``precision="32-true"``."""


class DataParallelDoublePrecision(DataParallelClipping, DoublePrecision):
    """``precision="64-true"``."""


class DataParallelHalfPrecision(DataParallelClipping, HalfPrecision):
    """``precision="bf16-true"`` or ``"16-true"``."""


class DataParallelMixedPrecision(DataParallelClipping, MixedPrecision):
    """``precision="bf16-mixed"`` or ``"16-mixed"``: fused optimizers can be clipped (see the module docstring)."""

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None or not handles_unscaling(optimizer):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        scaler = self.scaler

        def closure_then_unscale() -> Any:
            result = closure()
            if result is not None or not model.automatic_optimization:  # Lightning's condition: a backward ran
                scaler.unscale_(optimizer)
            return result

        return super().optimizer_step(optimizer, model=model, closure=closure_then_unscale, **kwargs)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # MixedPrecision refuses a fused optimizer because it leaves its gradients scaled; these
        # were unscaled in `optimizer_step` (16-mixed) or never scaled (bf16-mixed).
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


def for_data_parallel(plugin: Precision | None) -> Precision | None:
    """lit_dp's plugin for the precision ``plugin`` stands for, with its state (precision, device, the
    user's scaler); a plugin of another class (the user's own) as given."""
    if plugin is None or isinstance(plugin, DataParallelClipping):
        return plugin
    kind = type(plugin)
    if kind is MixedPrecision:
        converted: Precision = DataParallelMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    elif kind is HalfPrecision:
        converted = DataParallelHalfPrecision(plugin.precision)
    elif kind is DoublePrecision:
        converted = DataParallelDoublePrecision()
    elif kind is Precision:
        converted = DataParallelPrecision()
    else:
        log.debug("precision plugin %s kept as given: Lightning's clipping, as under \"ddp\"", kind.__qualname__)
        return plugin
    log.debug("precision %s: %s (lit_dp's clipping)", converted.precision, type(converted).__name__)
    return converted


def check_sharded_clipping(
    plugin: Precision, stage: int | None, gradient_clip_val: float | None, algorithm: str | None
) -> None:
    """Refuse ``gradient_clip_val`` by norm under ``sharding_stage=2`` with a plugin that takes this rank's norm only.

    Raises:
        ValueError: naming the plugin and what to do instead.
    """
    by_norm = gradient_clip_val and GradClipAlgorithmType(algorithm or "norm") == GradClipAlgorithmType.NORM
    if stage == 2 and by_norm and not isinstance(plugin, DataParallelClipping):
        raise ValueError(
            f"sharding_stage=2 with gradient_clip_val={gradient_clip_val} and the precision plugin "
            f"{type(plugin).__qualname__} is invalid: each rank holds only its own gradients, and that plugin's "
            "clipping would take this rank's norm only. Derive the plugin from "
            "lit_dp.strategies.precision.DataParallelClipping as well (it clips by the norm over every rank), "
            "or use sharding_stage=1."
        )
