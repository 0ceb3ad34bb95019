"""LocalSGD's outer optimizer (DiLoCo, ``outer="nesterov"``), bf16 syncs, its traffic and its checkpoints.

The oracle is ``tests.test_local_sgd.simulate`` with ``outer=(lr, momentum)``: one process, one
model per rank, the outer Nesterov step written out (``OuterState``), not lit_dp's code.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lit_dp import Options, PaddleDPStrategy
from lit_dp.options import LocalSGDOptions
from lit_dp.options.local_sgd import AUTOTUNE_STEPS, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM
from lit_dp_recipes.config import build_strategy
from tests.helpers.distributed import run_ranks
from tests.helpers.recipes import compose_config
from tests.test_local_sgd import (
    OPTIMIZERS,
    Net,
    Regressor,
    assert_same_state,
    assert_same_weights,
    fit,
    lightning_steps,
    mse,
    random_steps,
    regression_loss,
    simulate,
)

OUTER = (0.8, 0.5)
OUTER_DEFAULTS = (DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM)


def _train(model, optimizer, local_sgd, steps, rank, first=0, last=None) -> int:
    averages = 0
    for _, micro_batches in steps[first:last]:
        mse(model, micro_batches[rank][0]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        averages += local_sgd.step()
    return averages


def outer_cases(rank: int, tmp_path: str) -> dict:
    """``lit_dp.LocalSGD(outer=...)`` by hand against the simulation; averaging bit for bit; an exact
    mid-period resume; the traffic; the consistency check after averages."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    report: dict = {}
    parameter_bytes = sum(p.numel() * 4 for p in Net().parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in Net().buffers())  # averaged or broadcast, as they are
    for name, outer, k, w, comm_mb, wire in (
        ("sgd", "nesterov", 4, 5, 25, None),
        ("adam", "nesterov", 3, 0, 64 / 2**20, None),  # 64-byte buckets: one per tensor, over the rings
        ("sgd", "nesterov", 3, 2, 25, "bf16"),
        ("sgd", "average", 4, 0, 25, "bf16"),
    ):
        label = f"{name} outer={outer} K={k} W={w} sync_dtype={wire} rank {rank}"
        steps = random_steps(14, world_size, seed=k + w)
        model = lit_dp.DataParallel(Net(), comm_buffer_size=comm_mb, last_comm_buffer_size=comm_mb)
        (optimizer,) = OPTIMIZERS[name](model)
        local_sgd = lit_dp.LocalSGD(
            model, k, w, comm_buffer_size=comm_mb, outer=outer, outer_lr=OUTER[0], outer_momentum=OUTER[1], sync_dtype=wire
        )
        _train(model, optimizer, local_sgd, steps, rank)
        local_sgd.finish()
        expected = simulate(
            Net(), OPTIMIZERS[name], steps, k, w, outer=OUTER if outer == "nesterov" else None,
            wire=torch.bfloat16 if wire else None,
        )
        if wire is None:
            assert_same_state(model.module, expected[rank], label)
        else:
            # A delta within fp32 rounding of the simulation's may round to a neighbouring bf16 value:
            # a bf16 step of the deltas (~0.2 here) is ~1e-3; a missed or extra sync is off by ~0.1.
            for (key, ours), theirs in zip(model.module.state_dict().items(), expected[rank].state_dict().values()):
                torch.testing.assert_close(ours, theirs, atol=3e-3, rtol=1e-2, msg=lambda m: f"{label}: {key}: {m}")
            # The deltas travelled in bf16, padded to a chunk per rank: half the parameters' bytes per average.
            padded = -(-parameter_bytes // 4 // world_size) * world_size
            assert local_sgd.traffic()["bytes_per_sync"] == padded * 2 + buffer_bytes, label

    # Resume from mid-period, each rank from its own checkpoint: the same weights as uninterrupted.
    steps = random_steps(16, world_size, seed=11)

    def build():
        model = lit_dp.DataParallel(Net())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, optimizer, lit_dp.LocalSGD(model, 4, 2, outer="nesterov", outer_lr=0.7, outer_momentum=0.6)

    model, optimizer, local_sgd = build()
    _train(model, optimizer, local_sgd, steps, rank)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    report["uninterrupted_traffic"] = local_sgd.traffic()
    model, optimizer, local_sgd = build()
    _train(model, optimizer, local_sgd, steps, rank, last=12)  # averages after 6 and 10: 12 is mid-period
    path = f"{tmp_path}/rank{rank}.pt"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "local_sgd": local_sgd.state_dict()}, path)
    model, optimizer, local_sgd = build()
    saved = torch.load(path, weights_only=True)
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    local_sgd.load_state_dict(saved["local_sgd"])
    _train(model, optimizer, local_sgd, steps, rank, first=12)
    report["resume_exact"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), uninterrupted))
    report["outer_traffic"] = local_sgd.traffic()
    stats = local_sgd.sync_stats()
    report["last_sync"] = (stats.step, stats.bytes, stats.time_ms >= stats.exposed_ms >= 0)

    # The replica-consistency check runs right after averages (no warm-up: no synchronised step at all).
    model = lit_dp.DataParallel(Net(), consistency_every_n_steps=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local_sgd = lit_dp.LocalSGD(model, 2, outer="nesterov")
    _train(model, optimizer, local_sgd, random_steps(12, world_size, seed=3), rank)
    report["consistency"] = model.consistency.summary()
    return report


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_outer_optimizer_matches_the_simulation_and_resumes_exactly(tmp_path):
    results = run_ranks(outer_cases, 2, str(tmp_path), timeout=240, FLAGS_nccl_nrings="2")
    for rank, report in results.items():
        assert report["resume_exact"], f"rank {rank}: the resumed run's weights differ from the uninterrupted run's"
        assert report["consistency"].startswith("3 checks every 4 synchronised steps (3 after LocalSGD averages)"), report
    traffic, uninterrupted = results[0]["outer_traffic"], results[0]["uninterrupted_traffic"]
    parameter_bytes = sum(p.numel() * 4 for p in Net().parameters())  # float32
    sync_bytes = parameter_bytes + sum(b.numel() * b.element_size() for b in Net().buffers())
    # The whole run's, the resume's state carrying the syncs before it: averages after 6, 10 and 14 of every
    # parameter and buffer, over the 14 local steps after the warm-up, as the uninterrupted run counts them.
    assert traffic["syncs"] == 3 and traffic["bytes_per_sync"] == sync_bytes
    assert traffic["dp_bytes_per_step"] == parameter_bytes
    assert traffic["bytes_per_step"] == 3 * sync_bytes / 14 and traffic["vs_dp"] == traffic["bytes_per_step"] / parameter_bytes
    counts = ("syncs", "bytes_per_sync", "max_bytes_per_sync", "bytes_per_step", "vs_dp")
    assert {key: traffic[key] for key in counts} == {key: uninterrupted[key] for key in counts}
    assert results[0]["last_sync"] == (14, sync_bytes, True)


def fragment_names(model: nn.Module, fragments: int) -> list[list[str]]:
    """The parameter names of each fragment, as ``lit_dp.LocalSGD`` cuts them (``assign_fragments``, tested alone)."""
    from lit_dp.gradients.buckets import assign_fragments

    names, sizes = zip(*((name, p.numel() * p.element_size()) for name, p in model.named_parameters()))
    return [[names[i] for i in indices] for indices in assign_fragments(list(sizes), fragments)]


def fragment_cases(rank: int, tmp_path: str) -> dict:
    """Streaming DiLoCo (``fragments=F``) by hand against the simulation; F=1 bit for bit as the default;
    an exact mid-period resume with per-fragment snapshots and momenta; the traffic per fragment."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    report: dict = {"syncs": []}
    for name, outer, k, w, fragments, comm_mb in (
        ("sgd", "average", 4, 2, 2, 25),
        ("adam", "nesterov", 4, 0, 4, 25),
        ("momentum", "nesterov", 6, 1, 3, 64 / 2**20),  # one bucket per tensor, over the rings
    ):
        label = f"{name} outer={outer} K={k} W={w} F={fragments} rank {rank}"
        steps = random_steps(15, world_size, seed=k + fragments)  # 15: finish() syncs fragments mid-period
        model = lit_dp.DataParallel(Net(), comm_buffer_size=comm_mb, last_comm_buffer_size=comm_mb)
        (optimizer,) = OPTIMIZERS[name](model)
        local_sgd = lit_dp.LocalSGD(
            model, k, w, comm_buffer_size=comm_mb, outer=outer, outer_lr=OUTER[0], outer_momentum=OUTER[1],
            fragments=fragments,
        )  # fmt: skip
        syncs = []
        for number, (_, micro_batches) in enumerate(steps, start=1):
            mse(model, micro_batches[rank][0]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if local_sgd.step():
                syncs.append((number, local_sgd.sync_stats().bytes))
        local_sgd.finish()
        report["syncs"].append(syncs)
        expected = simulate(
            Net(), OPTIMIZERS[name], steps, k, w, outer=OUTER if outer == "nesterov" else None,
            fragments=fragment_names(Net(), fragments),
        )  # fmt: skip
        assert_same_state(model.module, expected[rank], label)

    # fragments=1 is the unfragmented sync, bit for bit.
    steps = random_steps(10, world_size, seed=4)
    weights = []
    for extra in ({}, {"fragments": 1}):
        model = lit_dp.DataParallel(Net())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        local_sgd = lit_dp.LocalSGD(model, 3, 1, outer="nesterov", **extra)
        _train(model, optimizer, local_sgd, steps, rank)
        local_sgd.finish()
        weights.append([p.detach().clone() for p in model.parameters()])
    report["f1_bitwise"] = all(torch.equal(p, q) for p, q in zip(*weights))

    # Resume mid-period (after step 11: fragment 0 last synced after 8, 1 after 10), each rank from its own checkpoint.
    steps = random_steps(16, world_size, seed=12)

    def build():
        model = lit_dp.DataParallel(Net())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        local_sgd = lit_dp.LocalSGD(model, 4, 2, outer="nesterov", outer_lr=0.7, outer_momentum=0.6, fragments=2)
        return model, optimizer, local_sgd

    model, optimizer, local_sgd = build()
    _train(model, optimizer, local_sgd, steps, rank)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    report["uninterrupted_traffic"] = local_sgd.traffic()
    model, optimizer, local_sgd = build()
    _train(model, optimizer, local_sgd, steps, rank, last=11)
    path = f"{tmp_path}/rank{rank}.pt"
    saved = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "local_sgd": local_sgd.state_dict()}
    torch.save(saved, path)
    report["saved"] = {key: value for key, value in local_sgd.state_dict().items() if key != "outer"}
    model, optimizer, local_sgd = build()
    saved = torch.load(path, weights_only=True)
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    local_sgd.load_state_dict(saved["local_sgd"])
    _train(model, optimizer, local_sgd, steps, rank, first=11)
    report["resume_exact"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), uninterrupted))
    report["traffic"] = local_sgd.traffic()

    # The replica-consistency check: never between fragment syncs (the fragments differ by design), once after finish().
    model = lit_dp.DataParallel(Net(), consistency_every_n_steps=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local_sgd = lit_dp.LocalSGD(model, 2, outer="nesterov", fragments=2)
    _train(model, optimizer, local_sgd, random_steps(12, world_size, seed=3), rank)
    report["consistency_before_finish"] = model.consistency.summary()
    local_sgd.finish()
    report["consistency"] = model.consistency.summary()
    return report


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fragments_match_the_simulation_and_resume_exactly(tmp_path):
    results = run_ranks(fragment_cases, 2, str(tmp_path), timeout=240, FLAGS_nccl_nrings="2")
    sizes = [p.numel() * 4 for p in Net().parameters()]  # float32
    buffers = sum(b.numel() * b.element_size() for b in Net().buffers())  # with the last fragment
    for rank, report in results.items():
        assert report["f1_bitwise"], f"rank {rank}: fragments=1 differs from the default"
        assert report["resume_exact"], f"rank {rank}: the resumed run's weights differ from the uninterrupted run's"
        assert report["saved"]["fragments"] == 2 and report["saved"]["last_syncs"] == [8, 10], report["saved"]
        assert report["consistency_before_finish"].startswith("0 checks"), report["consistency_before_finish"]
        assert report["consistency"].startswith("1 check every 4 synchronised steps (1 after LocalSGD averages); the replicas agreed"), report
    # K=4, W=2, F=2 (Net's fragments: stem.weight | the rest): fragment 0 after 4, 8, 12; fragment 1 after 6, 10, 14.
    first, rest = sizes[0], sum(sizes[1:]) + buffers
    assert results[0]["syncs"][0] == [(4, first), (6, rest), (8, first), (10, rest), (12, first), (14, rest)]
    # K=4, W=0, F=4: one fragment every step from step 1.
    assert [step for step, _ in results[0]["syncs"][1]] == list(range(1, 16))
    # The whole run's traffic, the resume's state carrying the syncs before it: fragment 0 after 4, 8, 12 and 16,
    # fragment 1 after 6, 10 and 14, over the 14 local steps after the warm-up; no sync larger than a fragment.
    traffic, uninterrupted = results[0]["traffic"], results[0]["uninterrupted_traffic"]
    assert traffic["syncs"] == 7 and traffic["max_bytes_per_sync"] == max(first, rest)
    assert traffic["bytes_per_step"] == (4 * first + 3 * rest) / 14
    counts = ("syncs", "bytes_per_sync", "max_bytes_per_sync", "bytes_per_step", "vs_dp")
    assert {key: traffic[key] for key in counts} == {key: uninterrupted[key] for key in counts}


def bitwise_average_case(rank: int) -> bool:
    """``outer="average"``: after an average every parameter is exactly ``s - (d_0 + d_1) / 2`` (sub with alpha), as before DiLoCo."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    model = lit_dp.DataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    local_sgd = lit_dp.LocalSGD(model, 3, outer="average")
    snapshot = [p.detach().clone() for p in model.parameters()]
    steps = random_steps(3, 2, seed=5)
    for number, (_, micro_batches) in enumerate(steps, start=1):
        mse(model, micro_batches[rank][0]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if number == 3:
            deltas = [s - p.detach() for s, p in zip(snapshot, model.parameters())]
            for delta in deltas:
                dist.all_reduce(delta)
            expected = [s.sub(d, alpha=0.5) for s, d in zip(snapshot, deltas)]
        assert local_sgd.step() == (number == 3)
    return all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))


@pytest.mark.slow
def test_outer_average_is_the_unchanged_average_bit_for_bit():
    assert run_ranks(bitwise_average_case, 2, timeout=120) == {0: True, 1: True}


def momentum_zero_case(rank: int) -> dict:
    """``outer="nesterov"`` with ``outer_momentum=0`` (which torch's SGD refuses with ``nesterov=True``):
    plain outer SGD, so ``outer_lr=1`` is the averaging of ``outer="average"``, bit for bit, and
    ``outer_lr=0.7`` the simulation's outer step without momentum."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    steps = random_steps(9, dist.get_world_size(), seed=6)
    weights = {}
    for label, outer, lr in (("average", "average", 1.0), ("lr 1", "nesterov", 1.0), ("lr 0.7", "nesterov", 0.7)):
        model = lit_dp.DataParallel(Net())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        local_sgd = lit_dp.LocalSGD(model, 2, 1, outer=outer, outer_lr=lr, outer_momentum=0.0)
        _train(model, optimizer, local_sgd, steps, rank)
        local_sgd.finish()
        weights[label] = model.module
    expected = simulate(Net(), OPTIMIZERS["adam"], steps, 2, 1, outer=(0.7, 0.0))[rank]
    assert_same_state(weights["lr 0.7"], expected, f"outer_momentum=0, outer_lr=0.7, rank {rank}")
    pairs = zip(weights["average"].state_dict().values(), weights["lr 1"].state_dict().values())
    return {"lr 1 is averaging": all(torch.equal(a, b) for a, b in pairs)}


@pytest.mark.slow
def test_nesterov_without_momentum_is_plain_outer_sgd_and_averaging_at_lr_1():
    results = run_ranks(momentum_zero_case, 2, timeout=120)
    assert results == {0: {"lr 1 is averaging": True}, 1: {"lr 1 is averaging": True}}


def bf16_sum_case(rank: int) -> dict:
    """4 ranks, ``sync_dtype="bf16"``: the deltas are rounded to bf16 and summed in fp32, the sum rounded to
    bf16 once, whatever the number of ranks (a bf16 all-reduce rounds after every addition)."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    model = nn.Linear(64, 64)  # 4160 parameters: rounding differences somewhere in every chunk
    lit_dp.sync_params_buffers(model)
    snapshot = [p.detach().clone() for p in model.parameters()]
    local_sgd = lit_dp.LocalSGD(model, 1, sync_dtype="bf16")

    def moved(r: int) -> list[torch.Tensor]:  # rank r's parameters after its local step
        generator = torch.Generator().manual_seed(100 + r)
        return [s - torch.randn(s.shape, generator=generator) * 10.0 ** -(r % 3) for s in snapshot]

    with torch.no_grad():
        for p, mine in zip(model.parameters(), moved(rank)):
            p.copy_(mine)
    assert local_sgd.step()
    deltas = [[(s - p).to(torch.bfloat16) for s, p in zip(snapshot, moved(r))] for r in range(world_size)]
    fp32_sum = [sum(d.float() for d in ds).to(torch.bfloat16).float() for ds in zip(*deltas)]
    bf16_sum = [sum(ds[1:], ds[0]).float() for ds in zip(*deltas)]  # the sum a bf16 all-reduce rounds as it goes
    expected = [s.sub(total, alpha=1 / world_size) for s, total in zip(snapshot, fp32_sum)]
    return {
        "fp32 accumulation": all(torch.equal(p, e) for p, e in zip(model.parameters(), expected)),
        "the data tells them apart": any(not torch.equal(a, b) for a, b in zip(fp32_sum, bf16_sum)),
    }


@pytest.mark.slow
def test_bf16_deltas_are_summed_in_fp32_on_4_ranks():
    results = run_ranks(bf16_sum_case, 4, timeout=120)
    for rank, result in results.items():
        assert result == {"fp32 accumulation": True, "the data tells them apart": True}, f"rank {rank}: {result}"


def held_bytes_case(rank: int) -> dict:
    """What ``lit_dp.LocalSGD`` holds between syncs, per device: one snapshot of the trainable parameters,
    one outer momentum with ``outer="nesterov"``, one fp32 residual with error feedback, no sync payload
    (the pseudo-gradient and its encoded bytes live only while its fragment syncs). Before this issue a bucket also kept its flat payload: 3 times the parameters
    for DiLoCo, 2 for averaging. CPU parameters keep their state on the CPU, offloaded or not."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    steps = random_steps(6, dist.get_world_size(), seed=8)
    report = {}
    for outer, fragments, offload, wire in (
        ("average", 1, True, None), ("nesterov", 1, True, None), ("nesterov", 2, False, None), ("nesterov", 2, True, "int4")
    ):
        model = lit_dp.DataParallel(Net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        local_sgd = lit_dp.LocalSGD(model, 2, outer=outer, fragments=fragments, offload=offload, sync_dtype=wire)
        _train(model, optimizer, local_sgd, steps, rank, last=5)  # mid-period for every fragment
        report[(outer, fragments, offload, wire)] = local_sgd.held_bytes()
    return report


@pytest.mark.slow
def test_between_syncs_localsgd_holds_a_snapshot_and_a_momentum_and_no_payload():
    results = run_ranks(held_bytes_case, 2, timeout=120)
    parameters = sum(p.numel() * p.element_size() for p in Net().parameters())
    expected = {
        ("average", 1, True, None): {"snapshot": {"cpu": parameters}, "momentum": {}, "error_feedback": {}, "sync": {}},
        ("nesterov", 1, True, None): {
            "snapshot": {"cpu": parameters}, "momentum": {"cpu": parameters}, "error_feedback": {}, "sync": {}
        },
        ("nesterov", 2, False, None): {
            "snapshot": {"cpu": parameters}, "momentum": {"cpu": parameters}, "error_feedback": {}, "sync": {}
        },
        ("nesterov", 2, True, "int4"): {  # the residuals are fp32, as the parameters
            "snapshot": {"cpu": parameters}, "momentum": {"cpu": parameters}, "error_feedback": {"cpu": parameters},
            "sync": {},
        },
    }
    assert results == {0: expected, 1: expected}


def test_the_state_of_cuda_parameters_goes_to_the_cpu_when_offloaded():
    from lit_dp.local_sgd.transport import state_device as _state_device

    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert _state_device(cuda, offload=True) == cpu
    assert _state_device(cuda, offload=False) == cuda
    assert _state_device(cpu, offload=True) == cpu  # nothing to save on the host


def delay_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def delayed_reference(steps: list, k: int, fragments: list[list[str]], delay: int, alpha: float) -> list[nn.Module]:
    """One process, streaming DiLoCo with overlapped syncs, written out: fragment f's mean delta is taken
    after the steps ``(f+1) * K/F + n*K``, the outer Nesterov step (``OUTER``) is applied ``delay`` steps
    later on the fragment's snapshot, and each rank's parameters become ``alpha * local + (1 - alpha) *
    snapshot``; at the end a sync still delayed is applied replacing the parameters, then every other
    fragment stepped since its last sync (with ``alpha``: every other fragment) is synced at once, replacing
    them too."""
    models = [delay_net() for _ in steps[0][1]]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    snapshot = {name: p.detach().clone() for name, p in models[0].named_parameters()}
    momentum: dict[str, torch.Tensor] = {}
    count = len(fragments)
    last_syncs = [-k + (f + 1) * k // count for f in range(count)]
    pending = None  # (fragment, step, the mean deltas)

    @torch.no_grad()
    def apply(fragment: int, means: dict[str, torch.Tensor], keep: float) -> None:
        lr, mu = OUTER
        for name in fragments[fragment]:
            mean = means[name]
            buffer = momentum[name] = momentum[name] * mu + mean if name in momentum else mean.clone()
            snapshot[name] -= lr * (mean + mu * buffer)
            for model in models:
                p = dict(model.named_parameters())[name]
                p.lerp_(snapshot[name], 1 - keep) if keep else p.copy_(snapshot[name])

    def deltas(fragment: int) -> dict[str, torch.Tensor]:
        return {
            name: sum(snapshot[name] - dict(m.named_parameters())[name].detach() for m in models) / len(models)
            for name in fragments[fragment]
        }

    for number, (_, micro_batches) in enumerate(steps, start=1):
        for model, optimizer, batches in zip(models, optimizers, micro_batches):
            mse(model, batches[0]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if pending is not None and number - pending[1] >= delay:
            apply(pending[0], pending[2], alpha)
            pending = None
        due = [f for f, last in enumerate(last_syncs) if number - last >= k]
        if due:
            last_syncs[due[0]] = number
            pending = (due[0], number, deltas(due[0]))
            if delay == 0:
                apply(pending[0], pending[2], alpha)
                pending = None
    if pending is not None:
        apply(pending[0], pending[2], 0.0)
    for fragment, last in enumerate(last_syncs):
        if (pending is None or fragment != pending[0]) and (len(steps) > last or alpha):
            apply(fragment, deltas(fragment), 0.0)
    return models


def delay_cases(rank: int, tmp_path: str) -> dict:
    """``sync_delay`` and ``mixing`` by hand against ``delayed_reference``, and a resume from a checkpoint
    taken while a sync is in flight, each rank from its own file: the uninterrupted run's weights, bit for bit."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    fragments = fragment_names(delay_net(), 2)
    steps = random_steps(15, world_size, seed=21)

    def build(delay: int, alpha: float):
        model = lit_dp.DataParallel(delay_net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        local_sgd = lit_dp.LocalSGD(
            model, 4, outer="nesterov", outer_lr=OUTER[0], outer_momentum=OUTER[1], fragments=2, sync_delay=delay,
            mixing=alpha,
        )  # fmt: skip
        return model, optimizer, local_sgd

    # 14 steps: fragment 0's sync started after step 14 is still in flight when finish() comes.
    for delay, alpha, count in ((1, 0.0, 14), (1, 0.5, 14), (1, 0.5, 15), (0, 0.5, 15)):
        model, optimizer, local_sgd = build(delay, alpha)
        _train(model, optimizer, local_sgd, steps, rank, last=count)
        local_sgd.finish()
        expected = delayed_reference(steps[:count], 4, fragments, delay, alpha)[rank]
        assert_same_state(model.module, expected, f"sync_delay={delay} mixing={alpha} {count} steps, rank {rank}")

    # K=4, F=2: fragment 1 starts after step 12 and is applied after 13; saved after 12, in between.
    model, optimizer, local_sgd = build(1, 0.5)
    _train(model, optimizer, local_sgd, steps, rank)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    model, optimizer, local_sgd = build(1, 0.5)
    _train(model, optimizer, local_sgd, steps, rank, last=12)
    path = f"{tmp_path}/rank{rank}.pt"
    saved = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "local_sgd": local_sgd.state_dict()}
    torch.save(saved, path)
    model, optimizer, local_sgd = build(1, 0.5)
    saved = torch.load(path, weights_only=True)
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    local_sgd.load_state_dict(saved["local_sgd"])
    _train(model, optimizer, local_sgd, steps, rank, first=12)
    return {
        "pending": (saved["local_sgd"]["pending"]["fragment"], saved["local_sgd"]["pending"]["step"]),
        "resume_exact": all(torch.equal(p, q) for p, q in zip(model.parameters(), uninterrupted)),
    }


@pytest.mark.slow
def test_delayed_and_mixed_syncs_match_the_reference_and_resume_mid_flight(tmp_path):
    results = run_ranks(delay_cases, 2, str(tmp_path), timeout=180)
    assert results == {rank: {"pending": (1, 12), "resume_exact": True} for rank in (0, 1)}, results


def net_optimizer(net: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(net.parameters(), lr=0.1)]


def check_against_simulation(module: Regressor, expected: list[nn.Module], label: str, rank: int) -> None:
    for (name, ours), theirs in zip(module.net.named_parameters(), expected[rank].parameters()):
        torch.testing.assert_close(ours, theirs, msg=lambda m: f"{label} rank {rank}: {name}: {m}")


def uninterrupted_and_resumed(rank: int, tmp_path: str, options: dict, period: int, **simulation) -> tuple[dict, list]:
    """4 epochs of 4 steps (W=1) uninterrupted, against the simulation, then 2 and a resume to 4 from the
    checkpoint after step 8: the uninterrupted run's weights, bit for bit, on every rank. Returns the
    checkpoint's ``local_sgd`` entry and the resumed schedule."""
    net = Regressor().net
    steps = lightning_steps(4)
    module, uninterrupted = fit(f"{tmp_path}/a", 4, **options)
    expected = simulate(net, net_optimizer, steps, period, 1, loss_fn=regression_loss, **simulation)
    check_against_simulation(module, expected, "uninterrupted", rank)
    checkpoints = ModelCheckpoint(dirpath=f"{tmp_path}/ckpt", save_last=True)
    weights = ModelCheckpoint(dirpath=f"{tmp_path}/weights", save_last=True, save_weights_only=True, every_n_epochs=2)
    fit(f"{tmp_path}/b", 2, callbacks=[checkpoints, weights], **options)
    saved = torch.load(f"{tmp_path}/ckpt/last.ckpt", weights_only=False)["lit_dp"]["local_sgd"]
    assert set(saved["replicas"]["ranks"]) == {1}, "rank 1's model and optimizer state were not checkpointed"
    weights_only = torch.load(f"{tmp_path}/weights/last.ckpt", weights_only=False)
    assert "lit_dp" not in weights_only, "a weights-only checkpoint gathered every rank's state"
    resumed_module, resumed = fit(f"{tmp_path}/c", 4, ckpt_path=f"{tmp_path}/ckpt/last.ckpt", **options)
    assert resumed == uninterrupted[8:], f"rank {rank}: resumed schedule {resumed} != {uninterrupted[8:]}"
    assert_same_weights(resumed_module, module, f"rank {rank}: resumed between two syncs")
    return saved, resumed


def lightning_outer_cases(rank: int, tmp_path: str) -> list:
    """The Trainer strategy with ``local_sgd_outer="nesterov"``: the simulation's weights, and a resume from
    a mid-period checkpoint (every rank's model and optimizer, the outer state) that ends where the
    uninterrupted run ends."""
    # K=4, W=1: syncs after steps 5, 9, 13 and finish() after 16; the checkpoint after step 8 is mid-period.
    options = dict(local_sgd_steps=4, local_sgd_warmup_steps=1, local_sgd_outer="nesterov", local_sgd_outer_lr=OUTER[0],
                   local_sgd_outer_momentum=OUTER[1])  # fmt: skip
    saved, resumed = uninterrupted_and_resumed(rank, tmp_path, options, 4, outer=OUTER)
    assert saved["outer"]["momentum"][0] is not None, "the outer momentum was not checkpointed"
    return resumed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_strategy_runs_the_outer_optimizer_and_resumes_mid_period(tmp_path):
    results = run_ranks(lightning_outer_cases, 2, str(tmp_path), timeout=240)
    assert results[0] == results[1] and results[0][-1] == (16, 13)


def lightning_fragment_cases(rank: int, tmp_path: str) -> tuple[list, list[str]]:
    """The Trainer strategy with ``local_sgd_fragments=2``: the simulation's weights, uninterrupted and
    resumed from a checkpoint taken between two fragment syncs; without warm-up, the end-of-run summary
    counts the consistency check that follows the fit's final sync. Returns the resumed schedule and
    rank 0's ``[lit_dp]`` lines."""
    # K=4, F=2: fragment 0 after steps 3, 7, 11, 15, fragment 1 after 5, 9, 13; the checkpoint after step 8
    # falls between two syncs of each.
    options = dict(local_sgd_steps=4, local_sgd_warmup_steps=1, local_sgd_outer="nesterov", local_sgd_fragments=2)
    fragments = fragment_names(Regressor().net, 2)
    saved, resumed = uninterrupted_and_resumed(rank, tmp_path, options, 4, outer=OUTER_DEFAULTS, fragments=fragments)
    assert saved["last_syncs"] == [7, 5], saved["last_syncs"]
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        fit(f"{tmp_path}/d", 2, local_sgd_steps=4, local_sgd_outer="nesterov", local_sgd_fragments=2,
            consistency_every_n_steps=4)  # fmt: skip
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    return resumed, [line for line in lines if line.startswith("[lit_dp] replica consistency")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_strategy_runs_fragments_and_resumes_between_syncs(tmp_path):
    results = run_ranks(lightning_fragment_cases, 2, str(tmp_path), timeout=240)
    # (steps, the last fragment's last sync) after each batch: 16 steps, fragment 1 last synced after 13.
    assert results[0][0] == results[1][0] and results[0][0][-1] == (16, 13)
    # 8 local steps, no synchronised one: the one check is the one after finish() synced both fragments.
    summary = "[lit_dp] replica consistency: 1 check every 4 synchronised steps (1 after LocalSGD averages); the replicas agreed at each"
    assert results[0][1] == [summary], results[0][1]


def lightning_delay_case(rank: int, tmp_path: str) -> int:
    """The Trainer strategy with ``local_sgd_sync_delay=1`` and ``local_sgd_mixing=0.5``: a checkpoint taken
    while a sync is in flight resumes to the uninterrupted run's weights, bit for bit. Returns the step of
    the sync the checkpoint held in flight."""
    # K=4, F=2, W=0: fragment 0 starts after steps 2, 6, 10, 14, fragment 1 after 4, 8, 12, 16, each applied
    # one step later; the checkpoint at the end of epoch 2 (after step 8) holds fragment 1's in flight.
    options = dict(local_sgd_steps=4, local_sgd_outer="nesterov", local_sgd_fragments=2, local_sgd_sync_delay=1,
                   local_sgd_mixing=0.5)  # fmt: skip
    module, uninterrupted = fit(f"{tmp_path}/a", 4, **options)
    checkpoints = ModelCheckpoint(dirpath=f"{tmp_path}/ckpt", save_last=True)
    fit(f"{tmp_path}/b", 2, callbacks=[checkpoints], **options)
    saved = torch.load(f"{tmp_path}/ckpt/last.ckpt", weights_only=False)["lit_dp"]["local_sgd"]
    resumed_module, resumed = fit(f"{tmp_path}/c", 4, ckpt_path=f"{tmp_path}/ckpt/last.ckpt", **options)
    assert resumed == uninterrupted[8:], f"rank {rank}: resumed schedule {resumed} != {uninterrupted[8:]}"
    assert_same_weights(resumed_module, module, f"rank {rank}: resumed with a sync in flight")
    return saved["pending"]["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_strategy_resumes_a_delayed_sync_in_flight(tmp_path):
    assert run_ranks(lightning_delay_case, 2, str(tmp_path), timeout=240) == {0: 8, 1: 8}


def fabric_outer(fabric: Fabric) -> list[list[float]]:
    """``lit_dp.LocalSGD(outer="nesterov")`` in a Fabric loop, on the model Fabric set up."""
    import lit_dp

    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    local_sgd = lit_dp.LocalSGD(model._forward_module, 3, 2, outer="nesterov", outer_lr=OUTER[0], outer_momentum=OUTER[1])
    for _, micro_batches in random_steps(10, 2, seed=2):
        fabric.backward(mse(model, micro_batches[fabric.global_rank][0]))
        optimizer.step()
        optimizer.zero_grad()
        local_sgd.step()
    local_sgd.finish()
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.mark.slow
def test_fabric_loop_runs_the_outer_optimizer():
    from tests.helpers.distributed import launch_forking

    ours = launch_forking(_fork_fabric)
    optimizer = OPTIMIZERS["adam"]
    expected = simulate(Net(), optimizer, random_steps(10, 2, seed=2), 3, 2, outer=OUTER)[0]
    for got, want in zip(ours, expected.parameters()):
        torch.testing.assert_close(torch.tensor(got), want.detach().flatten())


def _fork_fabric() -> list[list[float]]:
    return Fabric(strategy="paddle_dp_fork", accelerator="cpu", devices=2).launch(fabric_outer)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recipe_runs_diloco_from_hydra_and_prints_its_traffic(tmp_path):
    from tests.helpers.recipes import QUIET, run_recipe

    output = run_recipe(
        "gpt", *QUIET, "experiment=gpt_tiny", "strategy.local_sgd.steps=4", "strategy.local_sgd.outer=nesterov",
        "strategy.local_sgd.sync_dtype=bf16", "strategy.local_sgd.error_feedback=true", "strategy.comm_stats=true",
        "strategy.consistency.every_n_steps=4", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    # 10 steps: averages after 4 and 8 before the callbacks' end of training (the final one follows).
    summary = re.search(
        r"LocalSGD outer=nesterov, sync_dtype=bf16 with error feedback: 2 averages of ([\d.]+) MB.*?([\d.]+) of data "
        r"parallelism's",
        output,
    )
    assert summary is not None, output[-3000:]
    assert float(summary.group(2)) < 1 / 4 * 0.6, "bf16 deltas every 4 steps: about 1/8 of data parallelism's bytes"
    assert "after LocalSGD averages" in output, output[-3000:]


def test_hydra_options_reach_the_strategy(tmp_path):
    overrides = [
        "strategy.local_sgd.steps=16", "strategy.local_sgd.outer=nesterov", "strategy.local_sgd.sync_dtype=bf16",
        "strategy.local_sgd.fragments=4", "strategy.local_sgd.sync_delay=1", "strategy.local_sgd.mixing=0.5",
        "strategy.local_sgd.offload=false",
    ]  # fmt: skip
    options = build_strategy(compose_config("gpt", overrides, tmp_path).strategy).options
    assert options.local_sgd == LocalSGDOptions(
        steps=16, outer="nesterov", outer_lr=DEFAULT_OUTER_LR, outer_momentum=DEFAULT_OUTER_MOMENTUM, sync_dtype="bf16",
        fragments=4, sync_delay=1, mixing=0.5, offload=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(local_sgd_outer="nesterov"), "local_sgd_outer='nesterov' needs local_sgd_steps"),
        (dict(local_sgd_sync_dtype="bf16"), "local_sgd_sync_dtype='bf16' needs local_sgd_steps"),
        (dict(local_sgd_steps=4, local_sgd_outer="adam"), "local_sgd_outer='adam' is invalid: expected one of average, nesterov"),
        (dict(local_sgd_steps=4, local_sgd_outer_lr=0), "local_sgd_outer_lr=0 is invalid: expected a positive number"),
        (dict(local_sgd_steps=4, local_sgd_outer_momentum=1), "local_sgd_outer_momentum=1 is invalid"),
        (
            dict(local_sgd_steps=4, local_sgd_sync_dtype="fp16"),
            "local_sgd_sync_dtype='fp16' is invalid: expected one of bf16, int8, int4, fp8",
        ),
        (dict(local_sgd_steps=4, comm_buffer_size="auto"), "comm_buffer_size='auto' with local_sgd_steps=4 and local_sgd_warmup_steps=0"),
        (dict(local_sgd_steps=4, local_sgd_outer="nesterov", sharding_stage=2), "sharding_stage=2 with local_sgd_steps=4"),
        (dict(local_sgd_steps=4, local_sgd_adaptive=True, fault_tolerance="torchft"), "local_sgd_adaptive=True with"),
        (dict(local_sgd_fragments=4), "local_sgd_fragments=4 needs local_sgd_steps"),
        (dict(local_sgd_steps=6, local_sgd_fragments=4), "local_sgd_fragments=4 with local_sgd_steps=6 is invalid"),
        (dict(local_sgd_steps=2, local_sgd_fragments=4), "expected local_sgd_steps a multiple of local_sgd_fragments"),
        (
            dict(local_sgd_steps=4, local_sgd_fragments=2, local_sgd_adaptive=True),
            "local_sgd_fragments=2 with local_sgd_adaptive=True is invalid",
        ),
        (dict(local_sgd_steps=4, local_sgd_fragments=0), "local_sgd_fragments=0 is invalid: expected an integer >= 1"),
        (dict(local_sgd_sync_delay=1), "local_sgd_sync_delay=1 needs local_sgd_steps"),
        (
            dict(local_sgd_steps=8, local_sgd_fragments=4, local_sgd_sync_delay=2),
            "local_sgd_sync_delay=2 with local_sgd_steps=8 and local_sgd_fragments=4 is invalid",
        ),
        (
            dict(local_sgd_steps=4, local_sgd_adaptive=True, local_sgd_sync_delay=1),
            "local_sgd_sync_delay=1 with local_sgd_adaptive=True is invalid",
        ),
        (dict(local_sgd_steps=4, local_sgd_mixing=1.0), "local_sgd_mixing=1.0 is invalid: expected a number in [0, 1)"),
        (dict(local_sgd_steps=4, local_sgd_offload="yes"), "local_sgd_offload='yes' is invalid"),
    ],
)
def test_strategy_refuses_what_does_not_combine_by_name(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PaddleDPStrategy(**options)


def test_auto_buffer_size_with_a_warm_up_long_enough_to_tune():
    from lit_dp.observability.autotune import settled_step

    assert AUTOTUNE_STEPS == settled_step()
    options = Options.build(dict(local_sgd_steps=4, local_sgd_warmup_steps=AUTOTUNE_STEPS, comm_buffer_size="auto"), "trainer")
    assert options.comm_buffer_size == "auto"


def test_library_rejects_bad_outer_arguments_by_name():
    import lit_dp

    for kwargs, message in (
        (dict(outer="adam"), "outer='adam' is invalid"),
        (dict(outer_lr=-1.0), "outer_lr=-1.0 is invalid"),
        (dict(outer_momentum=1.5), "outer_momentum=1.5 is invalid"),
        (dict(sync_dtype=torch.float16), "sync_dtype=torch.float16 is invalid"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            lit_dp.LocalSGD(nn.Linear(2, 2), 4, **kwargs)


def test_fragments_are_contiguous_runs_of_about_equal_bytes():
    from lit_dp.gradients.buckets import assign_fragments

    assert assign_fragments([4] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert assign_fragments([100, 1, 1, 1, 100], 2) == [[0, 1, 2], [3, 4]]
    assert assign_fragments([1000, 1, 1], 3) == [[0], [1], [2]]  # never empty, whatever the sizes
    assert assign_fragments([5, 6], 1) == [[0, 1]]
    with pytest.raises(ValueError, match=re.escape("fragments=3 is invalid for a model of 2 trainable tensors")):
        assign_fragments([5, 6], 3)


def test_a_state_saved_before_fragments_loads_as_one_fragment():
    import lit_dp

    before = {"step": 9, "last_average": 8, "local_steps": 4, "loss_0": None, "lr_0": None}  # no fragments
    local_sgd = lit_dp.LocalSGD(nn.Linear(2, 2), 4)
    local_sgd.load_state_dict(before)
    assert (local_sgd.step_count, local_sgd.last_average, local_sgd.fragments) == (9, 8, 1)
    assert local_sgd.state_dict()["last_syncs"] == [8]
    with pytest.raises(ValueError, match=re.escape("saved with fragments=1, this LocalSGD has fragments=2")):
        lit_dp.LocalSGD(nn.Linear(2, 2), 4, fragments=2).load_state_dict(before)


def test_library_rejects_bad_fragments_by_name():
    import lit_dp

    for args, kwargs, message in (
        ((4,), dict(fragments=0), "fragments=0 is invalid: expected an integer >= 1"),
        ((6,), dict(fragments=4), "fragments=4 with local_steps=6 is invalid"),
        ((2,), dict(fragments=4), "fragments=4 with local_steps=2 is invalid"),
        ((4,), dict(fragments=2, adaptive=True), "fragments=2 with adaptive=True is invalid"),
        ((4,), dict(fragments=4), "fragments=4 is invalid for a model of 2 trainable tensors"),
        ((4,), dict(sync_delay=4), "sync_delay=4 with local_steps=4 and fragments=1 is invalid"),
        ((4,), dict(sync_delay=-1), "sync_delay=-1 is invalid: expected an integer >= 0"),
        ((4,), dict(sync_delay=1, adaptive=True), "sync_delay=1 with adaptive=True is invalid"),
        ((4,), dict(mixing=-0.5), "mixing=-0.5 is invalid: expected a number in [0, 1)"),
        ((4,), dict(offload=1), "offload=1 is invalid: expected True or False"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            lit_dp.LocalSGD(nn.Linear(2, 2), *args, **kwargs)
