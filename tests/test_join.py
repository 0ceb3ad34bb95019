"""``lit_dp.DataParallel`` under torch's ``Join``: uneven inputs end cleanly, with the right gradients.

Modelled on torch's ``test_ddp_uneven_inputs*``: ranks finish early by a few iterations, with
several buckets, unused parameters on the early and on the late rank, sparse gradients,
``no_sync``, communication hooks, LocalSGD and ``comm_buffer_size="auto"``. The oracle is one
process running the same schedule: at step t, the ranks that still have a batch contribute
their loss, divided by the world size (``divide_by_initial_world_size=True``) or by the number
of those ranks. Tolerances: ``assert_close``'s defaults; the sums are only reordered.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join

import lit_dp
from tests.helpers.distributed import run_ranks
from tests.helpers.models import FEATURES, MODELS, uses_sometimes

TINY_MB = 64 / 2**20  # nearly one bucket per parameter


def inputs(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(97 * rank + step)
    return torch.randn(4, FEATURES, generator=generator), torch.randn(4, 3, generator=generator)


def step_loss(model: nn.Module, name: str, rank: int, step: int) -> torch.Tensor:
    x, y = inputs(rank, step)
    out = model(x, uses_sometimes(rank, step)) if name == "branches" else model(x)
    return ((out - y) ** 2).mean()


def schedule(world_size: int, early_by: int | None = None) -> list[int]:
    """Steps per rank: rank r takes 2(r+1), or (early_by) all but the last take early_by fewer."""
    if early_by is None:
        return [2 * (rank + 1) for rank in range(world_size)]
    return [6] * (world_size - 1) + [6 + early_by]


def reference_parameters(name: str, steps: list[int], divide_by_initial: bool, lr: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = MODELS[name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(max(steps)):
        active = [rank for rank, count in enumerate(steps) if step < count]
        divisor = len(steps) if divide_by_initial else len(active)
        sum(step_loss(model, name, rank, step) for rank in active).div(divisor).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def train_uneven(rank: int, name: str, steps: list[int], divide_by_initial: bool, **options) -> nn.Module:
    torch.manual_seed(0)
    model = lit_dp.DataParallel(
        MODELS[name](), comm_buffer_size=TINY_MB, last_comm_buffer_size=TINY_MB, **options
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model], divide_by_initial_world_size=divide_by_initial):
        for step in range(steps[rank]):
            step_loss(model, name, rank, step).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def equivalence_cases(rank: int, world_size: int) -> list[str]:
    lit_dp.init_parallel_env()
    checked = []
    cases = [
        ("tied", schedule(world_size), True, {}),
        ("tied", schedule(world_size), False, {}),
        ("tied", schedule(world_size, early_by=3), True, {"gradient_as_bucket_view": True}),
        ("branches", schedule(world_size), True, {"find_unused_parameters": True}),
        ("branches", schedule(world_size, early_by=2), False, {"find_unused_parameters": True}),
        ("sparse", schedule(world_size), True, {}),
        ("mixed", schedule(world_size), False, {}),
    ]
    for name, steps, divide_by_initial, options in cases:
        label = f"{name} steps={steps} divide_by_initial={divide_by_initial} {options}"
        model = train_uneven(rank, name, steps, divide_by_initial, **options)
        expected = reference_parameters(name, steps, divide_by_initial, lr=0.1)
        for (param_name, param), ref in zip(model.module.named_parameters(), expected):
            torch.testing.assert_close(param.detach(), ref, msg=lambda m: f"rank {rank} {label}: {param_name}: {m}")
        checked.append(label)
    return checked


@pytest.mark.slow
def test_uneven_inputs_match_one_process_running_the_same_schedule():
    results = run_ranks(equivalence_cases, 3, 3, timeout=120)
    assert all(len(cases) == 7 for cases in results.values())


def identical_everywhere(model: nn.Module) -> bool:
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def feature_cases(rank: int, world_size: int) -> dict[str, object]:
    """Hooks, no_sync, LocalSGD, autotune, early termination: no hang, and the same model everywhere."""
    lit_dp.init_parallel_env()
    outcome: dict[str, object] = {}
    last = world_size - 1

    # no_sync every 3rd step; the early rank runs out inside an accumulation window, 10 steps early.
    torch.manual_seed(0)
    model = lit_dp.DataParallel(MODELS["tied"](), comm_buffer_size=TINY_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with model.join():
        for step in range(20 if rank == last else 10):
            sync = (step + 1) % 3 == 0
            with model.no_sync() if not sync else torch.enable_grad():
                step_loss(model, "tied", rank, step).backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
    outcome["no_sync"] = (identical_everywhere(model), model.join_state.shadowed)

    # A rank with no batch at all: its first shadow step takes part in the bucket-order broadcast.
    steps = [0] * last + [3]
    model = train_uneven(rank, "tied", steps, True)
    for param, ref in zip(model.module.parameters(), reference_parameters("tied", steps, True, lr=0.1)):
        torch.testing.assert_close(param.detach(), ref)
    outcome["no_batch"] = model.join_state.shadowed

    # Communication hooks: fp16 compression and PowerSGD (its error feedback and warm start on),
    # compressing from step 2; the early ranks shadow its collectives.
    for hook_name, state, hook in (
        ("fp16", None, default_hooks.fp16_compress_hook),
        ("powersgd", "state", powerSGD_hook.powerSGD_hook),
    ):
        torch.manual_seed(0)
        model = lit_dp.DataParallel(MODELS["tied"](), comm_buffer_size=TINY_MB)
        if state is not None:
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        with model.join():
            for step in range(8 if rank == last else 3):
                step_loss(model, "tied", rank, step).backward()
                optimizer.step()
                optimizer.zero_grad()
        outcome[hook_name] = identical_everywhere(model)
        if hook_name == "fp16":
            # fp16 rounds each gradient to 11 significant bits; over 8 steps at lr 0.05 the
            # parameters move by far less than 1e-3 from that.
            expected = reference_parameters("tied", [3] * last + [8], True, lr=0.05)
            for param, ref in zip(model.module.parameters(), expected):
                torch.testing.assert_close(param.detach(), ref, atol=1e-3, rtol=1e-2)

    # LocalSGD: averages (and adaptive agreements) fall in the early ranks' shadow.
    torch.manual_seed(0)
    model = lit_dp.DataParallel(MODELS["tied"](), comm_buffer_size=TINY_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = lit_dp.LocalSGD(model, local_steps=2, warmup_steps=2, adaptive=True)
    with model.join():
        for step in range(9 if rank == last else 1 + rank):
            loss = step_loss(model, "tied", rank, step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            averager.step(loss.item(), lr=0.05)
    averager.finish()
    outcome["local_sgd"] = (identical_everywhere(model), averager.step_count, averager.local_steps)

    # comm_buffer_size="auto": the early ranks follow the tuner's rebuilds while shadowing.
    torch.manual_seed(0)
    model = lit_dp.DataParallel(
        nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 3)),
        comm_buffer_size="auto",
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with model.join():
        for step in range(14 if rank == last else 2):
            x = torch.randn(2, 512, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    outcome["auto"] = (identical_everywhere(model), len(model.reducer.bucket_bytes))

    # throw_on_early_termination: every rank raises at the first step a rank misses.
    model = lit_dp.DataParallel(MODELS["tied"]())
    try:
        with model.join(throw_on_early_termination=True):
            for step in range(5 if rank == last else 2):
                step_loss(model, "tied", rank, step).backward()
    except RuntimeError as error:
        outcome["throw"] = str(error)
    return outcome


def test_hooks_no_sync_local_sgd_autotune_and_early_termination():
    world_size = 2  # the schedule equivalence runs on 3
    results = run_ranks(feature_cases, world_size, world_size, timeout=150)
    early = list(range(world_size - 1))
    for rank, outcome in results.items():
        assert outcome["no_sync"][0], f"rank {rank}: no_sync models differ"
        assert outcome["fp16"] and outcome["powersgd"], f"rank {rank}: hooked models differ"
        identical, step_count, _ = outcome["local_sgd"]
        assert identical, f"rank {rank}: LocalSGD models differ"
        assert step_count == 9, f"rank {rank}: LocalSGD schedule not adopted from the last joiner ({step_count})"
        assert outcome["auto"][0], f"rank {rank}: autotuned models differ"
        message = outcome["throw"]
        if rank in early:
            assert f"rank {rank} ran out of inputs after 2 synchronised step(s)" in message, message
        else:
            assert f"rank(s) {early} ran out of inputs" in message and "synchronised step 2" in message, message
    assert results[0]["no_sync"][1] == 3, "the early rank shadows the 3 synchronised steps it missed"
    assert results[0]["no_batch"] == 3, "a rank without a batch shadows every step"


def fragment_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 3))


def streaming_case(rank: int, steps: list[int], outer: str, delay: int) -> tuple[bool, int, list[float]]:
    """Streaming DiLoCo (K=4, F=2, ``sync_delay=delay``) under Join: the rank that ran out shadows each
    fragment's sync, counting in it only with work done since the fragment's last sync (and applies a
    delayed one whenever it next syncs); after the
    context and ``finish()`` every rank holds the last joiner's model."""
    lit_dp.init_parallel_env()
    model = lit_dp.DataParallel(fragment_net(), comm_buffer_size=TINY_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = lit_dp.LocalSGD(
        model, local_steps=4, fragments=2, outer=outer, outer_lr=0.8, outer_momentum=0.5, sync_delay=delay
    )
    with model.join():
        for step in range(steps[rank]):
            step_loss(model, "plain", rank, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            averager.step()
    averager.finish()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return identical_everywhere(model), averager.step_count, flat.tolist()


def streaming_reference(steps: list[int], outer: str, delay: int) -> torch.Tensor:
    """One process: every rank steps while it has a batch; fragment 0 is synced after steps 2 + 4n and
    fragment 1 after 4 + 4n over the ranks that took a step since the fragment's last sync, divided by their number
    (averaged, or the outer Nesterov step on the fragment's own snapshot and momentum), and every rank
    takes the result; the ranks then take the last joiner's model, and ``finish()`` syncs each fragment
    stepped since its last sync. ``delay``: a sync's mean delta is taken at its step and applied that many
    steps later."""
    from lit_dp.gradients.buckets import assign_fragments  # the cut itself is tested on its own

    models = [fragment_net() for _ in steps]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    fragments = assign_fragments([p.numel() * p.element_size() for p in models[0].parameters()], 2)
    snapshots = [p.detach().clone() for p in models[0].parameters()]
    momenta: dict[int, torch.Tensor] = {}
    last_syncs = [0, 0]

    pending: list[tuple[int, int, dict[int, torch.Tensor]]] = []  # (fragment, step, mean delta per parameter)

    @torch.no_grad()
    def sync(fragment: int, number: int, now: bool = False) -> None:
        previous, last_syncs[fragment] = last_syncs[fragment], number
        means = {}
        for index in fragments[fragment]:
            # The ranks that took a step since the fragment's last sync.
            taking_part = [list(m.parameters())[index] for rank, m in enumerate(models) if steps[rank] > previous]
            means[index] = torch.stack([snapshots[index] - p for p in taking_part]).mean(dim=0)
        pending.append((fragment, number, means))
        if delay == 0 or now:
            apply()

    @torch.no_grad()
    def apply() -> None:
        _, _, means = pending.pop()
        for index, mean in means.items():
            params = [list(m.parameters())[index] for m in models]
            if outer == "average":
                snapshots[index] -= mean
            else:
                momenta[index] = momenta[index] * 0.5 + mean if index in momenta else mean.clone()
                snapshots[index] -= 0.8 * (mean + 0.5 * momenta[index])
            for p in params:
                p.copy_(snapshots[index])

    end = max(steps)
    for number in range(1, end + 1):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            if number <= steps[rank]:
                step_loss(model, "plain", rank, number - 1).backward()
                optimizer.step()
                optimizer.zero_grad()
        if pending and number - pending[0][1] >= delay:
            apply()
        if number % 2 == 0:
            sync(0 if number % 4 == 2 else 1, number)
    with torch.no_grad():  # Join's final broadcast of the last joiner's model
        for model in models[:-1]:
            for mine, last in zip(model.parameters(), models[-1].parameters()):
                mine.copy_(last)
    for fragment in (0, 1):
        if end > last_syncs[fragment]:
            sync(fragment, end, now=True)
    return torch.cat([p.detach().reshape(-1) for p in models[-1].parameters()])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("outer", "delay"), [("average", 0), ("nesterov", 0), ("nesterov", 1)])
def test_streaming_fragments_are_shadowed_by_the_rank_that_ran_out(outer, delay):
    # Rank 0 joins after 5 steps and shadows the fragment syncs after 6 and 8, bringing its steps 3 to 5
    # and 5 (since the syncs after 2 and 4), and after 10, counting nothing.
    steps = [5, 11]
    results = run_ranks(streaming_case, 2, steps, outer, delay, timeout=150)
    expected = streaming_reference(steps, outer, delay)
    for rank, (identical, step_count, flat) in results.items():
        assert identical, f"rank {rank}: models differ after the Join"
        assert step_count == 11, f"rank {rank}: the last joiner's schedule was not adopted ({step_count})"
        torch.testing.assert_close(torch.tensor(flat), expected, msg=lambda m: f"rank {rank}: {m}")
