"""The registry of named communication hooks: lit_dp's own, what a registration is refused for,
and a new hook, from its own module, trained with by name (real gloo processes)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from lit_dp.options import TRAINER, NamedHook, Options, register_named_hook
from lit_dp.options import comm_hooks
from lit_dp.options.comm_hooks import named_hooks
from tests.helpers.distributed import run_ranks
from tests.helpers.models import MODELS, batch, loss, shard

STEPS = 3
ELEMENTS = {"keyword": 7, "group": 11, "hydra": 5}


def test_lit_dp_registers_its_own_named_hooks():
    hooks = {hook.name: hook for hook in named_hooks()}
    assert list(hooks)[:3] == ["fp16", "bf16", "powersgd"]
    assert [name for name, hook in hooks.items() if hook.compress_wrapper is not None] == ["fp16", "bf16"]
    options = Options.build({"comm_hook": "PowerSGD", "powersgd_rank": 2}, "module")
    assert options.comm_hook == "powersgd" and options.hook_options("powersgd").rank == 2


@dataclasses.dataclass(frozen=True)
class Undeclared:
    size: int = 1


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (NamedHook("Bad-Name", "", lambda o: (None, None), str), "named hook 'Bad-Name' is invalid: expected a lower-case identifier"),
        (NamedHook("fp16", "", lambda o: (None, None), str), "named hook 'fp16' is already registered"),
        (NamedHook("mine", "", lambda o: (None, None), str, options=Undeclared), "expected a frozen dataclass whose fields"),
    ],
)
def test_a_registration_is_refused_before_it_takes_effect(hook, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        register_named_hook(hook)
    assert hook.name not in [registered.name for registered in named_hooks() if registered is hook]


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for one test: the runner's generated docs list lit_dp's hooks only."""
    monkeypatch.setattr(comm_hooks, "_REGISTRY", dict(comm_hooks._REGISTRY))


def _declared(name: str, **properties) -> NamedHook:
    return register_named_hook(NamedHook(name, "a test's hook", lambda o: (None, None), lambda o: name, **properties))


def test_fault_tolerance_accepts_a_named_hook_by_what_it_declares(registry):
    _declared("quiet", stateless=True)
    _declared("chatty")
    accepted = Options.build({"fault_tolerance": "torchft", "comm_hook": "quiet"}, TRAINER)
    assert accepted.comm_hook == "quiet"
    with pytest.raises(ValueError, match=r"comm_hook='chatty' with fault_tolerance='torchft' is not supported: .*"
                       r"expected 'fp16' or 'bf16' or 'quiet' or None"):
        Options.build({"fault_tolerance": "torchft", "comm_hook": "chatty"}, TRAINER)
    with pytest.raises(ValueError, match="comm_hook='powersgd' with fault_tolerance='torchft' is not supported"):
        Options.build({"fault_tolerance": "torchft", "comm_hook": "powersgd"}, TRAINER)


class _PerBucket:
    """A hook state with memory per bucket from ``start``."""

    def __init__(self, start: int) -> None:
        self.start = start


def test_a_hook_declaring_per_bucket_memory_needs_the_buckets_settled_first(registry):
    from lit_dp import DataParallel, ParallelEnv, init_parallel_env
    from lit_dp.observability.autotune import settled_step

    def early(state, step):
        if isinstance(state, _PerBucket) and state.start < step:
            return f"keeps memory from step {state.start}: expected a start >= {step}"
        return None

    _declared("per_bucket", bucket_memory=early)
    init_parallel_env(parallel_env=ParallelEnv({}), backend="gloo", one_process_group=True)
    hook = lambda state, bucket: None  # noqa: E731 - never called: registration is refused first
    with pytest.raises(ValueError, match=rf"keeps memory from step 2: expected a start >= {settled_step()}, or a fixed"):
        DataParallel(MODELS["tied"](), comm_buffer_size="auto").register_comm_hook(_PerBucket(2), hook)
    DataParallel(MODELS["tied"](), comm_buffer_size="auto").register_comm_hook(_PerBucket(settled_step()), hook)
    DataParallel(MODELS["tied"](), comm_buffer_size=5).register_comm_hook(_PerBucket(2), hook)


def train_with_a_new_named_hook(rank, output_dir):
    """In its own process: register ``chunked_allreduce`` by importing its module, then train
    by that name through DataParallel's keywords, its group, and the recipes' Hydra schema."""
    import lit_dp
    import tests.helpers.chunked_allreduce  # noqa: F401 - the one registration
    from lit_dp.options import TRAINER
    from lit_dp.options.docs import options_markdown
    from hydra.errors import ConfigCompositionException

    from lit_dp_recipes.config import build_strategy, paddle_dp_schema
    from tests.helpers.recipes import compose_config

    lit_dp.init_parallel_env()
    overrides = ["strategy.comm_hook=chunked_allreduce", f"strategy.chunked_allreduce.elements={ELEMENTS['hydra']}"]
    strategy = build_strategy(compose_config("digits", overrides, output_dir).strategy)
    try:  # the schema types the hook's option: a wrong type fails when Hydra composes
        compose_config("digits", ["strategy.chunked_allreduce.elements=many"], output_dir)
        typed = False
    except ConfigCompositionException:
        typed = True
    torch.manual_seed(0)
    models = {"plain": MODELS["tied"]()}
    for way in ELEMENTS:
        models[way] = MODELS["tied"]()
        models[way].load_state_dict(models["plain"].state_dict())
    wrapped = {
        "plain": lit_dp.DataParallel(models["plain"]),
        "keyword": lit_dp.DataParallel(
            models["keyword"], comm_hook="chunked_allreduce", chunked_allreduce_elements=ELEMENTS["keyword"]
        ),
        "group": lit_dp.DataParallel(
            models["group"], comm_hook="chunked_allreduce", chunked_allreduce={"elements": ELEMENTS["group"]}
        ),
        "hydra": strategy._setup_model(models["hydra"]),
    }
    optimizers = {way: torch.optim.SGD(model.parameters(), lr=0.1) for way, model in wrapped.items()}
    inputs, targets = batch(0, 2)
    equal = True
    for step in range(STEPS):
        for way, model in wrapped.items():
            loss(model, shard(inputs, rank), shard(targets, rank), rank, step).backward()
        for way in ELEMENTS:
            # allreduce_hook on 2 ranks sums and divides each element as lit_dp's own all-reduce does.
            equal &= all(
                torch.equal(ours.grad, plain.grad)
                for ours, plain in zip(wrapped[way].parameters(), wrapped["plain"].parameters())
            )
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {
        "equal": equal,
        "pieces": {way: wrapped[way].comm_hook.state.pieces for way in ELEMENTS},
        "numel": sum(p.numel() for p in models["plain"].parameters()),
        "schema": (vars(vars(paddle_dp_schema()())["chunked_allreduce"]), typed),
        "described": strategy.options.describe(TRAINER),
        "documented": "| `chunked_allreduce.elements` | `chunked_allreduce_elements` | `1024` |" in options_markdown(),
    }


def test_a_new_named_hook_is_one_module(tmp_path):
    reports = run_ranks(train_with_a_new_named_hook, 2, str(tmp_path), timeout=240)
    for rank, report in reports.items():
        assert report["equal"], f"rank {rank}: chunked all-reduce differs from lit_dp's own"
        for way, elements in ELEMENTS.items():
            pieces = report["pieces"][way]
            # Each option reached its hook: no piece above it, every gradient element sent once per step.
            assert max(pieces) <= elements and sum(pieces) == STEPS * report["numel"], (way, pieces)
            assert len(pieces) >= STEPS * report["numel"] // elements, (way, pieces)
        node, typed = report["schema"]
        assert node == {"elements": 1024} and typed, report["schema"]
        assert f"comm_hook=chunked_allreduce_hook(elements={ELEMENTS['hydra']})" in report["described"].split()
        assert report["documented"]
    assert "chunked_allreduce" not in [hook.name for hook in named_hooks()], "registered in the test runner"
