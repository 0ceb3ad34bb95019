"""torch DDP's user-visible contract, checked on ``lit_dp.DataParallel`` with real gloo processes.

Modelled on torch's own CPU tests of DDP (``test/distributed/test_c10d_gloo.py``,
``test_c10d_common.py`` and ``torch/testing/_internal/distributed/distributed_test.py``), written
for lit_dp: every case builds ``lit_dp.DataParallel`` with DDP's arguments, as a script written
for DDP would, and checks what such a script relies on. The single-process behaviours (a group
written in Python, bad hooks, copies, refusals) are in ``test_data_parallel.py``.
All cases run in one spawn of 2 ranks; tolerances are ``torch.testing``'s defaults (averaging
only reorders float sums).
"""

from __future__ import annotations

import copy
import io
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.distributed import run_ranks

WORLD = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x: torch.Tensor | int) -> torch.Tensor:
        return self.p + x


def step_down(model: nn.Module) -> None:
    """The tests' optimizer: ``p -= p.grad``, gradients dropped."""
    for param in model.parameters():
        with torch.no_grad():
            param -= param.grad
        param.grad = None


def trains_like_one_process_and_survives_pickling(rank: int) -> None:
    """Tiny buckets, views or not; the model is saved and loaded whole mid-training (torch.save)."""
    import lit_dp

    for as_view in (False, True):
        torch.manual_seed(0)
        single = Net()
        model = lit_dp.DataParallel(copy.deepcopy(single), bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)
        inputs, targets = torch.randn(2 * WORLD, 2), torch.randn(2 * WORLD, 4)
        for iteration in range(4):
            F.mse_loss(single(inputs), targets).backward()
            mine = slice(2 * rank, 2 * rank + 2)
            F.mse_loss(model(inputs[mine]), targets[mine]).backward()
            step_down(single)
            step_down(model)
            for expected, ours in zip(single.parameters(), model.module.parameters()):
                torch.testing.assert_close(ours, expected, msg=lambda m: f"view={as_view} it {iteration}: {m}")
            if iteration == 1:
                saved = io.BytesIO()
                torch.save(model, saved)
                saved.seek(0)
                model = torch.load(saved, weights_only=False)
            order = torch.randperm(2 * WORLD, generator=torch.Generator().manual_seed(1337 + iteration))
            inputs, targets = inputs[order], targets[order]


def ignored_outputs_then_training(rank: int) -> None:
    """Forwards whose output is dropped (no backward) do not disturb the training that follows,
    also with a parameter no forward uses (``find_unused_parameters``)."""
    import lit_dp

    class WithSpare(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.softmax(F.relu(self.fc2(F.relu(self.fc1(x))))[:, :4], dim=1)  # fc3 unused

    for module_type, find_unused in ((Net, False), (WithSpare, True)):
        torch.manual_seed(1)
        model = lit_dp.DataParallel(module_type(), find_unused_parameters=find_unused)
        inputs = torch.rand(4, 2)
        targets = torch.randint(0, 4, (4,), generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            output = model(inputs)
            del output
        for _ in range(3):
            F.cross_entropy(model(inputs), targets).backward()
        assert (model.module.fc3.weight.grad is None) == find_unused


def sparse_gradients_match_one_process(rank: int) -> None:
    import torch.distributed as dist

    import lit_dp

    for as_view, hooked in ((False, False), (True, False), (False, True)):
        torch.manual_seed(1337)
        vanilla = nn.Sequential(nn.EmbeddingBag(10, 10, sparse=True), nn.Softmax(dim=1))
        model = lit_dp.DataParallel(copy.deepcopy(vanilla), gradient_as_bucket_view=as_view)
        if hooked:  # a dense-only hook: sparse gradients keep lit_dp's own reduction

            def allreduce_then_divide(state, bucket):
                return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0] / WORLD)

            model.register_comm_hook(None, allreduce_then_divide)
        inputs = torch.randint(0, 10, (2 * WORLD, 2), generator=torch.Generator().manual_seed(5))
        targets = torch.randint(0, 10, (2 * WORLD,), generator=torch.Generator().manual_seed(6))
        F.cross_entropy(vanilla(inputs), targets).backward()
        mine = slice(2 * rank, 2 * rank + 2)
        F.cross_entropy(model(inputs[mine]), targets[mine]).backward()
        expected, ours = vanilla[0].weight.grad, model.module[0].weight.grad
        assert ours.is_sparse, "a sparse gradient stays sparse"
        torch.testing.assert_close(ours.coalesce().to_dense(), expected.coalesce().to_dense())


def a_hooks_future_value_becomes_the_gradient(rank: int) -> None:
    import lit_dp

    class ForHook(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t0 = Task()

        def forward(self, x: int, rank: int) -> torch.Tensor:
            return self.t0(x + rank)

    def ones_plus_one(state, bucket) -> torch.futures.Future[torch.Tensor]:
        future = torch.futures.Future()
        future.set_result(torch.ones_like(bucket.buffer()))
        return future.then(lambda f: f.value() + 1)

    model = lit_dp.DataParallel(ForHook())
    model.register_comm_hook(None, ones_plus_one)
    model(8, rank).mean().backward()
    for param in model.parameters():
        torch.testing.assert_close(param.grad, 2 * torch.ones(2, 2))  # without the hook: 0.25


def unused_parameters_local_and_global(rank: int) -> None:
    """A parameter used on some rank gets the average everywhere; one no rank used keeps no gradient."""
    import lit_dp

    class Tasks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t0, self.t1, self.unused = Task(), Task(), Task()

        def forward(self, x: int, rank: int) -> torch.Tensor:
            return self.t0(x) if rank == 0 else self.t1(x)

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t0, self.t1 = Task(), Task()

        def forward(self, x: int, rank: int) -> torch.Tensor:
            return self.t1(self.t0(x)) if rank == 0 else self.t1(x)

    for as_view in (False, True):
        model = lit_dp.DataParallel(Tasks(), find_unused_parameters=True, gradient_as_bucket_view=as_view)
        output = model(8, rank)
        assert all(p.grad is None for p in model.parameters())
        output.mean().backward()
        inner = model.module
        assert inner.t0.p.grad is not None and inner.t1.p.grad is not None, f"rank {rank}: locally unused got none"
        assert inner.unused.p.grad is None, f"rank {rank}: a globally unused parameter got a gradient"
    chain = lit_dp.DataParallel(Chain(), find_unused_parameters=True)
    chain(8, rank).mean().backward()
    assert all(p.grad is not None for p in chain.parameters()), "rank 0 uses every parameter, rank 1 not all"

    class Bypass(nn.Module):
        """Rank 1's output depends on no parameter at all: its backward still takes the step."""

        def __init__(self) -> None:
            super().__init__()
            self.t0 = Task()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.t0(x) if rank == 0 else x * 2

    bypass = lit_dp.DataParallel(Bypass(), find_unused_parameters=True)
    bypass(torch.ones(2, 2, requires_grad=True)).sum().backward()
    torch.testing.assert_close(bypass.module.t0.p.grad, torch.full((2, 2), 0.5))  # (1 + 0) / 2 ranks


def no_sync_accumulation_gives_every_rank_the_same_gradients(rank: int) -> None:
    """Each rank uses other layers in each micro-step; after the window, gradients agree everywhere."""
    import torch.distributed as dist

    import lit_dp

    class Alternating(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(4))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            layer = self.layers[2 * rank + self.calls % 2]
            self.calls += 1
            return layer(x)

    model = lit_dp.DataParallel(Alternating(), find_unused_parameters=True)
    for micro in range(2):
        with model.no_sync() if micro == 0 else nullcontext():
            F.mse_loss(model(torch.rand(1)), torch.rand(1)).backward()
    for param in model.parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        every = [torch.empty_like(grad) for _ in range(WORLD)]
        dist.all_gather(every, grad)
        torch.testing.assert_close(every[0], every[1])


def activation_checkpointing_as_on_ddp(rank: int) -> None:
    """Reentrant checkpointing runs a backward inside the backward; a layer checkpointed twice gets
    two gradients per step, which needs static_graph (as on DDP); non-reentrant needs nothing."""
    import pytest
    from torch.utils.checkpoint import checkpoint

    import lit_dp

    class Checkpointed(nn.Module):
        def __init__(self, reentrant: bool, twice: bool) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(20, 20), nn.Linear(20, 20)
            self.reentrant, self.twice = reentrant, twice

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.l2, self.l1(x), use_reentrant=self.reentrant)
            return checkpoint(self.l2, x, use_reentrant=self.reentrant) if self.twice else x

    inputs = torch.rand(8 * WORLD, 20, generator=torch.Generator().manual_seed(1), requires_grad=True)
    targets = torch.randn(8 * WORLD, 20, generator=torch.Generator().manual_seed(2))
    mine = slice(8 * rank, 8 * rank + 8)
    # (reentrant, checkpointed twice, static_graph); the one DDP refuses comes last.
    refused = (True, True, False)
    cases = [(r, t, s) for r in (True, False) for t in (False, True) for s in (False, True) if (r, t, s) != refused]
    for reentrant, twice, static_graph in [*cases, refused]:
        torch.manual_seed(31415)
        single = Checkpointed(reentrant, twice)
        model = lit_dp.DataParallel(copy.deepcopy(single), bucket_cap_mb=1, static_graph=static_graph)
        fails = reentrant and twice and not static_graph
        expected_error = pytest.raises(RuntimeError, match="Expected to mark a variable ready only once")
        with expected_error if fails else nullcontext():
            for _ in range(3):
                single.zero_grad()
                model.zero_grad()
                F.mse_loss(single(inputs), targets).backward()
                F.mse_loss(model(inputs[mine]), targets[mine]).backward()
                for expected, ours in zip(single.parameters(), model.parameters()):
                    torch.testing.assert_close(ours.grad, expected.grad)


def gradient_penalty_through_the_outputs(rank: int) -> None:
    """A penalty on the input gradient (WGAN-GP): ``torch.autograd.grad`` through the model's outputs
    reaches no parameter's ``.grad``; the step's backward that follows synchronises as usual."""
    import lit_dp

    torch.manual_seed(7)
    single = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = lit_dp.DataParallel(copy.deepcopy(single))
    inputs = torch.randn(4 * WORLD, 4, generator=torch.Generator().manual_seed(8))

    def critic_loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        scores = net(x)
        (slope,) = torch.autograd.grad(scores.sum(), x, create_graph=True)
        return scores.mean() + ((slope.norm(dim=1) - 1) ** 2).mean()

    for _ in range(2):
        single.zero_grad()
        model.zero_grad()
        critic_loss(single, inputs).backward()
        critic_loss(model, inputs[4 * rank : 4 * rank + 4]).backward()
        for expected, ours in zip(single.parameters(), model.parameters()):
            torch.testing.assert_close(ours.grad, expected.grad)


def backward_with_create_graph_matches_one_process(rank: int) -> None:
    """``backward(create_graph=True)`` (a second-order method, a gradient penalty taken through
    ``.grad``) on two ranks, many buckets, views or not: the gradients are the averaged ones, as on
    DDP (which warns too: the all-reduce is not differentiated)."""
    import warnings

    import lit_dp

    for as_view in (False, True):
        torch.manual_seed(3)
        single = Net()
        model = lit_dp.DataParallel(copy.deepcopy(single), bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)
        inputs, targets = torch.randn(2 * WORLD, 2), torch.randn(2 * WORLD, 4)
        mine = slice(2 * rank, 2 * rank + 2)
        for iteration in range(3):
            F.mse_loss(single(inputs), targets).backward(create_graph=True)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*create_graph=True")
                F.mse_loss(model(inputs[mine]), targets[mine]).backward(create_graph=True)
            for expected, ours in zip(single.parameters(), model.module.parameters()):
                torch.testing.assert_close(
                    ours.grad.detach(), expected.grad.detach(), msg=lambda m: f"view={as_view} it {iteration}: {m}"
                )
            step_down(single)
            step_down(model)


def contract_cases(rank: int) -> None:
    import lit_dp

    lit_dp.init_parallel_env()
    for case in (
        trains_like_one_process_and_survives_pickling,
        ignored_outputs_then_training,
        sparse_gradients_match_one_process,
        a_hooks_future_value_becomes_the_gradient,
        unused_parameters_local_and_global,
        no_sync_accumulation_gives_every_rank_the_same_gradients,
        gradient_penalty_through_the_outputs,
        activation_checkpointing_as_on_ddp,
        backward_with_create_graph_matches_one_process,
    ):
        case(rank)


def test_ddp_users_scripts_behave_as_on_ddp():
    run_ranks(contract_cases, WORLD, timeout=240)
