"""``broadcast_buffers``: BatchNorm's statistics as torch DDP keeps them, on real gloo processes.

Each rank sees different data, so a BatchNorm's running statistics drift apart unless the
buffers are broadcast. lit_dp and torch DDP train copies of one model side by side, with the same
``broadcast_buffers``; after every step their weights and buffers must agree (within float
tolerance: both average the same gradients and broadcast the same buffers), and with the
broadcast on the ranks hold identical buffers. Under torch's ``Join`` (uneven inputs) the
broadcast comes from the highest rank still in, in both. All these cases run in one spawn of 2 ranks;
DDP's ignore list (parameters and buffers left local) runs in its own.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.models import FEATURES, NormNet

STEPS = 3


def data(rank: int, step: int) -> torch.Tensor:
    # Per-rank data of different scale: the ranks' batch statistics differ.
    return torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(100 * rank + step)) * (1 + rank)


def assert_same_state(ours: nn.Module, theirs: nn.Module, label: str) -> None:
    for (name, tensor), expected in zip(
        [*ours.module.named_parameters(), *ours.module.named_buffers()],
        [*theirs.module.parameters(), *theirs.module.buffers()],
    ):
        torch.testing.assert_close(tensor, expected, msg=lambda m: f"{label}: {name} differs from DDP's: {m}")


def gathered_buffers(model: nn.Module) -> list[torch.Tensor]:
    import torch.distributed as dist

    local = torch.cat([buffer.float().reshape(-1) for buffer in model.module.buffers()])
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    return every


def train_against_ddp(rank: int, broadcast_buffers: bool) -> None:
    """Several steps, one with an accumulation window, then an evaluation forward."""
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp

    torch.manual_seed(0)
    base = NormNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates broadcast_buffers for its own name
        ddp = DistributedDataParallel(copy.deepcopy(base), broadcast_buffers=broadcast_buffers)
    ours = lit_dp.DataParallel(base, broadcast_buffers=broadcast_buffers)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (ours, ddp)]
    for step in range(STEPS):
        micro_steps = 2 if step == 1 else 1
        for micro in range(micro_steps):
            for model in (ours, ddp):
                model.require_backward_grad_sync = micro == micro_steps - 1
                model(data(rank, 10 * step + micro)).square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        assert_same_state(ours, ddp, f"broadcast_buffers={broadcast_buffers}, step {step}, rank {rank}")
    with torch.no_grad():
        outputs = [model.eval()(data(rank, 99)) for model in (ours, ddp)]
    torch.testing.assert_close(outputs[0], outputs[1])
    assert_same_state(ours, ddp, f"broadcast_buffers={broadcast_buffers}, after evaluation, rank {rank}")
    buffers = gathered_buffers(ours)
    assert torch.equal(buffers[0], buffers[1]) == broadcast_buffers, (
        f"rank {rank}: the ranks' buffers {'differ' if broadcast_buffers else 'are equal'} with "
        f"broadcast_buffers={broadcast_buffers}"
    )


def join_against_ddp(rank: int) -> None:
    """Rank 1 has one batch fewer: its last step is shadowed, buffers from the rank still in."""
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp

    torch.manual_seed(1)
    base = NormNet()
    ddp = DistributedDataParallel(copy.deepcopy(base))
    ours = lit_dp.DataParallel(base)
    batches = STEPS - rank
    for model in (ours, ddp):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for step in range(batches):
                model(data(rank, step)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert_same_state(ours, ddp, f"after Join, rank {rank}")
    buffers = gathered_buffers(ours)
    assert torch.equal(buffers[0], buffers[1]), f"rank {rank}: buffers differ after Join"


def replay_without_a_batch(rank: int) -> None:
    """The Trainer's uneven inputs, without the Trainer: rank 1 replays the last step."""
    import torch.distributed as dist

    import lit_dp

    torch.manual_seed(2)
    model = lit_dp.DataParallel(NormNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        if rank == 1 and step == STEPS - 1:
            model.replay_step()  # the buffer broadcast and the gradients' collectives, no batch
        else:
            model(data(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    # Buffers travel before a forward, so the next one (evaluating, here) brings rank 0's to rank 1,
    # which takes that forward's communication without running it.
    with torch.no_grad():
        if rank == 0:
            model.eval()(data(rank, STEPS))
        else:
            model.replay_forward()
    buffers = gathered_buffers(model)
    assert torch.equal(buffers[0], buffers[1]), f"rank {rank}: buffers differ after a replayed step"
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(2)]
    dist.all_gather(every, weights)
    assert torch.equal(every[0], every[1]), f"rank {rank}: weights differ after a replayed step"


def buffer_cases(rank: int) -> None:
    import lit_dp

    lit_dp.init_parallel_env()
    for broadcast_buffers in (True, False):
        train_against_ddp(rank, broadcast_buffers)
    join_against_ddp(rank)
    replay_without_a_batch(rank)


def test_buffers_match_ddp_with_broadcast_on_and_off_under_join_and_replay():
    run_ranks(buffer_cases, 2, timeout=240)


IGNORED = ["stem.weight", "norm.running_mean"]


def ignored_against_ddp(rank: int) -> None:
    """DDP's ignore list (``_set_params_and_buffers_to_ignore_for_model``): the ignored parameter and
    buffer start different per rank and stay local through training and Join, as under DDP; the
    rest trains as DDP's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp

    lit_dp.init_parallel_env()
    torch.manual_seed(3)
    base = NormNet()
    with torch.no_grad():
        base.stem.weight.add_(rank)
        base.norm.running_mean.add_(rank)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(base, IGNORED)
    ddp = DistributedDataParallel(copy.deepcopy(base))
    ours = lit_dp.DataParallel(base)
    assert ours.parameters_to_ignore == ddp.parameters_to_ignore == set(IGNORED)
    for model in (ours, ddp):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for step in range(STEPS - rank):  # rank 1 joins early: Join's final broadcast skips them too
                model(data(rank, step)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert_same_state(ours, ddp, f"with DDP's ignore list, rank {rank}")
    inner = ours.module
    for name, tensor in [*inner.named_parameters(), *inner.named_buffers()]:
        every = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(every, tensor.detach().contiguous())
        assert torch.equal(every[0], every[1]) == (name not in IGNORED), (
            f"rank {rank}: {name} is {'equal' if torch.equal(every[0], every[1]) else 'different'} across ranks; "
            f"expected it {'local' if name in IGNORED else 'synchronised'}"
        )


def test_ddps_ignore_list_keeps_parameters_and_buffers_local_as_ddp_does():
    run_ranks(ignored_against_ddp, 2, timeout=180)
