"""LocalSGD's schedule under the Trainer: ``local_sgd_steps`` as a feature (``lit_dp.strategies.feature``).

The averager (``lit_dp.LocalSGD``) is built over the wrapped model when a fit is set up, steps
after each optimizer step (automatic and manual optimization alike; accumulated micro-batches
do not count), finishes when training ends, and keeps its schedule in the strategy's checkpoint
entry (``local_sgd``: whatever ``LocalSGD.state_dict`` returns), so a resumed fit goes on with it.
A Fabric loop drives ``lit_dp.LocalSGD`` itself.
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


class LocalSGDSchedule(Feature):
    """The averager while fitting with ``local_sgd_steps`` (``local_sgd``), and its schedule in checkpoints."""

    key = "local_sgd"
    shared_by_replicas = True  # across torchft's replica groups a recovering one takes a peer's schedule and snapshot

    def __init__(self, options: LocalSGDOptions) -> None:
        self._options = options
        self._joined: Callable[[], bool] = lambda: False  # the strategy's: this rank replays the step
        self.local_sgd: LocalSGD | None = None  # from setup to teardown
        self._resumed: dict[str, Any] | None = None  # from the checkpoint, until setup

    @classmethod
    @override
    def build(cls, options: Options) -> LocalSGDSchedule | None:
        return cls(options.local_sgd) if options.local_sgd.steps is not None else None

    @override
    def setup(self, run: Run) -> None:
        if run.trainer is None or run.model is None or not run.fitting:
            return
        options = self._options
        if options.adaptive and not run.trainer.lightning_module.automatic_optimization:
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
            log.debug("LocalSGD: schedule restored from the checkpoint")
            self.local_sgd.load_state_dict(self._resumed)
            self._resumed = None

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
        self._joined = lambda: False

    @override
    def state_dict(self) -> dict[str, Any] | None:
        return self.local_sgd.state_dict() if self.local_sgd is not None else None

    @override
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Applied when setup builds the averager, or at once during a run (a peer replica group's)."""
        if self.local_sgd is not None and state is not None:
            self.local_sgd.load_state_dict(state)
            return
        self._resumed = state
