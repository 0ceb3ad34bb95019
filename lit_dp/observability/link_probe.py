"""The run's link, probed when training ends: timed all-reduces of a few sizes, for the forecast.

A run's buckets tell a link's latency apart from its bandwidth only where their sizes spread.
Most runs have one size (a small model's gradients in one 25 MB bucket, or buckets all at the
cap), so a forecast from them alone takes the whole time as bytes over bandwidth and no latency,
and underestimates small buckets and many ranks (a ring pays its latency ``2(N-1)`` times). With
``comm_stats`` (or ``forecast.ranks``), when training ends under the Trainer every rank of the
reducer's group all-reduces ``PROBE_BYTES`` on the model's device, ``REPEATS`` times each after
one that lines the ranks up, and the profile keeps each size's fastest (``Profile.extra["link_probe"]``),
from which ``lit_dp.forecast`` fits the link: the link's own figures, which whatever else runs
(a peer's other threads, the machine's other work) only slows (Gloo on loopback took 1 MB in 0.7
to 7.8 ms within one probe here); the run's buckets give its pace during training. A few
all-reduces of at most 8 MB: milliseconds on a GPU, tens of them on CPU with Gloo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# From latency-bound to bandwidth-bound on the links lit_dp runs over (Gloo on loopback, NCCL).
PROBE_BYTES = (64 * 2**10, 2**20, 8 * 2**20)
REPEATS = 5


def probe_link(
    group: dist.ProcessGroup,
    device: torch.device,
    wait: Callable[[dist.Work, str], None] = lambda work, what: work.wait(),
    sizes: tuple[int, ...] = PROBE_BYTES,
    repeats: int = REPEATS,
) -> dict[str, Any]:
    """Every rank of ``group`` calls it: ``{"bytes": sizes, "ms": the fastest all-reduce of each}``.
    ``wait``: how each all-reduce is waited for (a model's ``waiter.wait``: watched by the hang watchdog)."""
    buffer = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=device)
    fastest = []
    for nbytes in sizes:
        tensor = buffer[: nbytes // 4]
        times = []
        for attempt in range(repeats + 1):
            began = time.perf_counter()
            # The group's own method: a group written in Python has it too.
            wait(group.allreduce([tensor]), f"the link probe's all-reduce of {nbytes} bytes")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if attempt:  # the first waits for the last rank to arrive
                times.append((time.perf_counter() - began) * 1e3)
        fastest.append(round(min(times), 4))
    return {"bytes": list(sizes), "ms": fastest}
