"""Clocks for the reducer's moments: host time on CPU, CUDA events on GPUs, read without blocking.

A mark is taken in the training thread at each moment; ``done(mark)`` says whether it can be
read yet (a CUDA event once the GPU reached it), ``to_host`` places it on the host clock and
``elapsed_ms`` measures between two marks. The host clock is ``time.monotonic``, the one the
waiter (``lit_dp.gradients.waiting``) and the hang watchdog read, so that their timestamps and
the step clock's (``lit_dp.observability.step_clock``) are one.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def clock_for(device: torch.device) -> HostClock | CudaClock:
    """CUDA events for a CUDA device, the host clock otherwise."""
    return CudaClock() if device.type == "cuda" else HostClock()


class HostClock:
    """Marks are ``time.monotonic()`` floats."""

    def mark(self) -> float:
        return time.monotonic()

    def done(self, mark: Any) -> bool:
        return mark is not None

    def to_host(self, mark: float, origin: Any, origin_host: float) -> float:
        return mark

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3


class CudaClock:
    """Marks are CUDA events on the current stream; read only once complete (no host sync)."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, mark: Any) -> bool:
        return mark is not None and mark.query()

    def to_host(self, mark: torch.cuda.Event, origin: torch.cuda.Event, origin_host: float) -> float:
        # Device time, anchored at the host time the step started: spans line up with the host
        # clock at that moment; their lengths are the GPU's.
        return origin_host + origin.elapsed_time(mark) / 1e3

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        # Asked by the autotuner once, when it decides, and by the step clock for a window that
        # ended a window ago: the events completed long since, so this does not wait.
        end.synchronize()
        return start.elapsed_time(end)
