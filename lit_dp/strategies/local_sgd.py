"""LocalSGD's schedule: ``local_sgd_steps`` as a feature (``lit_dp.strategies.feature``), for both doors.

The averager (``lit_dp.LocalSGD``) is built over the wrapped model when a fit is set up (under
Fabric: when ``fabric.setup`` wraps the model), steps after each optimizer step (automatic and
manual optimization alike, and each ``optimizer.step()`` of a Fabric loop; accumulated
micro-batches do not count), finishes when training ends (Fabric: ``fabric.strategy.teardown()``),
and keeps its schedule in the strategy's checkpoint entry (``local_sgd``: whatever
``LocalSGD.state_dict`` returns), so a resumed fit goes on with it. A Trainer loads a checkpoint
before the averager exists, ``fabric.load`` after: either way the state reaches it before the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from lit_dp.local_sgd import LocalSGD
from lit_dp.options import Options
from lit_dp.options.local_sgd import LocalSGDOptions
from lit_dp.strategies.feature import Feature, Run

log = logging.getLogger(__name__)


def _never_joined() -> bool:
    return False


class LocalSGDSchedule(Feature):
    """The averager while fitting with ``local_sgd_steps`` (``local_sgd``), and its schedule in checkpoints."""

    key = "local_sgd"

    def __init__(self, options: LocalSGDOptions) -> None:
        self._options = options
        # The strategy's: this rank replays the step. A module-level function until setup, so that a
        # spawning launcher can pickle the strategy with its features.
        self._joined: Callable[[], bool] = _never_joined
        self.local_sgd: LocalSGD | None = None  # from setup to teardown
        self._resumed: dict[str, Any] | None = None  # from the checkpoint, until setup

    @classmethod
    @override
    def build(cls, options: Options) -> LocalSGDSchedule | None:
        return cls(options.local_sgd) if options.local_sgd.steps is not None else None

    @override
    def setup(self, run: Run) -> None:
        if run.model is None or not run.fitting:
            return
        if self.local_sgd is not None:  # Fabric: a second model set up in the same run
            raise ValueError(
                f"local_sgd_steps={self._options.steps} averages one model, and fabric.setup was given a second one "
                "before fabric.strategy.teardown(): expected one model per run, or lit_dp.LocalSGD(model, ...) "
                "over each model in your loop (docs/local_sgd.md)."
            )
        options = self._options
        if options.adaptive and run.trainer is not None and not run.trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "local_sgd_adaptive=True is not supported with manual optimization: the adaptive period needs the "
                "training loss, which only automatic optimization hands to the strategy. Use a fixed local_sgd_steps."
            )
        self._joined = lambda: run.strategy.joined
        self.local_sgd = LocalSGD(
            run.model,
            options.steps,
            options.warmup_steps,
            adaptive=options.adaptive,
            comm_buffer_size=None,  # the model's when the local phase starts: with "auto", the tuned size
            outer=options.outer,
            outer_lr=options.outer_lr,
            outer_momentum=options.outer_momentum,
            sync_dtype=options.sync_dtype,
            fragments=options.fragments,
        )
        log.debug(
            "LocalSGD on: parameters averaged after optimizer steps (lit_dp.LocalSGD), in %d fragment(s)",
            self.local_sgd.fragments,
        )
        if self._resumed is not None:
            self.load_state_dict(self._resumed)

    @override
    def optimizer_step(self, step: Callable[[Any], Any], optimizer: Any, closure: Any) -> Any:
        output = step(closure)
        if self.local_sgd is not None:
            loss = output if self._options.adaptive else None
            self.local_sgd.step(loss, optimizer.param_groups[0]["lr"], joined=self._joined())
        return output

    @override
    def on_train_end(self) -> None:
        if self.local_sgd is not None:
            self.local_sgd.finish()

    @override
    def teardown(self) -> None:
        self.local_sgd = None
        self._joined = _never_joined

    @override
    def state_dict(self) -> dict[str, Any] | None:
        return self.local_sgd.state_dict() if self.local_sgd is not None else None

    @override
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Applied at once to a running averager (``fabric.load``), else when setup builds it (a Trainer's resume)."""
        if self.local_sgd is None or state is None:
            self._resumed = state
            return
        log.debug("LocalSGD: schedule restored from the checkpoint")
        self.local_sgd.load_state_dict(state)
        self._resumed = None
