"""The run's link, probed when training ends: timed all-reduces of a few sizes, for the forecast.

A run's buckets tell a link's latency apart from its bandwidth only where their sizes spread.
Most runs have one size (a small model's gradients in one 25 MB bucket, or buckets all at the
cap), so a forecast from them alone takes the whole time as bytes over bandwidth and no latency,
and underestimates small buckets and many ranks (a ring pays its latency ``2(N-1)`` times). With
``comm_stats`` (or ``forecast.ranks``), when training ends under the Trainer every rank of the
reducer's group all-reduces each of ``PROBE_BYTES`` on the model's device, in ``REPEATS`` rounds
of every size after one round that lines the ranks up, each size after an all-reduce of one
number (so that no rank times its wait for a peer still ending the previous all-reduce), and the
profile keeps each size's fastest (``Profile.extra["link_probe"]``), from which
``lit_dp.forecast`` fits the link: the link's own figures, which whatever else runs (a peer's
other threads, the machine's other work) only slows (Gloo on loopback took 1 MB in 0.7 to 7.8 ms
within one probe here). A round takes every size in turn, so that a slow spell of a few
milliseconds slows one try of each size rather than every try of one (timed one size after
another, 64 KB once took 2.2 ms at its fastest and 1 MB 1.1, and the fit gave the link 1.07 ms
per hop where the runs around it gave 0.10 to 0.15). The run's buckets give its pace during
training. A few all-reduces of at most 8 MB: milliseconds on a GPU, tens of them on CPU with Gloo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# From latency-bound to bandwidth-bound on the links lit_dp runs over (Gloo on loopback, NCCL).
PROBE_BYTES = (32 * 2**10, 128 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)
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
    line_up = torch.zeros(1, dtype=torch.float32, device=device)
    times: list[list[float]] = [[] for _ in sizes]

    def all_reduce(tensor: torch.Tensor, what: str) -> None:
        # The group's own method: a group written in Python has it too.
        wait(group.allreduce([tensor]), what)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for round_ in range(repeats + 1):
        for nbytes, taken in zip(sizes, times):
            # A rank that finished the previous all-reduce first would time its wait for the others too.
            all_reduce(line_up, "the link probe's line-up")
            began = time.perf_counter()
            all_reduce(buffer[: nbytes // 4], f"the link probe's all-reduce of {nbytes} bytes")
            if round_:  # the first round lines up ranks that arrived at different times
                taken.append((time.perf_counter() - began) * 1e3)
    return {"bytes": list(sizes), "ms": [round(min(taken), 4) for taken in times]}
