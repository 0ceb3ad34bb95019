"""The named hook ``powersgd``: torch's ``powerSGD_hook``, its state built in each process.

Its options are ``powersgd.rank`` and ``powersgd.start_iter``; left unset, they are torch's
``PowerSGDState`` defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lit_dp.options.comm_hooks import Hook, NamedHook, register_named_hook
from lit_dp.options.core import AUTO, AUTO_SETTLED_STEP
from lit_dp.options.declare import EVERYWHERE, count, option
from lit_dp.options.rules import excludes

# torch's PowerSGDState defaults, used when the options are left unset.
DEFAULT_RANK = 1
DEFAULT_START_ITER = 1000


@dataclasses.dataclass(frozen=True)
class PowerSGDOptions:
    """PowerSGD's approximation rank and first compressed iteration."""

    rank: Optional[int] = option(
        default=None,
        help=f"matrix approximation rank, >= 1; None: {DEFAULT_RANK} (torch's)",
        check=count(1, optional=True),
        scope=EVERYWHERE,
        config=Optional[int],
    )
    start_iter: Optional[int] = option(
        default=None,
        help=f"first compressed iteration, >= 2; None: {DEFAULT_START_ITER} (torch's; lower it for short runs)",
        check=count(2, optional=True),
        scope=EVERYWHERE,
        config=Optional[int],
    )


def _build(options: PowerSGDOptions) -> tuple[powerSGD_hook.PowerSGDState, Hook]:
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=options.rank or DEFAULT_RANK,
        start_powerSGD_iter=options.start_iter or DEFAULT_START_ITER,
    )
    return state, powerSGD_hook.powerSGD_hook


def _describe(options: PowerSGDOptions) -> str:
    rank = options.rank or DEFAULT_RANK
    return f"powerSGD_hook(rank={rank},start_iter={options.start_iter or DEFAULT_START_ITER})"


def _bucket_memory(state: object, step: int) -> str | None:
    """Error feedback and warm start are tensors per ``index()``, created at the first compressed
    step: a later bucket layout would hand them a bucket of another size."""
    if not isinstance(state, powerSGD_hook.PowerSGDState):
        return None
    keeps_memory = state.use_error_feedback or state.warm_start
    if not keeps_memory or state.start_powerSGD_iter >= step:
        return None
    return (
        f"with start_powerSGD_iter={state.start_powerSGD_iter} keeps per-bucket memory from its first compressed "
        f"step: expected start_powerSGD_iter >= {step} (option powersgd.start_iter with comm_hook='powersgd')"
    )


def _compresses_while_auto_tunes(options: object) -> bool:
    start = options.hooks["powersgd"].start_iter or DEFAULT_START_ITER  # type: ignore[attr-defined]
    return options.comm_hook == "powersgd" and options.comm_buffer_size == AUTO and start < AUTO_SETTLED_STEP  # type: ignore[attr-defined]


# What `_bucket_memory` finds in each rank once the hook is registered, found from the options alone
# where the job starts: a powersgd chosen by name never gets that far.
RULES = (
    excludes(
        "comm_buffer_size",
        "comm_hook",
        "powersgd.start_iter",
        when=_compresses_while_auto_tunes,
        reason=f"'auto' rebuilds the buckets until synchronised step {AUTO_SETTLED_STEP}, and "
        "PowerSGD keeps memory per bucket (error feedback, warm start) from its first compressed step, which a later "
        f"layout would hand a bucket of another size; expected {{powersgd.start_iter}} >= {AUTO_SETTLED_STEP}, or a "
        "fixed {comm_buffer_size}",
    ),
)

POWERSGD = register_named_hook(
    NamedHook(
        name="powersgd",
        help="torch's powerSGD_hook: low-rank gradient compression with error feedback",
        build=_build,
        describe=_describe,
        options=PowerSGDOptions,
        bucket_memory=_bucket_memory,
        rules=RULES,
    )
)
