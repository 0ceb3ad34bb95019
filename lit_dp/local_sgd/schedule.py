"""When LocalSGD syncs: the warm-up, each fragment's period, the adaptive rule, and the schedule's state.

Fragment ``f`` of ``F`` syncs after the steps ``W + (f+1) * K/F + n*K``; the last fragment keeps the
unfragmented schedule (``W + K``, ``W + 2K``, ...). Adaptive (``adaptive=True``, Paddle's
``AdaptiveLocalSGDOptimizer``, after Wang & Joshi, 2019): at each sync the next period becomes
``clip(ceil(sqrt(lr_0 * loss / (lr * loss_0) * K)), min_local_steps, max_local_steps)``, from the
loss and learning rate that the ranks agreed on (``LocalSGD`` takes that all-reduce). Nothing here
communicates: every rank keeps the same schedule by stepping it the same way.
"""

from __future__ import annotations

import math
from typing import Any

# Paddle's AdaptiveLocalSGDOptimizer bounds the period to [1, 16].
ADAPTIVE_MIN_LOCAL_STEPS = 1
ADAPTIVE_MAX_LOCAL_STEPS = 16


class Schedule:
    """The optimizer steps counted, each fragment's last sync, and the current period K.

    ``trained[f]``: this rank took a step of its own (not joined) since fragment ``f``'s last sync,
    which decides whether its model counts in that sync (``lit_dp.join``).
    """

    def __init__(self, local_steps: int, warmup_steps: int, fragments: int, adaptive: bool, bounds: tuple[int, int]) -> None:
        self.warmup_steps = warmup_steps
        self.initial_local_steps = local_steps
        self.adaptive = adaptive
        self.bounds = bounds
        self.step = 0
        # Per fragment, the step of its last sync; before the first, K steps before the first due one.
        self.last_syncs = [warmup_steps - local_steps + (f + 1) * local_steps // fragments for f in range(fragments)]
        self.local_steps = local_steps
        self.loss_0: float | None = None
        self.lr_0: float | None = None
        self.trained = [False] * fragments
        self.local_steps_taken = 0  # the traffic's denominator: the whole run's, a resumed one's included (LocalSGD.state_dict)

    @property
    def fragments(self) -> int:
        return len(self.last_syncs)

    @property
    def in_local_phase(self) -> bool:
        """Whether warm-up is over: gradients stay local, models are synced periodically."""
        return self.step >= self.warmup_steps

    @property
    def needs_first_agreement(self) -> bool:
        """Adaptive, and the first step's loss and learning rate (``loss_0``, ``lr_0``) not agreed yet."""
        return self.adaptive and self.loss_0 is None

    def advance(self, joined: bool) -> None:
        """Count one optimizer step; ``joined``: this rank ran out of batches and trained nothing."""
        self.step += 1
        if not joined:
            self.trained = [True] * self.fragments
        self.local_steps_taken += self.step > self.warmup_steps

    def due_fragment(self) -> int | None:
        """The fragment whose period ends with this step, if any (at most one: their offsets differ).
        Overdue counts as due: a run resumed with a smaller K syncs at its first step past it (the
        lowest overdue fragment first, one per step), rather than never again."""
        if self.step <= self.warmup_steps:
            return None
        return next((f for f, last in enumerate(self.last_syncs) if self.step - last >= self.local_steps), None)

    def unsynced(self, every: bool) -> list[int]:
        """The fragments that ``finish`` syncs: each that took a local step since its last sync, or with
        ``every`` (``mixing``, whose syncs leave each rank part of its own) each, once the local phase began."""
        return [f for f, last in enumerate(self.last_syncs) if self.step > self.warmup_steps and (self.step > last or every)]

    def synced(self, fragment: int) -> bool:
        """Fragment ``fragment`` syncs at this step; returns whether this rank's model counts in it."""
        self.last_syncs[fragment] = self.step
        participates, self.trained[fragment] = self.trained[fragment], False
        return participates

    def next_period(self, loss: float, lr: float) -> None:
        """The adaptive rule, from the loss and learning rate the ranks agreed on at this sync."""
        assert self.loss_0 is not None and self.lr_0 is not None
        if self.loss_0 <= 0 or loss < 0 or lr <= 0:
            raise ValueError(
                f"adaptive LocalSGD needs a positive training loss and learning rate: got loss_0={self.loss_0}, "
                f"loss={loss}, lr={lr} (averaged over the ranks)."
            )
        period = math.ceil(math.sqrt(self.lr_0 * loss / (lr * self.loss_0) * self.initial_local_steps))
        low, high = self.bounds
        self.local_steps = min(max(period, low), high)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "last_average": self.last_syncs[-1],
            "fragments": self.fragments,
            "last_syncs": list(self.last_syncs),
            "local_steps": self.local_steps,
            "loss_0": self.loss_0,
            "lr_0": self.lr_0,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A fixed period is this schedule's own K, so a run may resume with another; an adaptive period
        continues from the saved one. A state without fragments (saved before they existed) is one fragment's."""
        saved = int(state.get("fragments", 1))
        if saved != self.fragments:
            raise ValueError(
                f"the LocalSGD state was saved with fragments={saved}, this LocalSGD has fragments={self.fragments}: "
                "each fragment's last sync and snapshot are its own; expected the same fragments as the saved run."
            )
        self.step = int(state["step"])
        self.last_syncs = [int(last) for last in state.get("last_syncs", [state["last_average"]])]
        self.trained = [self.step > last for last in self.last_syncs]  # as every rank that has batches
        self.local_steps = int(state["local_steps"]) if self.adaptive else self.initial_local_steps
        self.loss_0 = state.get("loss_0")
        self.lr_0 = state.get("lr_0")
