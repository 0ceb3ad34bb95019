"""The probes' own logic that a CPU can check: where a host synchronisation is said to come from."""

import traceback
import warnings
from pathlib import Path

import torch

from tests.helpers.probes import LIT_DP, caller_outside_torch


def frame(filename: str, lineno: int) -> traceback.FrameSummary:
    return traceback.FrameSummary(filename, lineno, "f")


def test_a_sync_is_attributed_to_the_innermost_frame_outside_torch():
    torch_file = str(Path(torch.__file__).parent / "_tensor.py")
    ours = str(Path(LIT_DP) / "strategies" / "monitor.py")
    lightning = "/site-packages/lightning/pytorch/callbacks/lr_monitor.py"
    # Lightning calls lit_dp's strategy, which calls torch, which warns: lit_dp's.
    stack = [frame(lightning, 1), frame(ours, 80), frame(torch_file, 10), frame(warnings.__file__, 5)]
    assert caller_outside_torch(stack) == f"{ours}:80"
    # lit_dp's strategy calls Lightning's callback, which calls torch: Lightning's.
    assert caller_outside_torch([frame(ours, 3), frame(lightning, 217), frame(torch_file, 10)]) == f"{lightning}:217"
    assert caller_outside_torch([frame(torch_file, 10)]) == "torch"
