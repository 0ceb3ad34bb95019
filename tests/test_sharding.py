"""``lit_dp.ShardedOptimizer`` (sharding stages 1 and 2) on 2 and 3 real gloo processes.

Oracles: the same training unsharded through ``lit_dp.DataParallel``, and one process on the
whole batch; final weights and optimizer state must match both within torch.testing's
per-dtype tolerances (sharding only reorders the sums of the averages and of the clipping norm;
a wrong owner, a missed gather or a per-rank norm is off by O(lr)). Each launch runs many cases,
since a spawn costs seconds here.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.equivalence import IN_PLACE_BYTES, TINY_MB
from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

STEPS = 3
OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
}


class Uneven(nn.Module):
    """Parameters of 1200, 800, 200 and 12 bytes: shards cannot be even."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(6, 50)
        self.head = nn.Linear(50, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wide(x)))


def tiny() -> nn.Module:
    """Two parameters: on 3 ranks one rank owns nothing."""
    return nn.Linear(6, 3)


BUILDERS = {**MODELS, "uneven": Uneven, "tiny": tiny}
# (model, optimizer, stage, micro-batches per step, clip norm or None, sharding_overlap)
CASES = [
    ("tied", "adam", 1, 1, None, False),
    ("tied", "adamw_fused", 2, 2, 0.05, False),
    ("tied", "sgd_momentum", 2, 1, None, True),
    ("uneven", "adam", 2, 1, 0.05, True),
    ("uneven", "sgd_momentum", 1, 2, 0.05, False),
    ("mixed", "sgd_momentum", 2, 1, None, False),  # Adam on fp16 parameters overflows, sharded or not
    ("tiny", "adamw_fused", 2, 1, 0.05, False),
]


def state_bytes(states) -> int:
    return sum(value.nbytes for state in states for value in state.values() if isinstance(value, torch.Tensor))


def assert_same_state(ours: dict, theirs: dict, label: str) -> None:
    assert ours["param_groups"] == theirs["param_groups"], f"{label}: param_groups differ"
    assert ours["state"].keys() == theirs["state"].keys(), f"{label}: state for {sorted(ours['state'])}"
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, msg=lambda m: f"{label}: {index}.{key}: {m}")


def train(rank, world_size, models, optimizers, clip, accumulate, first_step, steps):
    """Train (sharded, unsharded, single process) in lockstep; the last is the single process."""
    for step in range(first_step, first_step + steps):
        for micro in range(accumulate):
            seed = step * accumulate + micro
            inputs, targets = batch(seed, world_size)
            for model in models[:-1]:
                with model.no_sync() if micro < accumulate - 1 else nullcontext():
                    loss(model, shard(inputs, rank), shard(targets, rank), rank, seed).backward()
            reference_loss(models[-1], seed, world_size).backward()
        if clip is not None:
            norms = [optimizers[0].clip_grad_norm_(clip)]
            norms += [torch.nn.utils.clip_grad_norm_(model.parameters(), clip) for model in models[1:]]
            assert norms[-1] > clip, "clipping must act for the test to mean something"
            for norm in norms[:-1]:
                torch.testing.assert_close(norm, norms[-1])
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def run_case(rank: int, world_size: int, case: tuple) -> dict:
    import lit_dp

    name, optimizer_name, stage, accumulate, clip, overlap = case
    label = f"{case} rank {rank}"
    torch.manual_seed(0)
    base = BUILDERS[name]()
    plain, reference = copy.deepcopy(base), copy.deepcopy(base)
    options = dict(comm_buffer_size=TINY_MB, last_comm_buffer_size=TINY_MB)
    sharded = lit_dp.DataParallel(base, sharding_stage=stage, sharding_overlap=overlap, **options)
    unsharded = lit_dp.DataParallel(plain, **options)
    make = OPTIMIZERS[optimizer_name]
    users_optimizer = make(sharded.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(users_optimizer, step_size=2, gamma=0.5)  # on the user's object
    optimizer = lit_dp.ShardedOptimizer(users_optimizer, sharded)
    others = [make(model.parameters()) for model in (unsharded, reference)]
    schedulers = [scheduler] + [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in others]
    models, optimizers = [sharded, unsharded, reference], [optimizer, *others]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            train(rank, world_size, models, optimizers, clip, accumulate, step, 1)
            for each in schedulers:
                each.step()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]
    optimizer.wait_for_parameters()
    for (key, ours), theirs, ref in zip(base.named_parameters(), plain.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, ref, msg=lambda m: f"{label}: {key} vs single process: {m}")
        torch.testing.assert_close(theirs, ref, msg=lambda m: f"{label}: {key} unsharded vs single process: {m}")
    scheduled = others[1].param_groups[0]
    assert optimizer.local_optimizer.param_groups[0]["lr"] == scheduled["lr"] < scheduled["initial_lr"], label
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        assert_same_state(optimizer.state_dict(), others[1].state_dict(), f"{label} consolidated")

    # Memory: the local state is exactly the owned parameters' state, at most one parameter's
    # state above an even split of the unsharded state.
    per_param = [state_bytes([others[1].state[p]]) for p in reference.parameters()]
    owned = [b for p, b in zip(base.parameters(), per_param) if sharded.owner_of(p) == rank]
    assert state_bytes(optimizer.state.values()) == sum(owned), label
    assert sum(owned) <= sum(per_param) / world_size + max(per_param), label
    return {"state_bytes": sum(owned), "unsharded": sum(per_param)}


def resume_elsewhere(rank: int, world_size: int, path: str, save: bool) -> None:
    """Save (2 ranks, stage 2) a consolidated state, or resume from it (3 ranks, stage 1) exactly."""
    import lit_dp

    torch.manual_seed(0)
    base = BUILDERS["tied"]()
    reference = copy.deepcopy(base)
    model = lit_dp.DataParallel(base, sharding_stage=2 if save else 1, comm_buffer_size=TINY_MB)
    optimizer = lit_dp.ShardedOptimizer(torch.optim.Adam, model, lr=0.01)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    if save:
        train(rank, world_size, [model, reference], [optimizer, reference_optimizer], None, 1, 0, STEPS)
        optimizer.consolidate_state_dict(to=1)
        if rank == 1:
            saved = {"model": base.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**saved, "reference": reference_optimizer.state_dict()}, path)
            # Loads without sharding, into the optimizer it came from.
            plain = torch.optim.Adam(copy.deepcopy(reference).parameters(), lr=0.01)
            plain.load_state_dict(saved["optimizer"])
            assert_same_state(plain.state_dict(), reference_optimizer.state_dict(), "loaded unsharded")
        return
    checkpoint = torch.load(path, weights_only=True)
    for module in (base, reference):
        module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    reference_optimizer.load_state_dict(checkpoint["reference"])
    for index, param in enumerate(base.parameters()):  # this rank holds exactly its owned part
        assert (param in optimizer.state) == (model.owner_of(param) == rank), index
    train(rank, world_size, [model, reference], [optimizer, reference_optimizer], 0.05, 2, STEPS, 2)
    for ours, theirs in zip(base.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs)


def refusals(rank: int) -> list[str]:
    """Bad combinations that need a process group: each must raise, naming what to change."""
    import lit_dp

    messages = []
    expected = [
        (lambda: lit_dp.DataParallel(MODELS["sparse"](), sharding_stage=2), ValueError),
        (lambda: lit_dp.ShardedOptimizer(torch.optim.SGD, lit_dp.DataParallel(nn.Linear(2, 2)), lr=0.1), ValueError),
        (lambda: lit_dp.DataParallel(nn.Linear(2, 2), sharding_stage=2).register_comm_hook(None, _noop), ValueError),
        (lambda: lit_dp.LocalSGD(lit_dp.DataParallel(nn.Linear(2, 2), sharding_stage=1), local_steps=2), ValueError),
    ]
    for build, error in expected:
        with pytest.raises(error) as raised:
            build()
        messages.append(str(raised.value))
    model = lit_dp.DataParallel(nn.Linear(2, 2), sharding_stage=1)
    users = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    users.step()  # stepped before it is wrapped: the wrapper keeps the owned part of its state
    optimizer = lit_dp.ShardedOptimizer(users, model)
    assert not users.state, "the wrapped optimizer's own copy of the state must be freed"
    assert {id(p) for p in optimizer.state} == {id(p) for p in model.parameters() if model.owner_of(p) == rank}
    for call, error in [
        (users.step, RuntimeError),
        (optimizer.state_dict, RuntimeError),
        (lambda: optimizer.add_param_group({"params": [nn.Parameter(torch.ones(1))]}), NotImplementedError),
        (lambda: optimizer.consolidate_state_dict(to=2), ValueError),
    ]:
        with pytest.raises(error) as raised:
            call()
        messages.append(str(raised.value))
    model.double()  # the parameters leave the storage the gather broadcasts
    with pytest.raises(RuntimeError) as raised:
        optimizer.step()
    messages.append(str(raised.value))
    return messages


def _noop(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def sharding_cases(rank: int, path: str, save: bool) -> dict:
    import torch.distributed as dist

    import lit_dp
    import lit_dp.gradients.dense

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    with mock.patch.dict(lit_dp.gradients.dense.IN_PLACE_MIN_BYTES, {"cpu": IN_PLACE_BYTES}):
        results = {case: run_case(rank, world_size, case) for case in CASES}
        resume_elsewhere(rank, world_size, path, save)
    return {"cases": results, "refusals": refusals(rank) if save else []}


@pytest.mark.slow
def test_sharded_training_equals_unsharded_and_one_process_and_resumes_on_another_world_size(tmp_path):
    path = str(tmp_path / "sharded.pt")
    refusal_messages = []
    for world_size, save in ((2, True), (3, False)):
        results = run_ranks(sharding_cases, world_size, path, save, timeout=150)
        for case in CASES:
            shards = [results[rank]["cases"][case]["state_bytes"] for rank in range(world_size)]
            assert sum(shards) == results[0]["cases"][case]["unsharded"], case  # every state exactly once
        refusal_messages += results[0]["refusals"]
    for message, expected in zip(refusal_messages, REFUSALS, strict=True):
        assert expected in message, message


REFUSALS = [
    "sharding_stage=2 with sparse gradients (parameter 'embedding.weight', an embedding built with sparse=True)",
    "needs the model wrapped as lit_dp.DataParallel(..., sharding_stage=1 or 2); got DataParallel with sharding_stage",
    "register_comm_hook(tests.test_sharding._noop) with sharding_stage=2 is invalid",
    "lit_dp.LocalSGD with a DataParallel built with sharding_stage=1 is invalid",
    "is wrapped by lit_dp.ShardedOptimizer",
    "Call consolidate_state_dict(to=0) on every rank first",
    "owners are fixed when the optimizer is built",
    "to=2 is invalid: expected a rank of the model's group, in [0, 2)",
    "no longer lives in the flat storage the optimizer built for it",
]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sharding_stage": 3}, r"sharding_stage=3 is invalid: expected 1 \(optimizer states\), 2"),
        ({"sharding_stage": 2, "comm_hook": "powersgd"}, "sharding_stage=2 with comm_hook='powersgd' is invalid"),
        ({"sharding_stage": 2, "comm_dtype": "bf16"}, "sharding_stage=2 with comm_dtype='bf16' is invalid"),
        ({"sharding_stage": 1, "local_sgd_steps": 4}, "sharding_stage=1 with local_sgd_steps=4 is invalid"),
        ({"sharding_overlap": True}, "sharding_overlap=True needs sharding_stage"),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_both_options(options, message):
    from lit_dp.options import TRAINER, Options

    with pytest.raises(ValueError, match=message):
        Options.build(options, TRAINER)


def test_stage_zero_means_off():
    from lit_dp.options import MODULE, Options

    assert Options.build({"sharding_stage": 0}, MODULE).sharding.stage is None
