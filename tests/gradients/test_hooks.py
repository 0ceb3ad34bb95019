"""Communication hooks: torch's own hooks, unchanged, on lit_dp's buckets (real gloo processes).

Oracles, per hook:
- ``allreduce_hook``: bit-identical to lit_dp without a hook on 2 ranks (same division, same
  sums); on 3 ranks within float rounding (see ``train_with_hook``).
- fp16/bf16 compression: bit-identical to torch DDP with the same hook (compression is
  elementwise; on 2 ranks a sum of two values does not depend on the order), and within the
  compression's rounding of the single-process gradient at the same weights.
- PowerSGD at full rank (every matrix side <= the rank, ``min_compression_rate=0`` so every
  tensor is compressed): P Q^T reproduces the average up to float rounding, so the run tracks
  the single-process reference within float tolerance, warm-up and compressed steps alike.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.models import MODELS, batch, loss, reference_loss, shard
from tests.helpers.recipes import compose_config

TINY_MB = 64 / 2**20  # about one parameter per bucket
STEPS = 4
DIGITS_STEPS = 150
START_ITER = 2  # PowerSGD: plain all-reduce for 2 iterations (the buckets are rebuilt after the first)
# bf16 keeps 8 significant bits, fp16 11: each rank's value is rounded once when cast and the
# sum once more, so an element is off by at most about 3 units in the last place of the
# largest magnitude involved.
HALF_TOLERANCE = {"bf16": 3 * 2.0**-8, "fp16": 3 * 2.0**-11}


def make_hook(spec: str, model: nn.Module, rank_override: int | None = None):
    """(state, hook) for a case; a fresh state per model (PowerSGD keeps per-bucket memory)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if spec == "allreduce":
        return None, default.allreduce_hook
    if spec in ("fp16", "bf16"):
        return None, getattr(default, f"{spec}_compress_hook")
    if spec in ("fp16_wrapper", "bf16_wrapper"):
        return None, getattr(default, f"{spec[:4]}_compress_wrapper")(default.allreduce_hook)
    if spec == "powersgd":
        # Full rank: no matrix side exceeds it, so the low-rank product is exact.
        rank = max(max(p.shape[0], p[0].numel()) for p in model.parameters())
        state = powersgd.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=START_ITER, min_compression_rate=0,
            orthogonalization_epsilon=1e-12,  # unused parameters give zero columns; keeps them 0, not NaN
        )
        return state, powersgd.powerSGD_hook
    if spec == "batched":
        # One bucket, viewed as a square matrix of side ceil(sqrt(numel)); full rank is that side.
        side = math.ceil(math.sqrt(sum(p.numel() for p in model.parameters())))
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=side, start_powerSGD_iter=START_ITER)
        return state, powersgd.batched_powerSGD_hook
    raise ValueError(spec)


def ddp_hook(spec: str, model: nn.Module):
    """``make_hook`` for torch DDP, the oracle. DDP refuses torch's bf16 hooks by name where torch
    was built without CUDA and NCCL (its ``_check_comm_hook``), though they run on Gloo: there the
    same hook under another name is the oracle, computing exactly what torch's hook computes."""
    state, hook = make_hook(spec, model)
    if not spec.startswith("bf16"):
        return state, hook

    def bf16_oracle(hook_state, bucket):
        return hook(hook_state, bucket)

    return state, bf16_oracle


def train_with_hook(rank, name, comm_mb, last_mb, find_unused, as_view, accumulate, spec, steps=STEPS):
    """lit_dp with the hook against its oracle (see the module docstring), step by step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp

    world_size = dist.get_world_size()
    torch.manual_seed(0)
    base = MODELS[name]()
    copies = {key: copy.deepcopy(base) for key in ("plain", "ddp", "reference")}
    ours = lit_dp.DataParallel(
        base, comm_buffer_size=comm_mb, last_comm_buffer_size=last_mb,
        find_unused_parameters=find_unused, gradient_as_bucket_view=as_view,
    )  # fmt: skip
    ours.register_comm_hook(*make_hook(spec, base))
    if spec == "allreduce":
        other = lit_dp.DataParallel(
            copies["plain"], comm_buffer_size=comm_mb, last_comm_buffer_size=last_mb,
            find_unused_parameters=find_unused, gradient_as_bucket_view=as_view,
        )  # fmt: skip
    elif spec in HALF_TOLERANCE or spec.endswith("wrapper"):
        other = DistributedDataParallel(
            copies["ddp"], bucket_cap_mb=comm_mb, find_unused_parameters=find_unused, gradient_as_bucket_view=as_view
        )
        other.register_comm_hook(*ddp_hook(spec, copies["ddp"]))
    else:
        other = None
    reference = copies["reference"]
    models = [m for m in (ours, other, reference) if m is not None]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(steps):
        if spec not in ("powersgd", "batched"):
            # Compressed runs drift from the reference: compare at the same weights.
            reference.load_state_dict(ours.module.state_dict())
        for micro in range(accumulate):
            seed = step * accumulate + micro
            inputs, targets = batch(seed, world_size)
            for model in (m for m in (ours, other) if m is not None):
                with model.no_sync() if micro < accumulate - 1 else nullcontext():
                    loss(model, shard(inputs, rank), shard(targets, rank), rank, seed).backward()
            reference_loss(reference, seed, world_size).backward()
        label = f"{name} {spec} step {step} rank {rank}"
        if other is not None:
            for (param_name, param), twin in zip(ours.module.named_parameters(), other.module.parameters()):
                assert (param.grad is None) == (twin.grad is None), f"{label}: {param_name}"
                if param.grad is None:
                    continue
                if world_size == 2:
                    assert torch.equal(param.grad, twin.grad), f"{label}: {param_name} differs from the oracle"
                else:
                    # On 3 ranks Gloo's summation order depends on the buffer's length (measured:
                    # 27 values all-reduced alone or padded to 32 differ in the last bit), and
                    # without a hook the buffer also carries the flags: float tolerance.
                    torch.testing.assert_close(param.grad, twin.grad, msg=lambda m: f"{label}: {param_name}: {m}")
        for (param_name, param), ref in zip(ours.module.named_parameters(), reference.parameters()):
            assert (param.grad is None) == (ref.grad is None), f"{label}: {param_name} vs reference"
            if param.grad is None:
                continue
            grad, expected = param.grad.to_dense(), ref.grad.to_dense()
            if spec in ("powersgd", "batched"):
                # Orthogonalisation (QR) and the product P Q^T round at float precision, scaled
                # by the gradient's norm: a relative tolerance on the whole tensor.
                error = (grad - expected).abs().max()
                assert error <= 1e-5 * expected.abs().max() + 1e-7, f"{label}: {param_name} off by {error}"
            elif spec != "allreduce":
                half = spec[:4]
                error = (grad.float() - expected.float()).abs().max()
                bound = HALF_TOLERANCE[half] * expected.float().abs().max()
                assert error <= bound, f"{label}: {param_name} off by {error} > {bound}"
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    buckets = [bucket for bucket in ours.reducer.buckets if hasattr(bucket, "hook")]
    return [bucket.hook[1:] for bucket in buckets], getattr(ours.comm_hook.state, "iter", None)


def hook_cases(rank, cases):
    import lit_dp

    lit_dp.init_parallel_env()
    return [train_with_hook(rank, *case) for case in cases]


# (model, comm MB, last MB, find_unused, gradient_as_bucket_view, accumulate, hook)
TWO_RANK_CASES = [
    ("tied", TINY_MB, TINY_MB, False, False, 1, "allreduce"),
    ("branches", TINY_MB, TINY_MB, True, True, 2, "allreduce"),
    ("branches", TINY_MB, TINY_MB, True, True, 2, "fp16"),
    ("tied", 25, 1, False, True, 2, "bf16"),
    ("branches", TINY_MB, TINY_MB, True, False, 2, "fp16_wrapper"),
    ("mixed", TINY_MB, TINY_MB, False, False, 1, "bf16_wrapper"),
    ("tied", TINY_MB, TINY_MB, False, False, 1, "powersgd"),
    ("branches", TINY_MB, TINY_MB, True, True, 2, "powersgd"),
    ("sparse", TINY_MB, TINY_MB, True, False, 1, "powersgd"),
]


def two_rank_suite(rank, batched_broken):
    """Every 2-rank check in one pair of processes (starting processes dominates on 2 cores).

    ``hook_cases`` comes first: it sets up the process group the others use.
    """
    return {
        "cases": hook_cases(rank, TWO_RANK_CASES),
        "batched": batched_powersgd(rank, batched_broken),
        "digits": digits_with_powersgd(rank, DIGITS_STEPS),
        "contract": hook_contract(rank),
        "strategy": strategy_registers_named_hook(rank),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(two_rank_suite, 2, _batched_powersgd_is_broken(), timeout=300)


def test_torch_hooks_on_two_ranks(two_ranks):
    results = {rank: report["cases"] for rank, report in two_ranks.items()}
    assert results[0] == results[1]
    for case, (buckets, iterations) in zip(TWO_RANK_CASES, results[0]):
        # index() runs 0..n-1 over the dense buckets and is_last() belongs to the last one.
        assert [index for index, _ in buckets] == list(range(len(buckets))), case
        assert all(count == len(buckets) for _, count in buckets), case
        if iterations is not None:
            assert iterations == STEPS, f"{case}: PowerSGD counted {iterations} iterations"


@pytest.mark.slow
def test_torch_hooks_on_three_ranks():
    cases = [TWO_RANK_CASES[i] for i in (0, 7)]
    results = run_ranks(hook_cases, 3, cases, timeout=240)
    assert results[0] == results[1] == results[2]


def _batched_powersgd_is_broken() -> bool:
    """torch 2.14's batched_powerSGD_hook hands a 2-D matrix to ``_orthogonalize``, which asserts 3-D."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    try:
        _orthogonalize(torch.ones(4, 1))
    except AssertionError:
        return True
    return False


def batched_powersgd(rank, broken):
    """Full-rank batched PowerSGD against the reference; where torch's hook is broken, its warm-up
    only, then the same failure from lit_dp (naming the hook) and from torch DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp

    case = ("tied", 25, 25, False, True, 2, "batched")
    if not broken:
        return train_with_hook(rank, *case)
    train_with_hook(rank, *case, steps=START_ITER)
    failures = []
    for wrap in ("lit_dp", "ddp"):
        torch.manual_seed(0)
        model = MODELS["tied"]()
        state, hook = make_hook("batched", model)
        wrapped = lit_dp.DataParallel(model) if wrap == "lit_dp" else DistributedDataParallel(model)
        wrapped.register_comm_hook(state, hook)
        inputs, targets = batch(0, dist.get_world_size())
        try:
            for step in range(START_ITER + 1):
                loss(wrapped, shard(inputs, rank), shard(targets, rank), rank, step).backward()
        except Exception as error:  # noqa: BLE001 - the failure is what is compared
            failures.append((wrap, step, str(error), type(error.__cause__ or error).__name__))
    return failures


def test_batched_powersgd_on_two_ranks(two_ranks):
    if not _batched_powersgd_is_broken():
        return  # the full-rank comparison ran in train_with_hook
    for rank, report in two_ranks.items():
        failures = report["batched"]
        steps = [(wrap, step) for wrap, step, _, _ in failures]
        assert steps == [("lit_dp", START_ITER), ("ddp", START_ITER)], failures
        assert "batched_powerSGD_hook raised on bucket 0" in failures[0][2], failures
        assert failures[0][3] == failures[1][3] == "AssertionError", failures


def returns_a_tensor(state, bucket):
    return bucket.buffer()


def returns_a_short_future(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer()[:1].clone())
    return future


def hook_contract(rank):
    """Misuse errors name the hook; comm_dtype and in-place-sized gradients go through the same path."""
    from unittest import mock

    import lit_dp
    import lit_dp.gradients.dense
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default

    inputs, targets = batch(0, 2)
    report = {}

    def step(model, seed=0):
        loss(model, shard(inputs, rank), shard(targets, rank), rank, seed).backward()

    def tied():
        torch.manual_seed(0)
        return MODELS["tied"]()

    for bad in (returns_a_tensor, returns_a_short_future):
        model = lit_dp.DataParallel(MODELS["tied"]())
        model.register_comm_hook(None, bad)
        with pytest.raises((RuntimeError, ValueError)) as error:
            step(model)
        report[bad.__name__] = str(error.value)

    model = lit_dp.DataParallel(MODELS["tied"]())
    model.register_comm_hook(None, default.allreduce_hook)
    with pytest.raises(RuntimeError) as error:
        model.register_comm_hook(None, default.fp16_compress_hook)
    report["twice"] = str(error.value)
    with pytest.raises(TypeError) as error:
        lit_dp.DataParallel(MODELS["tied"]()).register_comm_hook(None, "fp16")
    report["not_callable"] = str(error.value)
    late = lit_dp.DataParallel(MODELS["tied"]())
    step(late)
    with pytest.raises(RuntimeError) as error:
        late.register_comm_hook(None, default.allreduce_hook)
    report["late"] = str(error.value)

    # Paddle's knob is torch's compress hook: identical gradients.
    knob = lit_dp.DataParallel(tied(), comm_dtype="bf16")
    hooked = lit_dp.DataParallel(tied())
    hooked.register_comm_hook(None, default.bf16_compress_hook)
    for model in (knob, hooked):
        step(model)
    report["comm_dtype"] = all(torch.equal(a.grad, b.grad) for a, b in zip(knob.parameters(), hooked.parameters()))

    # Gradients large enough to be reduced in place go through the hook's buffer instead.
    with mock.patch.dict(lit_dp.gradients.dense.IN_PLACE_MIN_BYTES, cpu=1):
        big = lit_dp.DataParallel(tied())
        plain = lit_dp.DataParallel(tied())
    big.register_comm_hook(None, default.allreduce_hook)
    for model in (big, plain):
        step(model)
    report["in_place_members"] = sum(len(b.in_place) for b in big.reducer.buckets)
    report["buffer_numel"] = sum(b.buffer.numel() for b in big.reducer.buckets)
    report["numel"] = sum(p.numel() for p in big.parameters())
    report["in_place_equal"] = all(torch.equal(a.grad, b.grad) for a, b in zip(big.parameters(), plain.parameters()))
    return report


def test_hook_contract_on_two_ranks(two_ranks):
    for rank, report in ((rank, report["contract"]) for rank, report in two_ranks.items()):
        # torch DDP's words and types: "callback must return a torch.futures.Future object".
        expected = "returns_a_tensor: callback must return a torch.futures.Future object, but got Tensor for bucket 0"
        assert expected in report["returns_a_tensor"]
        assert "returns_a_short_future returned a tensor of shape (1,)" in report["returns_a_short_future"]
        assert "expected shape (155,)" in report["returns_a_short_future"], report
        assert "allreduce_hook is already registered" in report["twice"]
        assert "register_comm_hook or register_builtin_comm_hook can only be called once." in report["twice"]
        assert "Communication hook must be callable." in report["not_callable"]
        assert "must be called before the first synchronised backward" in report["late"]
        assert report["comm_dtype"], f"rank {rank}: comm_dtype='bf16' differs from bf16_compress_hook"
        assert report["in_place_members"] == 0 and report["buffer_numel"] == report["numel"], report
        assert report["in_place_equal"], f"rank {rank}: in-place members through the hook differ"


def strategy_registers_named_hook(rank):
    """PaddleDPStrategy builds PowerSGD's state in the process and registers the hook when wrapping."""
    from lit_dp import PaddleDPStrategy

    strategy = PaddleDPStrategy(comm_hook="powersgd", comm_dtype="fp16", powersgd_rank=2, powersgd_start_iter=2)
    torch.manual_seed(0)
    wrapped = strategy._setup_model(MODELS["tied"]())
    inputs, targets = batch(0, 2)
    for step in range(3):
        loss(wrapped, shard(inputs, rank), shard(targets, rank), rank, step).backward()
    hook = wrapped.comm_hook
    return hook.name.rsplit(".", 1)[-1], hook.state.matrix_approximation_rank, hook.state.iter


def digits_with_powersgd(rank, steps):
    """The digits MLP (recipes' MLPClassifier) on 2 ranks: PowerSGD rank 1 against plain all-reduce."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import lit_dp
    from lit_dp_recipes.digits import DigitsDataModule, MLPClassifier

    data = DigitsDataModule()
    data.setup()
    images, labels = data.train_set.tensors
    val_images, val_labels = data.val_set.tensors
    accuracy = {}
    for mode in ("plain", "powersgd"):
        torch.manual_seed(0)
        model = lit_dp.DataParallel(MLPClassifier().net)
        if mode == "powersgd":
            state = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=10)
            model.register_comm_hook(state, powersgd.powerSGD_hook)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            chosen = torch.randint(len(labels), (2 * 32,), generator=generator)[rank::2]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images[chosen]), labels[chosen]).backward()
            optimizer.step()
        with torch.no_grad():
            accuracy[mode] = (model.module(val_images).argmax(1) == val_labels).float().mean().item()
        if mode == "powersgd":
            accuracy["compression"] = model.comm_hook.state.compression_stats()[0]
    dist.barrier()
    return accuracy


def test_powersgd_rank_1_trains_the_digits_model(two_ranks):
    accuracy = two_ranks[0]["digits"]
    assert accuracy == two_ranks[1]["digits"], "ranks disagree: weights diverged"
    assert accuracy["compression"] > 10, accuracy  # rank 1 really compressed the 128x128 weights
    # Plain all-reduce reaches about 0.96 here; rank-1 PowerSGD with error feedback must stay close.
    assert accuracy["powersgd"] >= 0.9 and accuracy["powersgd"] >= accuracy["plain"] - 0.04, accuracy


# --- Lightning and Hydra: no processes, except one fit -------------------------------------------


def _described(strategy) -> str:
    import lightning.pytorch as pl

    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # sets the devices describe() reads
    return strategy.describe()


def test_a_ddp_strategy_configuration_moves_by_renaming_the_class():
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    from lit_dp import PaddleDPStrategy

    options = dict(
        ddp_comm_state=powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=5),
        ddp_comm_hook=powersgd.powerSGD_hook,
        ddp_comm_wrapper=default.fp16_compress_wrapper,
    )
    DDPStrategy(**options)
    assert "comm_hook=fp16_compress_wrapper(powerSGD_hook)" in _described(PaddleDPStrategy(**options))
    assert "comm_hook=none" in _described(PaddleDPStrategy()).split()
    assert "comm_hook=bf16_compress_hook" in _described(PaddleDPStrategy(comm_dtype="bf16")).split()


def test_recipes_select_hooks_by_name(tmp_path):
    from hydra.utils import instantiate

    overrides = ["strategy.comm_hook=powersgd", "strategy.powersgd.rank=4", "strategy.powersgd.start_iter=10"]
    strategy = instantiate(compose_config("digits", overrides, tmp_path).strategy)
    assert "comm_hook=powerSGD_hook(rank=4,start_iter=10)" in _described(strategy).split()
    overrides = ["strategy.comm_hook=powersgd", "strategy.comm_dtype=fp16"]
    strategy = instantiate(compose_config("digits", overrides, tmp_path).strategy)
    assert "comm_hook=fp16_compress_wrapper(powerSGD_hook(rank=1,start_iter=1000))" in _described(strategy).split()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(comm_hook=42), r"comm_hook=42 is invalid: expected one of fp16, bf16, powersgd, or a callable"),
        (dict(comm_wrapper=returns_a_tensor), r"comm_wrapper=tests.gradients.test_hooks.returns_a_tensor is invalid"),
        (dict(comm_hook="fp16", comm_state=object()), r"comm_state=<object .*> is invalid with comm_hook='fp16'"),
        (dict(comm_hook=returns_a_tensor, ddp_comm_hook=returns_a_tensor), r"comm_hook=.* and ddp_comm_hook=.* are the same option"),
        (
            dict(comm_hook=returns_a_tensor, comm_wrapper=returns_a_tensor, comm_dtype="fp16"),
            r"comm_dtype='fp16' is invalid with comm_wrapper=",
        ),
    ],
)
def test_strategy_hook_options_are_validated(options, message):
    from lit_dp import PaddleDPStrategy

    with pytest.raises(ValueError, match=message):
        PaddleDPStrategy(**options)


def test_strategy_registers_a_named_hook(two_ranks):
    for report in two_ranks.values():
        # comm_dtype around a named hook is torch's compress wrapper; 3 synchronised steps counted.
        assert report["strategy"] == ("fp16_compress_wrapper_hook", 2, 3)


def test_powersgd_memory_must_start_after_autotune_has_settled_the_buckets():
    """``comm_buffer_size="auto"`` rebuilds the buckets during tuning; PowerSGD's per-bucket
    error feedback, created at its first compressed step, would then meet a bucket of another size."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    from lit_dp import DataParallel, ParallelEnv, init_parallel_env
    from lit_dp.observability.autotune import settled_step

    init_parallel_env(parallel_env=ParallelEnv({}), backend="gloo", one_process_group=True)
    early = powersgd.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    wrapped = DataParallel(MODELS["tied"](), comm_buffer_size="auto")
    with pytest.raises(ValueError, match=rf"start_powerSGD_iter=2 .*expected start_powerSGD_iter >= {settled_step()}"):
        wrapped.register_comm_hook(early, powersgd.powerSGD_hook)
    late = powersgd.PowerSGDState(process_group=None, start_powerSGD_iter=settled_step())
    DataParallel(MODELS["tied"](), comm_buffer_size="auto").register_comm_hook(late, powersgd.powerSGD_hook)
    # Without error feedback or warm start PowerSGD keeps nothing per bucket: any start is fine.
    stateless = powersgd.PowerSGDState(None, start_powerSGD_iter=2, use_error_feedback=False, warm_start=False)
    DataParallel(MODELS["tied"](), comm_buffer_size="auto").register_comm_hook(stateless, powersgd.powerSGD_hook)
    DataParallel(MODELS["tied"](), comm_buffer_size=5).register_comm_hook(early, powersgd.powerSGD_hook)
