"""torch.compile around or inside DataParallel: eager's weights, and communication overlapping backward.

Compiled on CPU with ``backend="aot_eager"`` (AOT autograd's graphs, run eagerly: the graph
splitting and autograd structure of inductor without its compile time); inductor itself is in
``tests/test_cuda.py``.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks

LAYERS = 8
WIDTH = 512  # 1 MB weights: one bucket each with 1 MB buckets (dynamo splits no finer than 1 MB)
STEPS = 3
BATCH = 128  # per rank: enough compute that backward, not bucket launches, dominates the timeline


def launch_fractions_and_weights(rank, variants):
    """Per variant: when the first bucket launched, as a fraction of the time to the last launch.

    The last bucket launches when the last gradient is ready, i.e. when backward's compute ends.
    """
    import lit_dp
    from lit_dp.dense import DenseBucket
    
    lit_dp.init_parallel_env()
    launches: list[float] = []
    start = DenseBucket.start

    def timed_start(bucket, *args):
        launches.append(time.perf_counter())
        return start(bucket, *args)

    DenseBucket.start = timed_start
    report = {}
    for variant in variants:
        torch.manual_seed(0)
        base = nn.Sequential(*[layer for _ in range(LAYERS) for layer in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
        reference = lit_dp.DataParallel(copy.deepcopy(base), comm_buffer_size=1, last_comm_buffer_size=1)
        if variant == "compile(DataParallel(model))":
            model = torch.compile(lit_dp.DataParallel(base, comm_buffer_size=1, last_comm_buffer_size=1), backend="aot_eager")
        elif variant == "DataParallel(compile(model))":
            model = lit_dp.DataParallel(torch.compile(base, backend="aot_eager"), comm_buffer_size=1, last_comm_buffer_size=1)
        else:
            model = lit_dp.DataParallel(base, comm_buffer_size=1, last_comm_buffer_size=1)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
        fractions = []
        for step in range(STEPS):
            inputs = torch.randn(2 * BATCH, WIDTH, generator=torch.Generator().manual_seed(step))[rank * BATCH : (rank + 1) * BATCH]
            for net in (model, reference):
                launches.clear()
                began = time.perf_counter()
                net(inputs).square().mean().backward()
                if net is model:
                    fractions.append((launches[0] - began) / (launches[-1] - began))
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        for (name, ours), theirs in zip(base.named_parameters(), reference.module.parameters()):
            torch.testing.assert_close(ours, theirs, msg=lambda m: f"{variant}: {name}: {m}")
        # Step 0 compiles (and the buckets are rebuilt after it): judge the later steps.
        report[variant] = min(fractions[1:])
    return report


@pytest.mark.slow
def test_compiled_models_train_like_eager_and_overlap():
    variants = ["eager", "DataParallel(compile(model))", "compile(DataParallel(model))"]
    results = run_ranks(launch_fractions_and_weights, 2, variants, timeout=280)
    for rank, fractions in results.items():
        # Eager launches the first bucket after one layer's backward (~1/8 of the way); an
        # unsplit compiled graph launches every bucket once all its gradients exist (0.87, as
        # measured with the graph breaks switched off). Half is far from both.
        for variant, fraction in fractions.items():
            assert fraction < 0.5, f"rank {rank}: {variant}: first bucket launched after {fraction:.0%} of backward"
