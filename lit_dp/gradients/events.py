"""What the reducer tells its observers: a step started, a bucket ready and launched, backward ended, each
bucket waited for, the step ended.

Statistics, traces, bucket-size autotuning and the hang watchdog subscribe with
``Reducer.add_observer``. The reducer calls this interface and knows none of its listeners;
listeners never reach into the reducer, except through its one request method,
``Reducer.request_bucket_limits``, whose change the reducer applies itself at the start of the
next step, before it arms.

Every method runs on the training thread, inside the step: keep them cheap (record a mark,
append to a list) and leave the accounting for later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lit_dp.gradients.plan import StepPlan


@dataclass(frozen=True)
class BucketLaunch:
    """One bucket whose collectives were just started."""

    step: int  # the reducer's synchronised step, counted from 0
    position: int  # the bucket's place in this step's launch order
    indices: Sequence[int]  # the reducer's parameter indices in the bucket
    nbytes: int  # gradient bytes the bucket reduces
    futures: Sequence[torch.futures.Future]  # complete with the bucket's collectives; empty when nothing is sent


class ReducerObserver:
    """Base class of the reducer's listeners: every moment is a no-op unless overridden."""

    def step_started(self, step: int, plan: StepPlan) -> None:
        """The reducer was armed for synchronised step ``step`` with ``plan`` (before the buckets are rebuilt)."""

    def backward_started(self, step: int) -> None:
        """The first gradient of this backward is ready."""

    def bucket_ready(self, step: int, position: int) -> None:
        """The last gradient of bucket ``position`` (its place in launch order) arrived in this backward.

        The bucket launches right after, unless an earlier bucket is still incomplete (buckets launch
        in order); what lies between this moment and its launch is the host's cost of launching it
        (the copy into its buffer, the collective enqueued). A bucket completed only by the end of
        backward (parameters without a gradient) or a step without a backward is never ready.
        """

    def bucket_launched(self, launch: BucketLaunch) -> None:
        """A bucket's collectives were started."""

    def bucket_waited(self, step: int, position: int) -> None:
        """After backward, the wait for bucket ``position`` returned: its collectives are complete."""

    def backward_ended(self, step: int) -> None:
        """The autograd engine ran the reducer's end-of-backward callback: the last gradient is ready."""

    def step_ended(self, step: int) -> None:
        """Every bucket of the step was waited for; the averaged gradients are in place."""
