"""How early communication starts in backward, eager or compiled, counted in autograd nodes."""

from __future__ import annotations

import copy

import torch
from torch import nn

LAYERS = 8
WIDTH = 512  # 1 MB weights: one bucket each with 1 MB buckets (dynamo splits no finer than 1 MB)
STEPS = 3
BATCH = 128  # per rank: enough compute that backward, not bucket launches, dominates the timeline


def launch_fractions_and_weights(rank, variants, backend="aot_eager", device="cpu", atol=None):
    """Per variant: the share of backward's autograd nodes that had started when the first bucket launched.

    Counted in nodes, not seconds, so a loaded machine cannot blur it. A compiled graph's
    backward is one node per piece: an unsplit graph is a single node, so nothing launches
    before it has all run (a share of 1).
    """
    import lit_dp
    from lit_dp.gradients.dense import DenseBucket

    lit_dp.init_parallel_env()
    timeline: list[str] = []
    start = DenseBucket.start

    def recorded_start(bucket, *args, **kwargs):
        timeline.append("launch")
        return start(bucket, *args, **kwargs)

    DenseBucket.start = recorded_start
    report = {}
    for variant in variants:
        torch.manual_seed(0)
        base = nn.Sequential(*[layer for _ in range(LAYERS) for layer in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]).to(device)
        reference = lit_dp.DataParallel(copy.deepcopy(base), comm_buffer_size=1, last_comm_buffer_size=1)
        if variant == "compile(DataParallel(model))":
            model = torch.compile(lit_dp.DataParallel(base, comm_buffer_size=1, last_comm_buffer_size=1), backend=backend)
        elif variant == "DataParallel(compile(model))":
            model = lit_dp.DataParallel(torch.compile(base, backend=backend), comm_buffer_size=1, last_comm_buffer_size=1)
        else:
            model = lit_dp.DataParallel(base, comm_buffer_size=1, last_comm_buffer_size=1)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
        shares = []
        for step in range(STEPS):
            inputs = torch.randn(2 * BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
            inputs = inputs[rank * BATCH : (rank + 1) * BATCH].to(device)
            for net in (model, reference):
                loss = net(inputs).square().mean()
                timeline.clear()
                nodes = _backward_nodes(loss)
                for node in nodes:
                    node.register_prehook(lambda grad_outputs: timeline.append("node"))
                loss.backward()
                if net is model:
                    shares.append(timeline[: timeline.index("launch")].count("node") / len(nodes))
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        for (name, ours), theirs in zip(base.named_parameters(), reference.module.parameters()):
            # Compiled kernels may fuse and reorder float operations (inductor): ``atol`` then.
            tolerance = {} if atol is None else {"atol": atol, "rtol": atol}
            torch.testing.assert_close(ours, theirs, msg=lambda m: f"{variant}: {name}: {m}", **tolerance)
        # Step 0 compiles (and the buckets are rebuilt after it): judge the later steps.
        report[variant] = max(shares[1:])
    return report


def _backward_nodes(output: torch.Tensor) -> list:
    """The autograd nodes a backward from ``output`` runs, but for gradient accumulation into leaves."""
    nodes, stack = [], [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in nodes or type(node).__name__ == "AccumulateGrad":
            continue
        nodes.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def graphs_compiled(rank, variants, backend="aot_eager"):
    """Per variant: the graphs the backend compiled for ``DataParallel(torch.compile(model))`` in a few
    steps (AOT autograd's count: a graph split at bucket boundaries counts each piece). ``sync``:
    synchronous data parallelism; ``local_sgd``: LocalSGD from the first step, whose backward
    keeps gradients local."""
    import lit_dp

    lit_dp.init_parallel_env()
    report = {}
    for variant in variants:
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["aot_autograd"]["total"]
        torch.manual_seed(0)
        base = nn.Sequential(*[layer for _ in range(LAYERS) for layer in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
        model = lit_dp.DataParallel(torch.compile(base, backend=backend), comm_buffer_size=1, last_comm_buffer_size=1)
        averaging = lit_dp.LocalSGD(model, local_steps=2) if variant == "local_sgd" else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(STEPS):
            model(torch.randn(8, WIDTH)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if averaging is not None:
                averaging.step()
        report[variant] = torch._dynamo.utils.counters["aot_autograd"]["total"] - before
    return report
