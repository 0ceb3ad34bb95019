"""The host's cost of resuming after an idle wait, probed when training ends, for the forecast.

A rank that waits for its collectives leaves its core idle, and the host work after the wait
(the optimizer step, the next batch, the forward's launches) runs slower than the same work done
back to back: the core was given away, its caches went cold, a virtual machine's CPU was
descheduled. On this project's machine (2 cores of a VM) this probe's workload, about 0.7 ms back
to back, took 0.0 to 0.3 ms more after an idle 1 ms, 1.4 to 2.1 ms more after 16 ms and 5.3 to
6.5 ms more after 64 ms (three probes in a row). A forecast
that keeps each step's host work as the run measured it is then wrong wherever the wait changes:
over a slower link (the digits recipe's step over 50 Mbit/s waits 17 ms a step and its host work
after the wait took 6.2 to 7.2 ms against 3.8 without a link) and in LocalSGD's and DiLoCo's local
steps, which wait for nothing.

``probe_resume`` times ``WORK`` (small tensor operations and Python on the host, as a step's host
work is) back to back and after each idle wait of ``IDLE_MS``, a median of ``TRIES`` each, and
returns what each wait added (``Profile.extra["resume_probe"]``); ``lit_dp.forecast`` adds to a
re-timed step what its new wait costs, less what the run's own wait cost. Every rank probes its
own host, with no collective, in about half a second.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

IDLE_MS = (1.0, 4.0, 16.0, 64.0)
TRIES = 5
WORK = 20  # rounds of the workload: about 0.7 ms on this project's machine


def probe_resume(idle_ms: tuple[float, ...] = IDLE_MS, tries: int = TRIES, work: int = WORK) -> dict[str, Any]:
    """``{"idle_ms": idle_ms, "extra_ms": what each wait added to the workload, "work_ms": the workload back to back}``."""
    with torch.no_grad():
        tensors = [torch.full((32, 32), 0.01 * i) for i in range(8)]
        # Fixed weights, not nn.Linear's random ones: the probe must not move the run's random stream.
        weights = [torch.full((32, 32), 0.001 * (i + 1)) for i in range(4)]

        def timed() -> float:
            began = time.perf_counter()
            for _ in range(work):
                x = tensors[0]
                for tensor in tensors[1:]:
                    x = torch.relu(x + tensor)
                for weight in weights:
                    x = torch.nn.functional.linear(x, weight)
                x.sum()
            return (time.perf_counter() - began) * 1e3

        for _ in range(tries):  # warm: the first runs allocate
            timed()
        back_to_back = statistics.median(timed() for _ in range(2 * tries))
        extra = []
        for idle in idle_ms:
            after = []
            for _ in range(tries):
                time.sleep(idle / 1e3)
                after.append(timed())
            extra.append(round(max(0.0, statistics.median(after) - back_to_back), 4))
    return {"idle_ms": list(idle_ms), "extra_ms": extra, "work_ms": round(back_to_back, 4)}
