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
from lit_dp.local_sgd.transport import SyncBucket
from lit_dp.local_sgd.wire import BLOCK, available_formats, wire_format
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
            "local_sgd_error_feedback=True needs local_sgd_sync_dtype: a sync in the parameters' dtype drops nothing "
            "to feed back; expected local_sgd_sync_dtype=bf16, int8, int4 or fp8, or local_sgd_error_feedback=None.",
        ),
        (dict(local_sgd_steps=4, local_sgd_error_feedback=1), "local_sgd_error_feedback=1 is invalid: expected True, False or None"),
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


class ReferenceSync:
    """A sync in int8 or int4 over the ranks, on one process, written out from its definition: each rank's
    delta plus its residual, padded to a chunk per rank of whole blocks, rounded per block of ``BLOCK`` values
    to codes of an fp32 scale (largest magnitude / largest code, half to even); each chunk summed in fp32 in
    rank order and rounded the same way. Error feedback: each rank keeps what its rounding dropped (a rank
    not taking part sends zeros and keeps its residual), each chunk's owner what its sum's rounding dropped."""

    def __init__(self, bits: int, feedback: bool) -> None:
        self.largest, self.feedback = 2 ** (bits - 1) - 1, feedback
        self.residuals: dict[int, list[torch.Tensor]] = {}  # per bucket (a fragment here): each rank's

    def _round(self, values: torch.Tensor) -> torch.Tensor:
        blocks = values.view(-1, BLOCK)
        scale = (blocks.abs().amax(dim=1, keepdim=True) / self.largest).float()
        codes = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks)).round().clamp(-self.largest, self.largest)
        return (codes * scale).view(-1)

    def sum(self, bucket: int, deltas: list[torch.Tensor], taking_part: list[bool]) -> torch.Tensor:
        ranks, size = len(deltas), deltas[0].numel()
        length = -(-size // (ranks * BLOCK)) * BLOCK
        residuals = self.residuals.setdefault(bucket, [torch.zeros(size) for _ in range(ranks)])
        sent = []
        for rank, (delta, part) in enumerate(zip(deltas, taking_part)):
            values = torch.zeros(ranks * length)
            if part:
                values[:size] = delta
                if self.feedback:
                    values[:size] += residuals[rank]
            rounded = self._round(values)
            if part and self.feedback:
                residuals[rank] = (values - rounded)[:size]
            sent.append(rounded)
        total = torch.empty(ranks * length)
        for owner in range(ranks):
            chunk = slice(owner * length, (owner + 1) * length)
            chunk_sum = sent[0][chunk].clone()
            for rank in range(1, ranks):
                chunk_sum += sent[rank][chunk]
            total[chunk] = self._round(chunk_sum)
            if taking_part[owner] and self.feedback:
                dropped = (chunk_sum - total[chunk])[: max(0, min(length, size - owner * length))]
                residuals[owner][owner * length : owner * length + dropped.numel()] += dropped
        return total[:size]


def flat(model: nn.Module, names: list[str]) -> torch.Tensor:
    parameters = dict(model.named_parameters())
    return torch.cat([parameters[name].detach().reshape(-1) for name in names])


@torch.no_grad()
def assign(models: list[nn.Module], names: list[str], values: torch.Tensor) -> None:
    for model in models:
        parameters = dict(model.named_parameters())
        for name, piece in zip(names, values.split([parameters[n].numel() for n in names])):
            parameters[name].copy_(piece.view_as(parameters[name]))


def streaming_reference(steps: list, k: int, fragments: list[list[str]], delay: int, sync: ReferenceSync) -> list[nn.Module]:
    """Streaming averaging on one process: fragment f's deltas are summed (``sync``) after the steps
    ``(f+1) * K/F + n*K``, and ``delay`` steps later its snapshot steps to ``snapshot - sum / ranks``, which
    every rank takes; at the end a sync in flight is applied, then every other fragment stepped since its last sync."""
    from tests.test_local_sgd_outer import delay_net

    models = [delay_net() for _ in steps[0][1]]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    snapshots = [flat(models[0], names) for names in fragments]
    last_syncs = [-k + (f + 1) * k // len(fragments) for f in range(len(fragments))]

    def start(fragment: int) -> tuple[int, torch.Tensor]:
        deltas = [snapshots[fragment] - flat(model, fragments[fragment]) for model in models]
        return fragment, sync.sum(fragment, deltas, [True] * len(models))

    def apply(fragment: int, total: torch.Tensor) -> None:
        snapshots[fragment].sub_(total, alpha=1.0 / len(models))
        assign(models, fragments[fragment], snapshots[fragment])

    pending = None
    for number, (_, micro_batches) in enumerate(steps, start=1):
        for model, optimizer, batches in zip(models, optimizers, micro_batches):
            mse(model, batches[0]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if pending is not None and number - pending[2] >= delay:
            apply(*pending[:2])
            pending = None
        due = [f for f, last in enumerate(last_syncs) if number - last >= k]
        if due:
            last_syncs[due[0]] = number
            pending = (*start(due[0]), number)
            if delay == 0:
                apply(*pending[:2])
                pending = None
    if pending is not None:
        apply(*pending[:2])
    for fragment, last in enumerate(last_syncs):
        if (pending is None or fragment != pending[0]) and len(steps) > last:
            apply(*start(fragment))
    return models


def streaming_case(rank: int, tmp_path: str) -> dict:
    """Streaming averaging in 2 fragments with ``sync_delay=1`` in int4 and int8, with and without error
    feedback, by hand against ``streaming_reference``; then DiLoCo in int4 with error feedback, saved between
    two syncs (one in flight) and resumed, each rank from its own file: the uninterrupted run's weights, bit
    for bit, which the same resume without the residuals misses."""
    import torch.distributed as dist

    import lit_dp
    from tests.test_local_sgd_outer import _train, delay_net, fragment_names

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    fragments = fragment_names(delay_net(), 2)
    steps = random_steps(15, world_size, seed=21)
    report: dict = {}
    for name, bits in (("int4", 4), ("int8", 8)):
        for feedback in (True, False):
            model = lit_dp.DataParallel(delay_net())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            local_sgd = lit_dp.LocalSGD(model, 4, fragments=2, sync_delay=1, sync_dtype=name, error_feedback=feedback)
            _train(model, optimizer, local_sgd, steps, rank, last=14)  # fragment 0's sync after 14 is in flight
            local_sgd.finish()
            expected = streaming_reference(steps[:14], 4, fragments, 1, ReferenceSync(bits, feedback))[rank]
            report[(name, feedback)] = all(torch.equal(p, q) for p, q in zip(model.module.parameters(), expected.parameters()))

    def build():
        model = lit_dp.DataParallel(Net())
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, optimizer, lit_dp.LocalSGD(model, 4, outer="nesterov", fragments=2, sync_delay=1, sync_dtype="int4")

    steps = random_steps(16, world_size, seed=11)
    model, optimizer, local_sgd = build()
    _train(model, optimizer, local_sgd, steps, rank)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    model, optimizer, local_sgd = build()
    _train(model, optimizer, local_sgd, steps, rank, last=10)  # fragment 1 started after step 9, applied after 10
    path = f"{tmp_path}/rank{rank}.pt"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "local_sgd": local_sgd.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    feedback = saved["local_sgd"]["error_feedback"]
    report["saved"] = (feedback["rank"], feedback["world_size"], "pending" in saved["local_sgd"])
    report["residuals held"] = all(r is not None and bool(r.any()) for r in feedback["residuals"])
    for label, state in (("resume exact", saved["local_sgd"]), ("without residuals", {**saved["local_sgd"], "error_feedback": None})):
        model, optimizer, local_sgd = build()
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        local_sgd.load_state_dict({key: value for key, value in state.items() if value is not None})
        _train(model, optimizer, local_sgd, steps, rank, first=10)
        report[label] = all(torch.equal(p, q) for p, q in zip(model.parameters(), uninterrupted))
    return report


@pytest.mark.slow
def test_streaming_syncs_match_the_reference_and_an_int4_resume_between_syncs_is_exact(tmp_path):
    results = run_ranks(streaming_case, 2, str(tmp_path), timeout=240)
    for rank, result in results.items():
        assert result == {
            ("int4", True): True, ("int4", False): True, ("int8", True): True, ("int8", False): True,
            "saved": (rank, 2, True), "residuals held": True, "resume exact": True, "without residuals": False,
        }, f"rank {rank}: {result}"  # fmt: skip


def uneven_wire_case(rank: int, tmp_path: str, counts: list[int]) -> list[float]:
    from tests.helpers.lightning import trainer as lightning_trainer
    from tests.test_local_sgd import UnevenRegressor

    module = UnevenRegressor(rank, counts[rank])
    strategy = PaddleDPStrategy(uneven_inputs=True, local_sgd_steps=2, local_sgd_sync_dtype="int8")
    trainer = lightning_trainer(strategy, tmp_path, max_epochs=1, use_distributed_sampler=False)
    trainer.fit(module)
    return torch.cat([p.detach().flatten() for p in module.net.parameters()]).tolist()


def uneven_wire_reference(counts: list[int], period: int, sync: ReferenceSync) -> torch.Tensor:
    """One process: each rank steps while it has batches; every ``period`` steps, and at the end, the ranks
    that took a step since the last average take part in the sync (``sync``; the others send zeros and keep
    their residuals), divided by their number, and every rank takes the result."""
    from tests.test_local_sgd import UnevenRegressor, regression_loss, uneven_batches

    models = [UnevenRegressor(rank, count).net for rank, count in enumerate(counts)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    batches = [uneven_batches(rank, count) for rank, count in enumerate(counts)]
    names = [name for name, _ in models[0].named_parameters()]
    snapshot = flat(models[0], names)
    trained = [False] * len(counts)

    def average() -> None:
        total = sync.sum(0, [snapshot - flat(m, names) for m in models], trained)
        snapshot.sub_(total, alpha=1.0 / sum(trained))
        assign(models, names, snapshot)
        trained[:] = [False] * len(counts)

    for step in range(1, max(counts) + 1):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            if step <= counts[rank]:
                regression_loss(model, batches[rank][step - 1]).backward()
                optimizer.step()
                optimizer.zero_grad()
                trained[rank] = True
        if step % period == 0:
            average()
    if max(counts) % period:
        average()
    return flat(models[0], names)


@pytest.mark.slow
def test_under_join_a_rank_that_ran_out_sends_zeros_and_keeps_its_residual(tmp_path):
    # Rank 0 has 3 batches, rank 1 has 7; K=2: the sync after step 4 still counts rank 0's step 3, those
    # after 6 and the final one after 7 count rank 1 alone, rank 0 sending zeros (int8, error feedback on).
    counts = [3, 7]
    results = run_ranks(uneven_wire_case, 2, str(tmp_path), counts, timeout=180)
    expected = uneven_wire_reference(counts, 2, ReferenceSync(8, feedback=True))
    without_feedback = uneven_wire_reference(counts, 2, ReferenceSync(8, feedback=False))
    assert not torch.equal(expected, without_feedback), "the data does not tell error feedback apart"
    for rank, values in results.items():
        assert torch.equal(torch.tensor(values), expected), f"rank {rank}: {(torch.tensor(values) - expected).abs().max()}"


def lightning_resume_case(rank: int, tmp_path: str) -> dict:
    """The Trainer strategy with ``local_sgd_sync_dtype="int4"`` (error feedback on): 4 epochs uninterrupted,
    then 2 and a resume to 4 from the checkpoint after step 8, between two syncs: the same weights, bit for
    bit, on every rank, rank 1's residuals coming back from the checkpoint's replicas."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_local_sgd import assert_same_weights, fit

    # K=3, W=1: syncs after steps 4, 7, 10, 13 and finish() after 16; the checkpoint after step 8 is mid-period.
    options = dict(local_sgd_steps=3, local_sgd_warmup_steps=1, local_sgd_outer="nesterov", local_sgd_sync_dtype="int4")
    module, uninterrupted = fit(f"{tmp_path}/a", 4, **options)
    checkpoints = ModelCheckpoint(dirpath=f"{tmp_path}/ckpt", save_last=True)
    fit(f"{tmp_path}/b", 2, callbacks=[checkpoints], **options)
    saved = torch.load(f"{tmp_path}/ckpt/last.ckpt", weights_only=False)["lit_dp"]["local_sgd"]
    resumed_module, resumed = fit(f"{tmp_path}/c", 4, ckpt_path=f"{tmp_path}/ckpt/last.ckpt", **options)
    assert resumed == uninterrupted[8:], f"rank {rank}: resumed schedule {resumed} != {uninterrupted[8:]}"
    assert_same_weights(resumed_module, module, f"rank {rank}: resumed between two int4 syncs")
    replica = saved["replicas"]["ranks"][1]["local_sgd"]["error_feedback"]
    return {
        "rank 0's": (saved["error_feedback"]["rank"], any(r.any() for r in saved["error_feedback"]["residuals"])),
        "rank 1's": (replica["rank"], any(r.any() for r in replica["residuals"])),
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lightning_strategy_resumes_an_int4_sync_exactly_between_syncs(tmp_path):
    results = run_ranks(lightning_resume_case, 2, str(tmp_path), timeout=300)
    assert results == {rank: {"rank 0's": (0, True), "rank 1's": (1, True)} for rank in (0, 1)}, results


def python_group_case(rank: int) -> dict:
    """A sync in int4 with error feedback over a process group written in Python that offers nothing but
    ``alltoall_base``, ``allgather_into_tensor_coalesced`` and ``allreduce`` (what torchft's process groups
    offer, and all that the quantized sync asks): the same sums and residuals as over torch's own group."""
    import torch.distributed as dist

    import lit_dp
    from lit_dp.gradients.waiting import UNWATCHED
    from lit_dp.local_sgd.transport import reduce_across

    class ThreeCollectives(dist.ProcessGroup):
        def __init__(self, inner: dist.ProcessGroup) -> None:
            super().__init__(inner.rank(), inner.size())
            self.inner, self.calls = inner, []

        def alltoall_base(self, output, tensor, output_splits, input_splits, opts):
            self.calls.append("alltoall_base")
            return self.inner.alltoall_base(output, tensor, output_splits, input_splits, opts)

        def allgather_into_tensor_coalesced(self, outputs, tensors, opts):
            self.calls.append("allgather_into_tensor_coalesced")
            return self.inner.allgather_into_tensor_coalesced(outputs, tensors, opts)

        def allreduce(self, tensors, opts):
            self.calls.append("allreduce")
            return self.inner.allreduce(tensors, opts)

    lit_dp.init_parallel_env()
    python_group = ThreeCollectives(dist.group.WORLD)
    results = []
    for group in (dist.group.WORLD, python_group):
        parameter = torch.zeros(700)
        bucket = SyncBucket("delta", [parameter], wire_format("int4"), error_feedback=True)
        for sync in range(3):
            with torch.no_grad():
                parameter.copy_(bucket.snapshot - torch.randn(700, generator=torch.Generator().manual_seed(10 * sync + rank)))
            reduction = reduce_across([bucket], [group], UNWATCHED)
            participants = reduction.wait()
            bucket.apply(participants, outer=False)
        results.append((parameter.clone(), bucket.residual.clone()))
    return {
        "same sums and residuals": all(torch.equal(a, b) for a, b in zip(*results)),
        "calls": sorted(set(python_group.calls)),
    }


@pytest.mark.slow
def test_a_group_that_offers_an_all_to_all_and_an_all_gather_carries_a_quantized_sync():
    results = run_ranks(python_group_case, 2, timeout=120)
    expected = {"same sums and residuals": True, "calls": ["allgather_into_tensor_coalesced", "allreduce", "alltoall_base"]}
    assert results == {0: expected, 1: expected}, results
