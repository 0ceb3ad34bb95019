"""The step clock splits a window of steps into data wait, compute, exposed wait and optimizer step.

One process, the reducer's moments told by hand in the order a reducer tells them, real sleeps
for each part: the lower bounds are the sleeps (a loaded machine only makes them longer); what
must not be counted somewhere is made several times longer than the part it would land in, so
that the upper bounds leave a loaded machine room; and the parts must add up to the window.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.waiting import Waiter
from lit_dp.observability.step_clock import StepClock

DATA, COMPUTE, EXPOSED, OPTIMIZER = 0.04, 0.03, 0.04, 0.01
VALIDATION = 0.2
OTHER_MODELS_OPTIMIZER = 0.2
SYNC = StepPlan.decide(Participation.SYNC, False, 2)


class SleepySGD(torch.optim.SGD):
    """An optimizer whose step takes ``seconds``, after running its closure if given."""

    def __init__(self, params, seconds: float = OPTIMIZER) -> None:
        super().__init__(params, lr=0.1)
        self.seconds = seconds

    def step(self, closure=None):
        if closure is not None:
            closure()
        time.sleep(self.seconds)
        return super().step()


def exposed_wait(waiter: Waiter) -> None:
    """A wait of the reducer's: a future another thread completes ``EXPOSED`` seconds later."""
    future: torch.futures.Future = torch.futures.Future()
    threading.Timer(EXPOSED, future.set_result, args=(None,)).start()
    waiter.wait_future(future)


def synchronised_step(clock: StepClock, waiter: Waiter, step: int) -> None:
    """Forward (the reducer is armed at its end), backward, the buckets' wait: COMPUTE then EXPOSED."""
    time.sleep(COMPUTE / 2)
    clock.step_started(step, SYNC)
    clock.backward_started(step)
    time.sleep(COMPUTE / 2)
    clock.backward_ended(step)
    exposed_wait(waiter)
    clock.step_ended(step)


def assert_adds_up(times) -> None:
    parts = times.data_ms + times.compute_ms + times.exposed_ms + times.optimizer_ms
    assert parts == pytest.approx(times.step_ms, rel=1e-6), times


def test_a_hand_written_loop_splits_its_steps_at_the_forward_and_the_optimizer_step():
    model, waiter = nn.Linear(2, 2), Waiter()
    clock = StepClock(torch.device("cpu"), waiter, model.parameters())
    optimizer = SleepySGD(model.parameters())
    other = SleepySGD(nn.Linear(2, 2).parameters(), OTHER_MODELS_OPTIMIZER)  # another model's: not counted
    assert clock.close_window() is None  # the first call opens the first window
    for step in range(3):
        time.sleep(DATA)  # the loader
        clock.forward_started()
        synchronised_step(clock, waiter, step)
        optimizer.step()
        other.step()  # between steps: counted as the loop's own time (data), not as this model's optimizer
    clock.forward_started()
    clock.step_started(3, SYNC)  # the straggler report closes a window when a step starts
    times = clock.close_window()
    assert (times.steps, times.with_batch, times.first_step, times.last_step) == (3, 3, 0, 2)
    # The loop's own time between steps (the other model's optimizer step) counts as data: a
    # hand-written loop has no batch hook. The first step's wait came before the window.
    assert times.data_ms >= (DATA + OTHER_MODELS_OPTIMIZER) * 1e3 * 2 / 3
    assert times.compute_ms >= COMPUTE * 1e3
    # The timer starts before the wait does, and a loaded machine may start the wait late: half of it at least.
    assert times.exposed_ms >= EXPOSED * 1e3 / 2
    assert OPTIMIZER * 1e3 <= times.optimizer_ms < OTHER_MODELS_OPTIMIZER * 1e3 / 2, times
    assert_adds_up(times)
    assert clock.optimizers() == [optimizer]


def test_under_the_trainer_batches_mark_the_data_wait_and_the_closure_is_not_the_optimizers():
    model, waiter = nn.Linear(2, 2), Waiter()
    clock = StepClock(torch.device("cpu"), waiter, model.parameters())
    optimizer = SleepySGD(model.parameters())
    clock.close_window()
    for step in range(3):
        time.sleep(DATA)
        clock.batch_started()
        # Lightning's automatic optimization: the forward and backward run in the closure, inside step().
        optimizer.step(closure=lambda step=step: (clock.forward_started(), synchronised_step(clock, waiter, step)))
        clock.batch_ended()
        with clock.paused():  # validation: every rank takes it, none waits for data
            time.sleep(VALIDATION)
    time.sleep(DATA)
    clock.batch_started()
    clock.forward_started()
    clock.step_started(3, SYNC)
    times = clock.close_window()
    assert times.steps == 3
    assert DATA * 1e3 <= times.data_ms < VALIDATION * 1e3 * 3 / 4, times  # the pauses are left out
    assert times.compute_ms >= COMPUTE * 1e3
    # Not the closure's forward and backward, which ran inside step(): more than twice as long.
    assert OPTIMIZER * 1e3 <= times.optimizer_ms < (COMPUTE + EXPOSED) * 1e3, times
    step = (DATA + COMPUTE + EXPOSED + OPTIMIZER) * 1e3
    assert times.step_ms < step + VALIDATION * 1e3 * 3 / 4, times  # the pauses are out of the wall time too
    assert_adds_up(times)


def test_a_step_without_a_batch_of_its_own_is_counted_apart():
    waiter = Waiter()
    clock = StepClock(torch.device("cpu"), waiter, nn.Linear(2, 2).parameters())
    clock.close_window()
    clock.step_started(0, SYNC)
    clock.step_ended(0)
    clock.step_started(1, StepPlan.decide(Participation.SHADOW, False, 2))  # torch's Join: this rank ran out
    clock.step_ended(1)
    clock.step_started(2, SYNC)
    times = clock.close_window()
    assert (times.steps, times.with_batch) == (2, 1)


def test_the_step_marks_are_the_ones_the_watchdog_and_statistics_read():
    clock = StepClock(torch.device("cpu"), Waiter(), nn.Linear(2, 2).parameters())
    before = time.monotonic()
    clock.step_started(5, SYNC)
    clock.backward_started(5)
    clock.backward_ended(5)
    clock.step_ended(5)
    marks = clock.current
    assert marks.step == 5 and before <= marks.start_host == marks.start <= marks.backward_start
    assert marks.backward_start <= marks.backward_end <= marks.reduced <= time.monotonic()
    assert list(clock.starts) == [(marks.start_host, 5)]
