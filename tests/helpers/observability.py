"""The 2-rank run that the statistics, profile, trace and autotune tests share (spawning ranks costs seconds).

Statistics, the communication profile and a trace on 4 KB buckets, then an autotuned wrapper whose rank 1 is slow except
with one bucket size, which the tuner must therefore pick.
"""

from __future__ import annotations

import time
from unittest import mock

import torch
from torch import nn

from lit_dp.observability.autotune import MEASURE_STEPS, WARMUP_STEPS

KB = 1024 / 2**20  # one KB in MB
STATS_STEPS = 4
TRACED = (1, 3)
# Candidates for the autotuner on the test model (34 KB of weights of 16 KB and small biases):
# 40 KB and 1 MB both give one bucket, so 3 distinct partitions are tried; rank 1 is made slow
# except with PREFERRED buckets.
CANDIDATES = (4 * KB, 20 * KB, 40 * KB, 1.0)
DISTINCT = 3
# A budget for 2 passes and a bit (a pass times each distinct partition once: a warm-up step,
# then the timed ones); the tuner spends whole passes only.
PASSES = 2
TUNING_BUDGET = (PASSES * DISTINCT + 1) * (WARMUP_STEPS + MEASURE_STEPS)
MAX_TUNING_STEPS = PASSES * DISTINCT * (WARMUP_STEPS + MEASURE_STEPS)
PREFERRED = 20 * KB


def make_model() -> nn.Module:
    torch.manual_seed(0)
    hidden = [layer for _ in range(2) for layer in (nn.Linear(64, 64), nn.ReLU())]
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), *hidden, nn.Linear(64, 4))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def stats_trace_and_autotune(rank: int, trace_dir: str) -> dict:
    import lit_dp
    import lit_dp.observability.autotune

    lit_dp.init_parallel_env()
    # Statistics and trace: 4 KB buckets, so several buckets per step.
    model = make_model()
    wrapped = lit_dp.DataParallel(
        model, comm_buffer_size=4 * KB, last_comm_buffer_size=4 * KB, comm_stats=True, trace_dir=trace_dir,
        trace_steps=TRACED,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = []
    for step in range(STATS_STEPS):
        train_step(wrapped, optimizer, step)
        stats.append(wrapped.comm_stats())
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buckets = len(wrapped.reducer.bucket_indices)
    profile = wrapped.comm_profile.record()
    bucket_indices = wrapped.reducer.bucket_indices

    # Autotune: rank 1 sleeps 30 ms per step unless the buckets are those of PREFERRED, so the
    # slowest rank's step time (both ranks wait for it in the all-reduce) picks PREFERRED.
    tuned_model = make_model()
    with mock.patch.multiple(lit_dp.observability.autotune, CANDIDATES_MB=CANDIDATES, TUNING_STEPS=TUNING_BUDGET):
        tuned = lit_dp.DataParallel(tuned_model, comm_buffer_size="auto", last_comm_buffer_size=4 * KB)
    preferred = _partition(tuned_model, PREFERRED)
    optimizer = torch.optim.SGD(tuned_model.parameters(), lr=0.01)
    steps = 0
    while tuned.autotuner.chosen_mb is None and steps < 2 + MAX_TUNING_STEPS:
        if rank == 1 and tuned.reducer.bucket_indices != preferred:
            time.sleep(0.03)
        train_step(tuned, optimizer, steps)
        steps += 1
    return {
        "stats": stats,
        "gradient_bytes": gradient_bytes,
        "buckets": buckets,
        "bucket_indices": bucket_indices,
        "profile": profile,
        "chosen": tuned.comm_buffer_size,
        "sweep": tuned.autotuner.sweep,
        "tuning_steps": tuned.autotuner.tuning_steps,
        "steps": steps,
        "tuned_buckets": tuned.reducer.bucket_indices,
        "preferred_buckets": preferred,
    }


def _partition(model: nn.Module, megabytes: float) -> list[list[int]]:
    """The buckets a reducer builds for ``model`` at ``megabytes`` (in backward order, as the reducer lists them)."""
    from lit_dp.gradients.buckets import MB, assign_group_by_size

    params = list(model.parameters())
    groups = assign_group_by_size(params, [False] * len(params), [int(4 * KB * MB), int(megabytes * MB)])
    return list(reversed(groups))
