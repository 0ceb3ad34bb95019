"""LocalSGD's syncs in a wire format (``sync_dtype``: bf16, int8, int4, fp8) and their error feedback.

Oracles: values a format represents (a power-of-two scale times codes) come back exactly, and so do
their sums where the format represents the sums; the bytes are counted from the format's definition
(two int4 codes a byte, an fp32 scale per 128 values, a chunk per rank); error feedback is checked
against its invariant, written out here: after every sync, the fp32 sum of all the ranks' deltas
minus the sum applied equals the sum of the ranks' residuals, so the applied sum tracks the fp32
one within a residual, where without feedback the dropped part accumulates. Multi-rank cases run on
real gloo processes.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lit_dp import PaddleDPStrategy
from lit_dp.local_sgd.transport import SyncBucket, wire_format
from lit_dp.local_sgd.wire import BLOCK, available_formats
from tests.helpers.distributed import run_ranks
from tests.test_local_sgd import Net, mse, random_steps

QUANTIZED = ("int8", "int4", "fp8")
LARGEST = {"int8": 127, "int4": 7, "fp8": 448}


def representable(name: str, rows: int, length: int, seed: int, spread: int | None = None) -> torch.Tensor:
    """Values ``name`` carries exactly: in each block, codes times a power-of-two scale, the largest code
    reached (so that the block's scale is that power of two). ``spread`` bounds the codes' magnitude."""
    generator = torch.Generator().manual_seed(seed)
    if name == "bf16":  # 8 significant bits: integers up to 256 are exact
        return torch.randint(-(spread or 256), (spread or 256) + 1, (rows, length), generator=generator) * 2.0**-12
    largest = LARGEST[name]
    bound = spread if spread is not None else (largest if name != "fp8" else 16)  # fp8: integers up to 16 are exact
    codes = torch.randint(-bound, bound + 1, (rows, length), generator=generator).float()
    codes.view(rows, -1, BLOCK)[:, :, 0] = largest
    return codes * 2.0**-12


@pytest.mark.parametrize("name", ["bf16", *QUANTIZED])
def test_a_format_returns_the_values_it_represents_exactly(name):
    wire = available_formats()[name]
    values = representable(name, 3, 4 * BLOCK, seed=1)
    encoded = wire.encode(values)
    assert encoded.dtype == torch.uint8 and encoded.shape == (3, wire.row_bytes(4 * BLOCK))
    assert torch.equal(wire.decode(encoded, 4 * BLOCK, torch.float32), values)


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_block_scaled_format_drops_at_most_half_a_step(name):
    wire = available_formats()[name]
    values = torch.randn(2, 8 * BLOCK, generator=torch.Generator().manual_seed(2))
    values[0, :BLOCK] = 0.0  # a block of zeros: scale 0, codes 0, nothing dropped
    dropped = (values - wire.decode(wire.encode(values), 8 * BLOCK, torch.float32)).view(2, -1, BLOCK)
    step = values.view(2, -1, BLOCK).abs().amax(dim=-1, keepdim=True) / LARGEST[name]
    # int: half a step; fp8 (3 mantissa bits): 2^-4 of the value, or half its smallest subnormal (2^-9 steps).
    bound = step / 2 if name != "fp8" else values.view(2, -1, BLOCK).abs() * 2**-4 + step * 2**-10
    assert (dropped.abs() <= bound + 1e-7).all()
    assert torch.equal(dropped[0, 0], torch.zeros(BLOCK))


def test_a_non_finite_delta_stays_non_finite():
    wire = available_formats()["int8"]
    values = torch.ones(1, 2 * BLOCK)
    values[0, 3] = float("nan")
    decoded = wire.decode(wire.encode(values), 2 * BLOCK, torch.float32)
    assert decoded[0, :BLOCK].isnan().all() and torch.equal(decoded[0, BLOCK:], values[0, BLOCK:])


@pytest.mark.parametrize(
    ("name", "value_bytes"),
    [("bf16", 2.0), ("int8", 1 + 4 / BLOCK), ("fp8", 1 + 4 / BLOCK), ("int4", 0.5 + 4 / BLOCK)],
)
def test_the_wire_bytes_are_the_formats_with_scales_and_a_chunk_per_rank(name, value_bytes):
    tensors = [torch.zeros(1000, 3), torch.zeros(77)]  # 3077 values
    bucket = SyncBucket("delta", tensors, wire_format(name))
    for ranks in (1, 2, 3):
        granule = 1 if name == "bf16" else BLOCK
        padded = -(-3077 // (ranks * granule)) * ranks * granule
        assert bucket.wire_bytes(ranks) == padded * value_bytes, (name, ranks)
    assert SyncBucket("delta", tensors).wire_bytes(2) == 3077 * 4  # fp32: the parameters' bytes, all-reduced
    # At scale the padding vanishes: int8 and fp8 send 0.258 of fp32's bytes, int4 0.133, bf16 half.
    large = SyncBucket("delta", [torch.zeros(1 << 20)], wire_format(name))
    assert large.wire_bytes(2) / (4 << 20) == pytest.approx(value_bytes / 4)


def test_a_bucket_of_the_wire_dtype_travels_unchanged():
    bucket = SyncBucket("delta", [torch.zeros(10, dtype=torch.bfloat16)], wire_format("bf16"), error_feedback=True)
    assert bucket.wire is None and bucket.residual is None and bucket.wire_bytes(2) == 20


def test_the_library_refuses_what_a_wire_format_cannot_do_by_name(monkeypatch):
    import torch.distributed as dist

    import lit_dp

    model = nn.Linear(2, 2)
    for kwargs, message in (
        (dict(sync_dtype="fp16"), "sync_dtype='fp16' is invalid: expected None, torch.bfloat16 or one of 'bf16', 'int8', 'int4', 'fp8'."),
        (
            dict(error_feedback=True),
            "error_feedback=True with sync_dtype=None is invalid: a sync in the parameters' dtype drops nothing to feed "
            "back; expected a sync_dtype (bf16, int8, int4, fp8) or error_feedback=None.",
        ),
        (dict(sync_dtype="int8", error_feedback="yes"), "error_feedback='yes' is invalid: expected True, False or None"),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            lit_dp.LocalSGD(model, 4, **kwargs)

    class OtherBackend(dist.ProcessGroup):
        def __init__(self) -> None:
            super().__init__(0, 2)

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "mpi"

    message = (
        "sync_dtype='int4' is invalid on the process group's backend 'mpi': a sync in a wire format takes an "
        "all-to-all and an all-gather, which lit_dp runs on gloo and nccl; expected sync_dtype=None (the parameters' "
        "dtype) on this backend."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        lit_dp.LocalSGD(model, 4, sync_dtype="int4", group=OtherBackend())
    lit_dp.LocalSGD(model, 4, group=OtherBackend())  # fp32 syncs: its all-reduce

    # A torch build without float8_e4m3fn cannot encode fp8: refused, naming what it can.
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match=re.escape("(this torch build, ") + r".*" + re.escape("has no float8_e4m3fn for 'fp8'): expected None, torch.bfloat16 or one of 'bf16', 'int8', 'int4'.")):
        lit_dp.LocalSGD(model, 4, sync_dtype="fp8")
    with pytest.raises(ValueError, match=r"^local_sgd_sync_dtype='fp8' is invalid with this torch build .*, which has no float8_e4m3fn: expected one of bf16, int8, int4\.$"):
        PaddleDPStrategy(local_sgd_steps=4, local_sgd_sync_dtype="fp8")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(local_sgd_error_feedback=True), "local_sgd_error_feedback=True needs local_sgd_steps"),
        (
            dict(local_sgd_steps=4, local_sgd_error_feedback=True),
            "local_sgd_error_feedback=True with local_sgd_sync_dtype=None is invalid: a sync in the parameters' dtype "
            "drops nothing to feed back; expected a local_sgd_sync_dtype (bf16, int8, int4, fp8) or "
            "local_sgd_error_feedback=None.",
        ),
        (dict(local_sgd_steps=4, local_sgd_error_feedback=1), "local_sgd_error_feedback=1 is invalid: expected True, False or None"),
        (
            dict(local_sgd_steps=4, local_sgd_sync_dtype="int8", fault_tolerance="torchft"),
            "local_sgd_sync_dtype='int8' with fault_tolerance='torchft' is not supported: its sums in fp32 take an "
            "all-to-all and an all-gather, and lit_dp's groups across replica groups offer a SUM all-reduce only",
        ),
    ],
)
def test_the_strategy_refuses_error_feedback_without_a_wire_format_by_name(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PaddleDPStrategy(**options)


def test_the_strategy_takes_error_feedback_with_a_wire_format():
    for dtype in ("bf16", "int8", "int4", "fp8"):
        for feedback in (None, True, False):
            strategy = PaddleDPStrategy(local_sgd_steps=4, local_sgd_sync_dtype=dtype, local_sgd_error_feedback=feedback)
            assert strategy.options.local_sgd.error_feedback is feedback


def _vector_model(size: int) -> nn.Module:
    model = nn.Module()
    model.weight = nn.Parameter(torch.zeros(size))
    return model


def exact_sum_case(rank: int) -> dict:
    """3 ranks, 1000 values (padded to 3 x 384): deltas each format represents, whose sum it represents too,
    are summed exactly; with error feedback on, nothing is dropped, so every residual stays zero."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    world_size, size = dist.get_world_size(), 1000
    report = {}
    for name in ("bf16", *QUANTIZED):
        # Rank r's codes are within +-(largest / 3) but for one value per block, which only rank r has
        # (the others send 0 there): the sum's codes stay within the largest, which the sum reaches
        # (bf16: integers within +-240 times a power of two).
        padded = 3 * BLOCK * 3
        deltas = []
        for r in range(world_size):
            spread = {"bf16": 80, "int8": 42, "int4": 2, "fp8": 5}[name]
            delta = representable(name, 1, padded, seed=10 + r, spread=spread)[0]
            if name != "bf16":
                blocks = delta.view(-1, BLOCK)
                blocks[:, : 1 + world_size] = 0.0
                blocks[:, 1 + r] = LARGEST[name] * 2.0**-12 * (-1) ** r
            deltas.append(delta[:size])
        model = _vector_model(size)
        local_sgd = lit_dp.LocalSGD(model, 1, sync_dtype=name, error_feedback=name != "bf16" or None)
        with torch.no_grad():
            model.weight.sub_(deltas[rank])
        local_sgd.step()
        total = deltas[0].clone()
        for delta in deltas[1:]:
            total += delta
        expected = torch.zeros(size).sub_(total, alpha=1 / world_size)
        residuals = local_sgd.rank_state_dict().get("error_feedback", {}).get("residuals", [torch.zeros(size)])
        report[name] = {
            "exact": torch.equal(model.weight.detach(), expected),
            "nothing dropped": torch.equal(residuals[0], torch.zeros(size)),
        }
    return report


@pytest.mark.slow
def test_sums_of_values_a_format_represents_are_exact_on_3_ranks():
    results = run_ranks(exact_sum_case, 3, timeout=120)
    for rank, result in results.items():
        for name, checks in result.items():
            assert checks == {"exact": True, "nothing dropped": True}, f"rank {rank}, {name}: {checks}"


def feedback_case(rank: int, syncs: int) -> dict:
    """2 ranks, ``syncs`` averages of deltas that a block-scaled format drops much of: in each block one
    value of magnitude 1 and the others about 0.4 of half a step, which round to 0 every time (and again
    when the sum is encoded). With error feedback the model after the syncs is the fp32 one plus the
    ranks' residuals over their number, exactly up to fp32 rounding (the invariant); without, the dropped
    part accumulates."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    world_size, size = dist.get_world_size(), 3 * BLOCK + 40
    report = {}
    for name in ("int8", "int4"):
        small = 0.4 * 0.5 / LARGEST[name]
        for feedback in (True, False):
            model = _vector_model(size)
            local_sgd = lit_dp.LocalSGD(model, 1, sync_dtype=name, error_feedback=feedback)
            reference = torch.zeros(size, dtype=torch.float64)
            generator = torch.Generator().manual_seed(3)
            for _ in range(syncs):
                deltas = []
                for _ in range(world_size):  # every rank draws every rank's delta: the reference needs them all
                    delta = small * (1 + 0.2 * torch.randn(size, generator=generator))
                    delta[::BLOCK] = torch.randn(delta[::BLOCK].shape, generator=generator).sign()
                    deltas.append(delta)
                with torch.no_grad():
                    model.weight.sub_(deltas[rank])
                local_sgd.step()
                reference -= torch.stack(deltas).double().sum(dim=0) / world_size
            residual = local_sgd.rank_state_dict()["error_feedback"]["residuals"][0] if feedback else torch.zeros(size)
            dist.all_reduce(residual)
            error = model.weight.detach().double() - reference
            report[(name, feedback)] = {
                "error": error.abs().max().item(),
                "invariant": (error - residual.double() / world_size).abs().max().item(),
            }
    return report


@pytest.mark.slow
def test_error_feedback_carries_what_the_format_drops_so_the_sum_tracks_fp32():
    syncs = 40
    results = run_ranks(feedback_case, 2, syncs, timeout=180)
    assert results[0] == results[1]
    for name in ("int8", "int4"):
        small = 0.4 * 0.5 / LARGEST[name]
        with_feedback, without = results[0][(name, True)], results[0][(name, False)]
        # The invariant holds to fp32 rounding of the model (~1e-7 of its magnitude, ~syncs * small).
        assert with_feedback["invariant"] < 1e-5, (name, with_feedback)
        # With feedback the model is off by a residual at most (below a step of the sum's encoding: 2/largest);
        # without, by every small value dropped: about syncs * small.
        assert with_feedback["error"] < 2 / LARGEST[name], (name, with_feedback)
        assert without["error"] > 0.8 * syncs * small, (name, without)
        assert without["error"] > 5 * with_feedback["error"], (name, with_feedback, without)
