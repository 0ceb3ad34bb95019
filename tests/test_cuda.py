"""CUDA paths, run with ``pytest -m cuda`` on a machine with a GPU (skipped elsewhere).

One GPU cannot run NCCL with two ranks, so (see docs/benchmarks.md for when and where these
last ran):
- multi-rank CUDA code paths run as 2 Gloo ranks sharing ``cuda:0`` (Gloo stages CUDA tensors
  through the host: streams, events and the reducer's CUDA paths run, not NCCL's overlap);
- NCCL drives the reducer in a process group of one rank.
"""

from __future__ import annotations

import copy
import warnings
from datetime import timedelta

import pytest
import torch
from torch import nn

from benchmarks.gpt_gpu import SYNC_REPORT
from tests.helpers.distributed import run_ranks
from tests.helpers.overlap import launch_fractions_and_weights
from tests.helpers.equivalence import TINY_MB, equivalence_cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (model, comm MB, last MB, find_unused, gradient_as_bucket_view, accumulate[, in-place threshold])
CUDA_CASES = [
    ("tied", TINY_MB, TINY_MB, False, False, 1),  # plain, many buckets
    ("tied", TINY_MB, TINY_MB, False, True, 1),  # bucket views
    ("tied", TINY_MB, TINY_MB, False, False, 3),  # no_sync
    ("branches", TINY_MB, TINY_MB, True, False, 2),  # find_unused, with no_sync
    ("branches", 25, 1, True, True, 2),  # find_unused, views
    ("mixed", TINY_MB, TINY_MB, False, False, 1),  # fp32/fp64/bf16/fp16
    ("mixed", 25, 1, False, True, 1, 64),  # in-place members next to flat ones
    ("sparse", 25, 1, True, False, 2),  # sparse embedding
]


def test_two_gloo_ranks_sharing_cuda0_match_single_process_and_ddp():
    results = run_ranks(equivalence_cases, 2, CUDA_CASES, "cuda:0", timeout=280)
    assert results[0] == results[1]


def test_two_nccl_ranks_on_one_gpu_fail_fast_naming_both():
    failures = run_ranks(
        _init_nccl, 2, expect_failure=True, timeout=60, PADDLE_DISTRI_BACKEND="nccl", FLAGS_selected_gpus="0"
    )
    assert sorted(failures) == [0, 1]
    for trace in failures.values():
        assert "ranks [0, 1] all resolve to the same CUDA device" in trace
        assert "FLAGS_selected_gpus" in trace


def _init_nccl(rank):
    import lit_dp

    lit_dp.init_parallel_env()


@pytest.fixture
def nccl_world_of_one():
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _stack(width: int = 256, depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())])


def _step(model, optimizer, inputs):
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_nccl_world_of_one_drives_the_reducer_without_host_synchronisation(nccl_world_of_one):
    import lit_dp

    model = lit_dp.DataParallel(_stack().cuda(), comm_buffer_size=0.25, last_comm_buffer_size=0.25)
    reference = copy.deepcopy(model.module)
    assert model.reducer is not None and len(model.reducer.bucket_indices) > 2
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    inputs = torch.randn(64, 256, device="cuda")
    for _ in range(2):  # the first iteration agrees on the ready order (a broadcast), the second rebuilds
        _step(model, optimizers[0], inputs)
        _step(reference, optimizers[1], inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _step(model, optimizers[0], inputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for _ in range(3):
        _step(reference, optimizers[1], inputs)
    for ours, theirs in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs)


def test_find_unused_reads_the_flags_once_per_step(nccl_world_of_one):
    import lit_dp

    model = lit_dp.DataParallel(_stack().cuda(), comm_buffer_size=0.25, last_comm_buffer_size=0.25, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(64, 256, device="cuda")
    for _ in range(2):
        _step(model, optimizer, inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                _step(model, optimizer, inputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if SYNC_REPORT in str(w.message)]
    assert len(syncs) <= 3, [str(w.message) for w in syncs]


def test_a_missing_gradient_raises_by_the_next_forward_on_cuda(nccl_world_of_one):
    import lit_dp

    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(8, 8)
            self.skipped = nn.Linear(8, 8)

        def forward(self, x):
            return self.used(x)

    model = lit_dp.DataParallel(Skips().cuda())
    inputs = torch.randn(4, 8, device="cuda")
    # The flags travel to the host without blocking: read at the end of this backward if they
    # already arrived (an idle GPU is that fast), else at the next forward.
    with pytest.raises(RuntimeError, match=r"skipped.weight \(missing on 1 of 1 ranks, including this one\)"):
        model(inputs).sum().backward()
        torch.cuda.synchronize()
        model(inputs)


@pytest.mark.parametrize("variant", ["DataParallel(compile(model))", "compile(DataParallel(model))"])
def test_inductor_keeps_overlap_and_eager_weights(nccl_world_of_one, variant):
    fractions = launch_fractions_and_weights(0, [variant], backend="inductor", device="cuda", atol=1e-4)
    assert fractions[variant] < 0.5, fractions


def test_lightning_fit_on_one_gpu_matches_ddp(tmp_path):
    from tests.helpers.lightning import Regressor, fit_weights

    ours = fit_weights("paddle_dp", tmp_path, accelerator="gpu", devices=1)
    theirs = fit_weights("ddp", tmp_path, accelerator="gpu", devices=1)
    for key in ours:
        torch.testing.assert_close(ours[key].cpu(), theirs[key].cpu(), msg=lambda m: f"{key}: {m}")
    assert not torch.equal(ours["net.0.weight"].cpu(), Regressor().state_dict()["net.0.weight"])


def stats_on_cuda(rank):
    import lit_dp

    lit_dp.init_parallel_env()
    torch.cuda.set_device(0)
    model = _stack(width=64, depth=4).cuda()
    wrapped = lit_dp.DataParallel(model, comm_buffer_size=0.02, last_comm_buffer_size=0.02, comm_stats=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(8, 64, device="cuda")
    for _ in range(4):
        _step(wrapped, optimizer, inputs)
    wrapped.flush_comm_stats()
    stats = wrapped.comm_stats()
    return {
        "bytes": stats.bytes,
        "buckets": stats.buckets,
        "time_ms": stats.time_ms,
        "exposed_ms": stats.exposed_ms,
        "overlap": stats.overlap,
        "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bucket_count": len(wrapped.reducer.bucket_indices),
    }


def test_communication_statistics_from_cuda_events():
    for rank, stats in run_ranks(stats_on_cuda, 2, timeout=120).items():
        assert stats["bytes"] == stats["gradient_bytes"] and stats["buckets"] == stats["bucket_count"] > 1, stats
        assert 0 <= stats["exposed_ms"] <= stats["time_ms"] and 0 <= stats["overlap"] <= 1, (rank, stats)


def diloco_memory_case(rank: int) -> dict[str, int]:
    """Peak CUDA memory (``max_memory_allocated``) of data-parallel steps, then of DiLoCo (K=2, F=2) with
    its state offloaded (the default) and kept on the device, on the same model and optimizer."""
    import lit_dp

    lit_dp.init_parallel_env()
    device = torch.device("cuda", 0)
    peaks = {}
    for mode in ("dp", "offload", "on_device"):
        torch.manual_seed(0)
        net = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8))).to(device)  # 32 MiB of fp32 parameters
        model = lit_dp.DataParallel(net)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        local_sgd = None
        if mode != "dp":
            local_sgd = lit_dp.LocalSGD(model, 2, outer="nesterov", fragments=2, offload=mode == "offload")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        for step in range(6):
            inputs = torch.randn(64, 1024, device=device)
            model(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if local_sgd is not None:
                local_sgd.step()
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated(device)
        if local_sgd is not None:
            peaks[f"{mode}_held_on_device"] = sum(by_device.get(str(device), 0) for by_device in local_sgd.held_bytes().values())
        del model, optimizer, local_sgd, net
        torch.cuda.empty_cache()
    return peaks


def test_diloco_offloaded_needs_at_most_one_fragment_more_gpu_memory_than_data_parallelism():
    results = run_ranks(diloco_memory_case, 2, timeout=280)
    parameters = 8 * (1024 * 1024 + 1024) * 4
    largest_fragment = parameters // 2 + 8 * 1024 * 4  # whole tensors: about half the model
    for rank, peaks in results.items():
        # A fragment's sync holds its payload (the pseudo-gradient) and the snapshot's copy on the device.
        assert peaks["offload"] <= peaks["dp"] + 2 * largest_fragment, f"rank {rank}: {peaks}"
        assert peaks["offload_held_on_device"] == 0, f"rank {rank}: {peaks}"
        # Kept on the device: the snapshot and the momentum, twice the parameters, which the peak shows.
        assert peaks["on_device_held_on_device"] == 2 * parameters, f"rank {rank}: {peaks}"
        assert peaks["on_device"] >= peaks["offload"] + parameters, f"rank {rank}: {peaks}"
