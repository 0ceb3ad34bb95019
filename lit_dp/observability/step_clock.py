"""The step clock: each synchronised step's few timestamps, taken once, for every health observer.

The hang watchdog, the communication statistics and the straggler report all need to know
where a step is; this observer takes the timestamps, once, and they derive their own figures:

- the reducer's moments (``lit_dp.gradients.events``): the step started (its forward armed the
  reducer), backward started, backward ended (the last bucket is ready), the step ended (every
  bucket was waited for): ``StepMarks``, read by the statistics and the watchdog;
- a training forward started (``DataParallel.forward`` tells it);
- a batch started and ended (the Trainer's ``StragglerMonitor`` tells it; a hand-written loop
  or Fabric has no batch hook, so there the first training forward after a step stands for
  the batch's arrival);
- an optimizer stepped the model's parameters (torch's global optimizer-step hooks, filtered
  to the optimizers that hold this model's parameters, so a hand-written loop needs no call);
- a pause the ranks take together (the Trainer's validation), left out of every figure;
- the time this rank spent waiting in lit_dp's collectives, summed by the waiter
  (``Waiter.time_waits``), which takes those timestamps for the watchdog anyway.

Host time is ``time.monotonic`` (the waiter's clock). On a CUDA device the spans are measured
between CUDA events recorded on the current stream, so they are the device's time, and read a
window later, when they have long completed: nothing synchronises the host.

A window (``close_window``, at the boundaries the straggler report chooses) splits this rank's
time between two boundaries into (``StepTimes``, ms per synchronised step):

- ``data``: from the end of one batch (the end of the optimizer step, in a loop without batch
  hooks) to the start of the next: waiting for the loader, moving the batch;
- ``exposed``: waiting in lit_dp's collectives: for the buckets after backward, the buffer
  broadcast, the strategy's own collectives (``self.log(..., sync_dist=True)``); on CUDA, the
  device's time from the end of backward to the buckets' completion;
- ``optimizer``: inside optimizer steps over this model's parameters, after the buckets were
  reduced (under Lightning the closure, i.e. forward and backward, runs inside ``step``);
- ``compute``: the rest: forward, backward, the step's own code (``training_step``), hooks.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from typing_extensions import override

from lit_dp.gradients.events import ReducerObserver
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.waiting import Waiter
from lit_dp.observability.clocks import CudaClock, HostClock, clock_for


class StepMarks:
    """The reducer's moments of one synchronised step, as clock marks (host floats or CUDA events)."""

    __slots__ = ("step", "participation", "start_host", "start", "backward_start", "backward_end", "reduced")

    def __init__(self, step: int, participation: Participation, start_host: float, start: Any) -> None:
        self.step = step
        self.participation = participation
        self.start_host = start_host  # time.monotonic() when the step started, also on CUDA
        self.start = start
        self.backward_start: Any = None
        self.backward_end: Any = None
        self.reduced: Any = None


@dataclass(frozen=True)
class StepTimes:
    """One rank's time over a window of synchronised steps, in ms per step (see the module docstring)."""

    first_step: int  # the synchronised steps the window covers: from the start of first_step ...
    last_step: int  # ... to the start of last_step + 1
    steps: int  # synchronised steps in the window
    with_batch: int  # of those, the steps this rank took with a batch of its own (not replayed, not shadowed)
    data_ms: float
    compute_ms: float
    exposed_ms: float
    optimizer_ms: float
    step_ms: float  # wall time per step, pauses left out

    def as_row(self) -> list[float]:
        """What the ranks exchange, in ``FIELDS`` order."""
        return [float(getattr(self, field)) for field in FIELDS]

    @classmethod
    def from_row(cls, row: Iterable[float]) -> StepTimes:
        values = dict(zip(FIELDS, row))
        return cls(**{name: int(value) if name in _COUNTS else value for name, value in values.items()})


# A window's figures, in the order the ranks exchange them: the counts first, then milliseconds.
_COUNTS = ("first_step", "last_step", "steps", "with_batch")
FIELDS = (*_COUNTS, "data_ms", "compute_ms", "exposed_ms", "optimizer_ms", "step_ms")


class _Window:
    """The spans of one window, as pairs of marks, summed when the window is read."""

    __slots__ = (
        "first_step",
        "last_step",
        "start",
        "end",
        "steps",
        "with_batch",
        "data",
        "optimizer",
        "exposed",
        "paused",
        "waited",
    )

    def __init__(self, first_step: int, start: Any, waited: float) -> None:
        self.first_step = first_step
        self.last_step = first_step
        self.start = start
        self.end: Any = None
        self.steps = 0
        self.with_batch = 0
        self.data: list[tuple[Any, Any]] = []
        self.optimizer: list[tuple[Any, Any]] = []
        self.exposed: list[tuple[Any, Any]] = []  # CUDA: end of backward to the buckets' completion
        self.paused: list[tuple[Any, Any]] = []
        self.waited = waited  # the waiter's running sum at the start, then its growth (host)


class StepClock(ReducerObserver):
    """Takes each step's timestamps once (see the module docstring); subscribe it before the
    observers that read it. ``params`` are the model's, to tell its optimizers from others."""

    def __init__(self, device: torch.device, waiter: Waiter, params: Iterable[nn.Parameter]) -> None:
        self._clock: HostClock | CudaClock = clock_for(device)
        self._on_host = isinstance(self._clock, HostClock)
        self._mark = time.monotonic if self._on_host else self._clock.mark  # the hot path calls it directly
        self._waiter = waiter
        waiter.time_waits()
        self._param_ids = frozenset(id(param) for param in params)
        self._ours: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._last_asked: tuple[weakref.ref[torch.optim.Optimizer], bool] | None = None  # the answer for the last one
        self.current: StepMarks | None = None  # the step being synchronised, or the last one
        self.starts: deque[tuple[float, int]] = deque(maxlen=16)  # (host time, step) of the latest step starts
        self._batch_hooks = False  # a Trainer tells of batches; else the first forward after a step stands for one
        self._idle_since: Any = None  # the end of the last batch, optimizer step or step: a data wait begins
        self._optimizer_depth = 0  # nested optimizer steps (ShardedOptimizer steps its local one inside)
        self._optimizer_start: tuple[Any, StepMarks | None] | None = None  # its mark, and the step then current
        self._pause_start: Any = None
        self._window: _Window | None = None
        self._closed: _Window | None = None  # CUDA: the window closed last, read at the next close
        hooks = [
            register_optimizer_step_pre_hook(_optimizer_hook(weakref.ref(self), "_optimizer_started")),
            register_optimizer_step_post_hook(_optimizer_hook(weakref.ref(self), "_optimizer_stepped")),
        ]
        weakref.finalize(self, _remove_hooks, hooks)

    # -- what the front doors tell ----------------------------------------------------------

    def forward_started(self) -> None:
        """A training forward of the model started (``DataParallel.forward``)."""
        if not self._batch_hooks:
            self._data_wait_ended()

    def batch_started(self) -> None:
        """The Trainer handed a batch to the training step (its callback's ``on_train_batch_start``)."""
        self._batch_hooks = True
        self._data_wait_ended()

    def batch_ended(self) -> None:
        """The Trainer is done with a batch (its callback's ``on_train_batch_end``): a data wait begins."""
        self._idle_since = self._mark()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, time counts nowhere (the Trainer's validation: every rank takes it, none waits for data)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def pause(self) -> None:
        if self._pause_start is None:
            self._pause_start = self._mark()

    def resume(self) -> None:
        if self._pause_start is not None and self._window is not None:
            self._window.paused.append((self._pause_start, self._mark()))
        self._pause_start = None

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers seen stepping this model's parameters (torch's optimizer-step hooks)."""
        return [optimizer for optimizer, ours in self._ours.items() if ours]

    # -- the reducer's moments ------------------------------------------------------------------

    @override
    def step_started(self, step: int, plan: StepPlan) -> None:
        host = time.monotonic()
        mark = host if self._on_host else self._mark()
        self.current = StepMarks(step, plan.participation, host, mark)
        self.starts.append((host, step))

    @override
    def backward_started(self, step: int) -> None:
        if self.current is not None:
            self.current.backward_start = self._mark()

    @override
    def backward_ended(self, step: int) -> None:
        if self.current is not None:
            self.current.backward_end = self._mark()

    @override
    def step_ended(self, step: int) -> None:
        marks = self.current
        if marks is None:
            return
        marks.reduced = self._idle_since = self._mark()
        window = self._window
        if window is None:
            return
        window.steps += 1  # a window holds the steps that ended in it
        window.with_batch += marks.participation is Participation.SYNC
        if not self._on_host and marks.backward_end is not None:
            window.exposed.append((marks.backward_end, marks.reduced))

    # -- windows ----------------------------------------------------------------------------------

    def close_window(self) -> StepTimes | None:
        """End the window running since the last call and start the next; the figures of the
        window that can be read now: the one just ended on CPU, the one before on CUDA (its
        events completed long since). None at the first call, and on CUDA at the second.

        Called when a step starts (after the clock heard of it), a window holds the steps from
        the one that started at the last call to the one before this."""
        mark = self._mark()
        step = self.current.step if self.current is not None else 0
        ended, self._window = self._window, _Window(step, mark, self._waiter.waited)
        if ended is None:
            return None
        ended.end, ended.last_step = mark, step - 1
        ended.waited = self._waiter.waited - ended.waited
        if not self._on_host:
            ended, self._closed = self._closed, ended
            if ended is None:
                return None
        return self._times(ended)

    def _times(self, window: _Window) -> StepTimes:
        elapsed = self._clock.elapsed_ms

        def total(spans: list[tuple[Any, Any]]) -> float:
            return sum(elapsed(start, end) for start, end in spans)

        paused = total(window.paused)
        wall = elapsed(window.start, window.end) - paused
        data = max(0.0, total(window.data) - paused)  # the Trainer validates between batches
        exposed = window.waited * 1e3 if self._on_host else total(window.exposed)
        optimizer = total(window.optimizer)
        compute = max(0.0, wall - data - exposed - optimizer)
        steps = max(1, window.steps)
        return StepTimes(
            first_step=window.first_step,
            last_step=window.last_step,
            steps=window.steps,
            with_batch=window.with_batch,
            data_ms=data / steps,
            compute_ms=compute / steps,
            exposed_ms=exposed / steps,
            optimizer_ms=optimizer / steps,
            step_ms=wall / steps,
        )

    # -- data waits and optimizer steps -----------------------------------------------------------

    def _data_wait_ended(self) -> None:
        if self._idle_since is None:
            return
        if self._window is not None:
            self._window.data.append((self._idle_since, self._mark()))
        self._idle_since = None

    def _optimizer_started(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._steps_ours(optimizer):
            return
        self._optimizer_depth += 1
        if self._optimizer_depth == 1:
            self._optimizer_start = (self._mark(), self.current)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._steps_ours(optimizer) or self._optimizer_depth == 0:
            return
        self._optimizer_depth -= 1
        if self._optimizer_depth or self._optimizer_start is None:
            return
        end = self._mark()
        start, step_then = self._optimizer_start
        if self.current is not step_then and self.current is not None and self.current.reduced is not None:
            # A step ran inside this optimizer step: Lightning's closure (forward, backward) runs
            # inside step(), so the optimizer's own part starts where the buckets were reduced.
            start = self.current.reduced
        if self._window is not None:
            self._window.optimizer.append((start, end))
        self._optimizer_start = None
        self._idle_since = end

    def _steps_ours(self, optimizer: torch.optim.Optimizer) -> bool:
        last = self._last_asked
        if last is not None and last[0]() is optimizer:
            return last[1]
        ours = self._ours.get(optimizer)
        if ours is None:
            ours = any(id(param) in self._param_ids for group in optimizer.param_groups for param in group["params"])
            self._ours[optimizer] = ours
        self._last_asked = (weakref.ref(optimizer), ours)
        return ours


def _optimizer_hook(clock_ref: weakref.ref[StepClock], method: str):
    def hook(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        clock = clock_ref()
        if clock is not None:
            getattr(clock, method)(optimizer)

    return hook


def _remove_hooks(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
