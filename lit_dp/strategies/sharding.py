"""``sharding_stage``: the optimizers rebuilt over each rank's parameters, as a feature of both strategies.

Each optimizer the run sets up (those ``configure_optimizers`` built; each one given to
``fabric.setup``) becomes a ``lit_dp.ShardedOptimizer`` over the model wrapped last, before any
other feature sees it, so that they all keep the sharded one. The schedulers keep the optimizers
the user built, whose parameter groups the sharded ones share (``lit_dp.sharding``).

With ``sharding_overlap`` a step leaves the parameters' gather in flight until the next forward
needs them (``DataParallel.wait_for_parameters`` waits for it): this feature waits before
validation and before the run ends (LocalSGD's last average reads every parameter), and exposes
``strategy.wait_for_parameters()``, which the strategies call before reading the model's state
for a checkpoint, where no hook comes first (without sharding it has nothing to wait for).

It refuses, before the model is wrapped, what would let ranks disagree: a gradient scaler under stage 2
(its inf checks would see this rank's gradients only), and the Trainer's clipping by norm with a
precision plugin that takes this rank's norm only (``lit_dp.strategies.precision``).
"""

from __future__ import annotations

import logging
from typing import Any

from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.options import Options
from lit_dp.sharding import ShardedOptimizer
from lit_dp.strategies.feature import Feature, Run
from lit_dp.strategies.precision import check_sharded_clipping

log = logging.getLogger(__name__)


def _nothing_in_flight() -> None:
    """``strategy.wait_for_parameters()`` without sharding: no gather is ever in flight."""


class ShardedOptimizers(Feature):
    """``sharding_stage=1`` or ``2``: every optimizer set up becomes a ``ShardedOptimizer`` over the wrapped model."""

    exposes = {"wait_for_parameters": _nothing_in_flight}

    def __init__(self, stage: int) -> None:
        self._stage = stage
        self._model: DataParallel | None = None  # the model wrapped last, from setup to teardown

    @classmethod
    @override
    def build(cls, options: Options) -> ShardedOptimizers | None:
        return cls(options.sharding.stage) if options.sharding.stage is not None else None

    @override
    def wrapper_arguments(self, run: Run, arguments: dict[str, Any]) -> dict[str, Any]:
        """Before the model is wrapped (a fit's, or one given to ``fabric.setup``): refuse what would let the ranks
        disagree."""
        trainer = run.trainer
        # The Trainer's name for the precision plugin, else Fabric's.
        precision = getattr(run.strategy, "precision_plugin", None) or run.strategy.precision
        if self._stage == 2 and getattr(precision, "scaler", None) is not None:
            raise ValueError(
                "sharding_stage=2 with precision='16-mixed' (a gradient scaler) is invalid: each rank holds only its "
                "own gradients, so the scaler's inf checks would differ between ranks; expected precision "
                "'bf16-mixed' or '32-true', or sharding_stage=1."
            )
        if trainer is not None:
            check_sharded_clipping(precision, self._stage, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        return arguments

    @override
    def setup(self, run: Run) -> None:
        if run.model is not None:  # None: the Trainer's validate, test or predict, which wrap nothing
            self._model = run.model

    @override
    def setup_optimizer(self, optimizer: Any) -> Any:
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer
        if self._model is None:
            raise RuntimeError(
                f"sharding_stage={self._stage}: set up the model (lit_dp.DataParallel) before its optimizers, so "
                "that they know which parameters this rank owns."
            )
        log.debug(
            "sharding.stage=%s: %s rebuilt over this rank's parameters (lit_dp.ShardedOptimizer)",
            self._stage,
            type(optimizer).__name__,
        )
        return ShardedOptimizer(optimizer, self._model)

    def wait_for_parameters(self) -> None:
        """``strategy.wait_for_parameters()``: with ``sharding_overlap``, finish gathering the updated parameters,
        before they are read outside a forward."""
        if self._model is not None:
            self._model.wait_for_parameters()

    @override
    def on_validation_start(self) -> None:
        self.wait_for_parameters()

    @override
    def on_train_end(self) -> None:
        self.wait_for_parameters()

    @override
    def teardown(self) -> None:
        self._model = None
