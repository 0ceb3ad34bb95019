"""The step plan: what each way of taking part means, and the flags that follow from it."""

from __future__ import annotations

import pytest
import torch

from lit_dp.gradients.flags import fill_flags
from lit_dp.gradients.plan import FlagMeaning, Participation, StepPlan


@pytest.mark.parametrize(
    ("participation", "find_unused", "flags", "communicates", "has_backward", "sends_accumulated", "writes_back"),
    [
        (Participation.SYNC, False, FlagMeaning.MISSING, True, True, True, True),
        (Participation.SYNC, True, FlagMeaning.USED, True, True, True, True),
        (Participation.LOCAL, False, FlagMeaning.MISSING, False, True, True, True),
        (Participation.REPLAY, False, FlagMeaning.NEITHER, True, False, True, True),
        (Participation.REPLAY, True, FlagMeaning.USED, True, False, True, True),
        (Participation.SHADOW, False, FlagMeaning.NEITHER, True, False, False, False),
        (Participation.SHADOW, True, FlagMeaning.USED, True, False, False, False),
    ],
)
def test_each_participation_decides_the_flags_and_what_is_sent(
    participation, find_unused, flags, communicates, has_backward, sends_accumulated, writes_back
):
    plan = StepPlan.decide(participation, find_unused, divisor=2)
    assert (plan.participation, plan.flags, plan.divisor) == (participation, flags, 2)
    assert (plan.communicates, plan.has_backward, plan.sends_accumulated, plan.writes_back) == (
        communicates, has_backward, sends_accumulated, writes_back
    )


@pytest.mark.parametrize(
    ("meaning", "present", "one", "expected"),
    [
        (FlagMeaning.USED, None, 1.0, [1.0, 1.0, 1.0]),
        (FlagMeaning.USED, [True, False, True], 1.0, [1.0, 0.0, 1.0]),
        (FlagMeaning.MISSING, None, 1.0, [0.0, 0.0, 0.0]),
        (FlagMeaning.MISSING, [True, False, True], 1.0, [0.0, 1.0, 0.0]),
        (FlagMeaning.MISSING, [False, True, True], 4.0, [4.0, 0.0, 0.0]),  # an averaging all-reduce divides by 4
        (FlagMeaning.NEITHER, [False, False, True], 1.0, [0.0, 0.0, 0.0]),
    ],
)
def test_one_flag_protocol_for_every_bucket(meaning, present, one, expected):
    flags = torch.full((3,), 7.0)
    fill_flags(flags, meaning, present, one)
    assert flags.tolist() == expected
