"""``local_sgd.*``: periodic model averaging after a data-parallel warm-up (``lit_dp.LocalSGD``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from lit_dp.options.declare import FABRIC, MODULE, STRATEGIES, TRAINER, choice, count, flag, option
from lit_dp.options.rules import excludes, requires, shown

# Both strategies drive the averager after each optimizer step; a loop of your own builds it.
IN_A_LOOP = {MODULE: "build lit_dp.LocalSGD(model, local_steps, ...) and call its step() after each optimizer step"}
OUTERS = ("average", "nesterov")
# The formats the averaged deltas may travel in (``local_sgd.sync_dtype``, ``lit_dp.local_sgd.wire``), by
# name; fp8 (float8_e4m3fn) where the torch build has the type.
SYNC_DTYPES = ("bf16", "int8", "int4", "fp8")
# The backends lit_dp runs a wire format's all-to-all and all-gather on.
WIRE_BACKENDS = ("gloo", "nccl")
# Error feedback is on by default at this many bits a value and below (SparseLoCo and MuLoCo found it
# necessary below 8 bits; at bf16 it is a choice).
ERROR_FEEDBACK_BITS = 8


def default_error_feedback(bits: int) -> bool:
    """``local_sgd.error_feedback=None``: on for a format of ``bits`` bits a value at ``ERROR_FEEDBACK_BITS`` or below."""
    return bits <= ERROR_FEEDBACK_BITS


def check_sync_dtype(name: str, value: Any) -> str | None:
    """One of ``SYNC_DTYPES`` that this torch build can encode, or None."""
    value = choice(*SYNC_DTYPES, optional=True)(name, value)
    if value == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        others = ", ".join(d for d in SYNC_DTYPES if d != "fp8")
        raise ValueError(
            f"{name}='fp8' is invalid with this torch build ({torch.__version__}), which has no float8_e4m3fn: "
            f"expected one of {others}."
        )
    return value


check_sync_dtype.examples = SYNC_DTYPES  # type: ignore[attr-defined]


def check_error_feedback(name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: expected True, False or None (on for 8 bits and below).")
    return value


check_error_feedback.examples = (True, False)  # type: ignore[attr-defined]
# DiLoCo's outer SGD, chosen by measurement on the GPT recipe (docs/local_sgd.md, "Choosing the
# outer settings"): the setting tried that beat averaging at both K=16 and K=64; not the paper's
# lr 0.7 / momentum 0.9, which trained worse than averaging at K=16.
DEFAULT_OUTER_LR = 0.8
DEFAULT_OUTER_MOMENTUM = 0.5
# Synchronised steps comm_buffer_size="auto" needs before its choice is final: the tuning schedule's
# length, lit_dp.observability.autotune.settled_step() (a test keeps them equal; options import no observer).
AUTOTUNE_STEPS = 121


def check_outer_lr(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r} is invalid: expected a positive number.")
    return float(value)


def check_outer_momentum(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name}={value!r} is invalid: expected a number in [0, 1).")
    return float(value)


def check_mixing(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(
            f"{name}={value!r} is invalid: expected a number in [0, 1), the weight kept of the local parameters "
            "(0: they become the synced ones)."
        )
    return float(value)


# Hooks (by function or config name) that leave gradients local, which LocalSGD does itself.
COMM_HOOKS_SKIPPING_COMMUNICATION = ("post_localSGD_hook", "noop_hook")


@dataclasses.dataclass(frozen=True)
class LocalSGDOptions:
    """LocalSGD's period, warm-up and outer optimizer (off while ``steps`` is None); both strategies run it."""

    steps: Optional[int] = option(
        default=None,
        help="average the models every K local steps; None: off",
        check=count(1, optional=True),
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=Optional[int],
        lightning="model_averaging_period",
    )
    warmup_steps: int = option(
        default=0,
        help="ordinary data-parallel steps before the local phase",
        check=count(0),
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=int,
    )
    adaptive: bool = option(
        default=False,
        help="recompute K from loss and learning rate (Paddle's adaptive_localsgd)",
        check=flag,
        scope=frozenset({TRAINER}),
        instead={
            **IN_A_LOOP,
            # Fabric's optimizer.step() hands the strategy no loss, which the adaptive period needs.
            FABRIC: "the adaptive period needs each step's loss, which Fabric's optimizer.step() does not pass on; "
            "build lit_dp.LocalSGD(model._forward_module, local_steps, adaptive=True) over the lit_dp.DataParallel "
            "that fabric.setup wrapped, and call its step(loss, lr) after optimizer.step() (docs/local_sgd.md)",
        },
        config=bool,
    )
    outer: str = option(
        default="average",
        help="average: the mean of the models; nesterov: DiLoCo's outer SGD on the mean change since the last sync",
        check=choice(*OUTERS),
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=str,
    )
    outer_lr: float = option(
        default=DEFAULT_OUTER_LR,
        help="outer=nesterov: the outer learning rate (chosen by a sweep, docs/local_sgd.md)",
        check=check_outer_lr,
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=float,
        examples=(0.7,),
    )
    outer_momentum: float = option(
        default=DEFAULT_OUTER_MOMENTUM,
        help="outer=nesterov: the outer Nesterov momentum (chosen by a sweep, docs/local_sgd.md)",
        check=check_outer_momentum,
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=float,
        examples=(0.9,),
    )
    sync_dtype: Optional[str] = option(
        default=None,
        help="send the averaged change in bf16, int8, int4 or fp8 (fp32 scale per 128 values), summed in fp32; "
        "None: in the parameters' dtype",
        check=check_sync_dtype,
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=Optional[str],
    )
    error_feedback: Optional[bool] = option(
        default=None,
        help="add what sync_dtype dropped on a rank to its next sync; None: on for int8, int4 and fp8, off for bf16",
        check=check_error_feedback,
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=Optional[bool],
    )
    fragments: int = option(
        default=1,
        help="streaming DiLoCo: sync the model in F fragments, one every K/F steps (K a multiple of F); 1: all at once",
        check=count(1),
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=int,
        examples=(2,),
    )
    sync_delay: int = option(
        default=0,
        help="tau: apply each sync this many inner steps after it starts, its all-reduce overlapping them (below K/F)",
        check=count(0),
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=int,
        examples=(1,),
    )
    mixing: float = option(
        default=0.0,
        help="alpha: the weight kept of the local parameters when a sync is applied; 0: replaced by the synced ones",
        check=check_mixing,
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=float,
        examples=(0.5,),
    )
    offload: bool = option(
        default=True,
        help="keep the snapshot and outer momentum of CUDA parameters in pinned CPU memory; false: on the GPU",
        check=flag,
        scope=STRATEGIES,
        instead=IN_A_LOOP,
        config=bool,
    )


def _fragments_do_not_divide(options: Any) -> bool:
    steps, fragments = options.local_sgd.steps, options.local_sgd.fragments
    return steps is not None and fragments > 1 and steps % fragments != 0


RULES = (
    requires("local_sgd.adaptive", "local_sgd.steps", "expected the initial period, e.g. 1"),
    requires(
        "local_sgd.warmup_steps", "local_sgd.steps", "expected the period that follows the warm-up, e.g. 4", set_only=True
    ),
    excludes(
        "local_sgd.steps",
        "comm_hook",
        when=lambda o: o.local_sgd.steps is not None and shown(o.comm_hook).strip("'") in COMM_HOOKS_SKIPPING_COMMUNICATION,
        reason="that hook already skips gradient communication, so warm-up steps would not be data-parallel; "
        "expected LocalSGD or that hook, not both",
    ),
    *(
        requires(f"local_sgd.{name}", "local_sgd.steps", "expected the period K, e.g. 16", set_only=True)
        for name in (
            "outer", "outer_lr", "outer_momentum", "sync_dtype", "error_feedback", "fragments", "offload", "sync_delay",
            "mixing",
        )
    ),
    requires(
        "local_sgd.error_feedback",
        "local_sgd.sync_dtype",
        "a sync in the parameters' dtype drops nothing to feed back; expected {local_sgd.sync_dtype}=bf16, int8, int4 "
        "or fp8, or {local_sgd.error_feedback}=None",
    ),
    excludes(
        "local_sgd.fragments",
        "local_sgd.steps",
        when=_fragments_do_not_divide,
        reason="fragment f syncs at the steps W + (f+1)*K/F + n*K, so K must be a multiple of F (and F <= K); "
        "expected {local_sgd.steps} a multiple of {local_sgd.fragments}, e.g. 16 with 4",
    ),
    excludes(
        "local_sgd.fragments",
        "local_sgd.adaptive",
        when=lambda o: o.local_sgd.fragments > 1 and o.local_sgd.adaptive,
        reason="the fragments' offsets are fixed fractions of K, which the adaptive rule changes at every sync; "
        "expected {local_sgd.fragments}=1 or {local_sgd.adaptive}=False",
    ),
    excludes(
        "local_sgd.sync_delay",
        "local_sgd.steps",
        "local_sgd.fragments",
        when=lambda o: o.local_sgd.steps is not None and o.local_sgd.sync_delay >= o.local_sgd.steps // o.local_sgd.fragments,
        reason="a sync is applied sync_delay steps after it starts, before the next fragment's starts K/F steps after "
        "it; expected {local_sgd.sync_delay} below {local_sgd.steps} / {local_sgd.fragments}",
    ),
    excludes(
        "local_sgd.sync_delay",
        "local_sgd.adaptive",
        when=lambda o: o.local_sgd.sync_delay > 0 and o.local_sgd.adaptive,
        reason="the adaptive rule changes K at every sync, which must stay above the delay; expected "
        "{local_sgd.sync_delay}=0 or {local_sgd.adaptive}=False",
    ),
    excludes(
        "comm_buffer_size",
        "local_sgd.steps",
        "local_sgd.warmup_steps",
        when=lambda o: o.comm_buffer_size == "auto" and o.local_sgd.steps is not None and o.local_sgd.warmup_steps < AUTOTUNE_STEPS,
        reason=f"the bucket size is tuned by timing {AUTOTUNE_STEPS} data-parallel steps, and LocalSGD's local phase "
        "all-reduces no gradients; expected a fixed {comm_buffer_size} (e.g. 25), or {local_sgd.warmup_steps} >= "
        f"{AUTOTUNE_STEPS}",
    ),
)
