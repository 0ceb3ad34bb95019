"""The replica-consistency check: a bitwise fingerprint per tensor, compared across real Gloo ranks.

The checksum and the comparison are tested without processes; then two ranks in a hand-written
loop (``lit_dp.DataParallel`` alone) with a fault planted on rank 1 after a known optimizer
step: one flipped bit, a tiny change to one weight, a changed optimizer state, or none; a rank
that ran out of inputs under ``Join`` is not a difference; and every process of the job ends
when the check finds one, even one that swallows the error.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lit_dp.observability.consistency import RawViews, checksum, compare, fingerprints
from tests.helpers.distributed import run_ranks
from tests.helpers.jobs import run_job


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool])
@pytest.mark.parametrize("numel", [1, 7, 64])
def test_any_one_flipped_bit_changes_the_checksum(dtype, numel):
    tensor = (torch.randn(numel) * 10).to(dtype)
    reference = checksum(tensor)
    assert reference.dtype == torch.int64 and reference.shape == ()
    assert torch.equal(checksum(tensor.clone()), reference)
    raw = tensor.view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            raw[byte] ^= 1 << bit
            assert not torch.equal(checksum(tensor), reference), (dtype, numel, byte, bit)
            raw[byte] ^= 1 << bit
    assert torch.equal(checksum(tensor), reference)


def test_the_checksum_reads_the_tensor_not_its_storage_and_catches_the_smallest_change():
    weight = torch.randn(6, 8)
    reference = checksum(weight)
    weight[2, 3] = torch.nextafter(weight[2, 3], torch.tensor(float("inf")))  # one ulp
    assert not torch.equal(checksum(weight), reference)
    column = weight[:, 1]  # not contiguous, and at an odd offset in its storage
    assert torch.equal(checksum(column), checksum(column.clone()))
    assert torch.equal(checksum(weight[1:, 1:]), checksum(weight[1:, 1:].contiguous()))
    assert checksum(torch.zeros(0)).item() == 0


def test_the_parameters_views_are_kept_between_checks_and_made_again_when_a_parameter_is_replaced():
    params = [nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(5).half())]
    views, cpu = RawViews(params), torch.device("cpu")
    assert torch.equal(views.fingerprints(cpu), fingerprints(params, cpu))
    with torch.no_grad():
        params[1][3] += 1.0  # in place: the kept view sees it
    assert torch.equal(views.fingerprints(cpu), fingerprints(params, cpu))
    params[0].data = torch.randn(6, 8)  # another storage: a view of the old one would read stale weights
    assert torch.equal(views.fingerprints(cpu), fingerprints(params, cpu))


NAMES = ["parameter 'a'", "parameter 'b'", "buffer 'm'"]


def test_the_reference_is_the_majority_and_the_first_differing_tensor_is_named():
    rows = [[1, 1, 10, 20, 30], [1, 1, 10, 21, 31], [1, 1, 10, 20, 30]]
    assert compare([0, 1, 2], rows, NAMES, {2}) == (
        "rank 1 holds other weights than ranks 0 and 2, the reference. First differing: parameter 'b' "
        "(2 of 3 tensors differ on rank 1)"
    )
    assert compare([0, 1, 2], [rows[0]] * 3, NAMES, {2}) is None


def test_with_two_ranks_the_lowest_is_the_reference_and_buffers_count_only_when_every_rank_fingerprinted_them():
    assert compare([0, 1], [[1, 1, 10, 20, 30], [1, 1, 11, 20, 30]], NAMES, {2}).startswith(
        "rank 1 holds other weights than rank 0, taken as the reference (no majority among 2 ranks). First "
        "differing: parameter 'a'"
    )
    assert compare([0, 1], [[1, 0, 10, 20, 30], [1, 1, 10, 20, 31]], NAMES, {2}) is None  # no broadcast on rank 0
    assert "buffer 'm'" in compare([0, 1], [[1, 1, 10, 20, 30], [1, 1, 10, 20, 31]], NAMES, {2})
    assert compare([0, 1], [[1, 1, 10, 20, 30], [0, 1, 99, 20, 30]], NAMES, {2}) is None  # rank 1 not compared


EVERY = 4
FOUND_AT = 8  # the check that finds a fault planted after step 5's or step 7's optimizer step
# After which step's optimizer step each fault is planted on rank 1. A changed optimizer state
# changes the next update too: planted right before the check, the state is what differs first.
PLANTED_AFTER = {"flip": 5, "tiny": 5, "momentum": 7}
STEPS = 12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def plant(fault: str, model, optimizer) -> None:
    with torch.no_grad():
        if fault == "flip":  # one bit of one weight
            model.module.head.weight.view(-1).view(torch.int32)[3] ^= 1 << 7
        elif fault == "tiny":  # one weight moved by one ulp
            weight = model.module.body[0].weight
            weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
        elif fault == "momentum":
            optimizer.state[model.module.body[0].bias]["momentum_buffer"][0] += 1e-3


def train(rank: int, fault: str, action: str = "error", swallow: bool = False, uneven: bool = False) -> dict:
    import torch.distributed as dist

    import lit_dp
    import lit_dp.observability.consistency as consistency

    consistency.EXIT_GRACE_SECONDS = 3.0
    if not dist.is_initialized():
        lit_dp.init_parallel_env()
    model = lit_dp.DataParallel(
        Net(), consistency_every_n_steps=EVERY, consistency_action=action,
        consistency_optimizer_state=fault == "momentum", straggler_every_n_steps=None,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    steps = STEPS - 5 * rank if uneven else STEPS
    try:
        with model.join(enable=uneven):
            for step in range(steps):
                model(torch.randn(16, 8)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                if rank == 1 and step == PLANTED_AFTER.get(fault):
                    plant(fault, model, optimizer)
    except consistency.ReplicaDivergenceError as error:
        if swallow:
            time.sleep(60)  # a loop that catches the error and goes on: the process is ended all the same
        return {"error": str(error), "at": model.reducer.step}
    return {"checks": model.consistency.checks, "agreed_at": model.consistency.agreed_at, "differences": model.consistency.differences}


def hand_written_loop(rank: int) -> dict:
    """Every scenario in one pair of processes, the ones that raise last."""
    results = {}
    for fault, action, uneven in (("none", "error", False), ("none", "error", True), ("flip", "warn", False)):
        results[(fault, action, uneven)] = train(rank, fault, action, uneven=uneven)
    for fault in ("flip", "tiny", "momentum"):
        results[fault] = train(rank, fault)
    return results


def test_a_flipped_bit_a_tiny_change_and_a_changed_optimizer_state_stop_every_rank_naming_rank_tensor_and_step():
    results = run_ranks(hand_written_loop, 2, timeout=120)
    healthy = results[0][("none", "error", False)]
    assert healthy == {"checks": 3, "agreed_at": 8, "differences": []}  # steps 0, 4, 8
    # Uneven inputs under Join: rank 1 runs out after 7 steps and shadows the rest: not a difference.
    assert results[1][("none", "error", True)]["differences"] == []
    first = FOUND_AT
    for fault, tensor in (
        ("flip", "parameter 'head.weight'"),
        ("tiny", "parameter 'body.0.weight'"),
        ("momentum", "optimizer state of parameter 'body.0.bias'"),
    ):
        assert results[0][fault] == results[1][fault], "every rank stops at the same step with the same error"
        error = results[0][fault]["error"]
        assert results[0][fault]["at"] == first, error
        assert error.startswith(
            f"lit_dp replica consistency: at synchronised step {first} the replicas differ: rank 1 holds other weights "
            f"than rank 0, taken as the reference (no majority among 2 ranks). First differing: {tensor} (1 of "
        ), error
        assert error.endswith(f"they last agreed at step {first - EVERY} (consistency.every_n_steps={EVERY})."), error
    warned = results[0][("flip", "warn", False)]
    assert warned["checks"] == 3 and len(warned["differences"]) == 1 and warned["agreed_at"] == 4


@pytest.mark.slow
def test_a_process_that_swallows_the_error_still_ends(tmp_path):
    ends = run_job(train, 2, tmp_path, "flip", "error", True, timeout=90)
    for rank, end in ends.items():
        assert end.exitcode == 1 and end.ok is None, (rank, end)
        assert "did not end within 3s of the verdict (the replicas diverged)" in end.stderr, end.stderr[-2000:]
