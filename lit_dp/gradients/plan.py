"""The step plan: how this rank takes part in one backward's gradient synchronisation.

``DataParallel`` decides once per step, when a backward is prepared, and hands the reducer one
``StepPlan``; the reducer and every bucket read it and nothing else (torch's C++ reducer has the
same shape: ``prepare_for_backward`` decides, the buckets follow). Before, the same answer was
spread over five flags that LocalSGD, Join, uneven inputs and the manual-optimisation path each
set on other objects.

How a rank takes part (``Participation``):

==========  ======================  ==================================  ======================
value       runs a backward here    sends                               its ``.grad`` after
==========  ======================  ==================================  ======================
SYNC        yes                     what it accumulated                 the averages
LOCAL       yes                     nothing (``no_sync``, LocalSGD)     its own, accumulated
REPLAY      no (the Trainer's       what it accumulated since the last  the averages
            uneven inputs)          synchronisation (zeros if none)
SHADOW      no (torch's ``Join``)   zeros                               untouched
==========  ======================  ==================================  ======================

What a bucket's per-parameter flags say (``FlagMeaning``, see ``lit_dp.gradients.flags``): with
``find_unused_parameters`` "used here", otherwise "missing here"; a rank without a backward of
its own (REPLAY, SHADOW) never counts as missing a gradient.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Participation(enum.Enum):
    """How this rank takes part in a step (see the module docstring's table)."""

    SYNC = "sync"
    LOCAL = "local"
    REPLAY = "replay"
    SHADOW = "shadow"


class FlagMeaning(enum.Enum):
    """What a flag of 1 says about a parameter on this rank; summed over the ranks by the all-reduce."""

    USED = "used"  # find_unused_parameters: a sum of 0 means no rank used it (its .grad stays untouched)
    MISSING = "missing"  # otherwise: a non-zero sum means some rank got no gradient (an error on every rank)
    NEITHER = "neither"  # every flag 0: a rank without a backward, counted neither as using nor as missing


@dataclass(frozen=True)
class StepPlan:
    """One step's decision, made by ``DataParallel`` and read by the reducer and its buckets.

    Attributes:
        participation: how this rank takes part.
        flags: what the flags of the step's buckets say (irrelevant for ``LOCAL``).
        divisor: what gradients are divided by: the group's size, or under ``Join`` with
            ``divide_by_initial_world_size=False`` the ranks still in.
    """

    participation: Participation
    flags: FlagMeaning
    divisor: int

    @classmethod
    def decide(
        cls, participation: Participation, find_unused_parameters: bool, divisor: int
    ) -> StepPlan:
        """The plan for ``participation``: the flags follow from it and ``find_unused_parameters``."""
        if find_unused_parameters:
            flags = FlagMeaning.USED
        elif participation in (Participation.SYNC, Participation.LOCAL):
            flags = FlagMeaning.MISSING
        else:
            flags = FlagMeaning.NEITHER
        return cls(participation, flags, divisor)

    @property
    def communicates(self) -> bool:
        """Whether this step issues the reducer's collectives (everything but ``LOCAL``)."""
        return self.participation is not Participation.LOCAL

    @property
    def has_backward(self) -> bool:
        """Whether a backward of this rank's runs (its gradient hooks fire)."""
        return self.participation in (Participation.SYNC, Participation.LOCAL)

    @property
    def sends_accumulated(self) -> bool:
        """Whether the gradients this rank accumulated are sent (else zeros, ``SHADOW``)."""
        return self.participation is not Participation.SHADOW

    @property
    def writes_back(self) -> bool:
        """Whether the averages land in ``.grad`` (``SHADOW`` leaves ``.grad`` alone, as torch's Join does)."""
        return self.participation is not Participation.SHADOW
