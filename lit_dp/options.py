"""Every lit_dp option, declared once: name, type, default, Lightning's name for it, check, help.

The Trainer strategy, the Fabric strategy and ``DataParallel`` take their options as keyword
arguments and hand them to ``Options.build``, which validates each one once, where it enters,
and returns a frozen ``Options`` that the layers below read without checking again. The
recipes' Hydra structured config is generated from the same fields
(``lit_dp_recipes.config``). Adding an option means one field here plus the code that uses it.

Each field's metadata says:

- ``help``: one line, shown in errors and in the generated docs;
- ``check(name, value)``: returns the value to keep (``5`` becomes ``5.0`` for a size) or
  raises ``ValueError`` naming the option as the user wrote it, the value and what is expected;
- ``scope``: which front doors take it (``trainer``, ``fabric``, ``module`` for
  ``DataParallel``, ``ddp`` for the recipes' torch-DDP config that shares our names);
- ``config``: its type in Hydra's structured config, or None for Python objects (a hook
  callable, its state) that a command line cannot express;
- ``lightning``: Lightning ``DDPStrategy``'s name for the same option, accepted as an alias so
  that a ``DDPStrategy(...)`` call moves over by renaming the class.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, List, Optional

from lit_dp.fault_tolerance import ENGINES as FAULT_TOLERANCE_ENGINES
from lit_dp.fault_tolerance import check_options as check_fault_tolerance_options
from lit_dp.gradients.buckets import DEFAULT_BUCKET_MB, megabytes_to_bytes
from lit_dp.gradients.hooks import HOOK_NAMES, check_comm_hook_options
from lit_dp.job.backends import check_backend
from lit_dp.job.env import MAX_NRINGS
from lit_dp.job.process_group import parse_timeout
from lit_dp.observability.autotune import AUTO
from lit_dp.observability.stats import check_trace_steps
from lit_dp.observability.watchdog import DEFAULT_HANG_TIMEOUT

TRAINER, FABRIC, MODULE, DDP = "trainer", "fabric", "module", "ddp"
STRATEGIES = frozenset({TRAINER, FABRIC})
EVERYWHERE = frozenset({TRAINER, FABRIC, MODULE})
START_METHODS = ("popen", "spawn", "fork", "forkserver")
# Hooks (by function or config name) that leave gradients local, which LocalSGD does itself.
COMM_HOOKS_SKIPPING_COMMUNICATION = ("post_localSGD_hook", "noop_hook")


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: expected True or False.")
    return value


def _megabytes(name: str, value: Any) -> float:
    megabytes_to_bytes(name, value)
    return float(value)


def _buffer_size(name: str, value: Any) -> float | str:
    if value == AUTO:
        return AUTO
    if isinstance(value, str):
        raise ValueError(f"{name}={value!r} is invalid: expected a positive number of megabytes or 'auto'.")
    try:
        return _megabytes(name, value)
    except ValueError as error:
        raise ValueError(f"{error.args[0].rstrip('.')} or 'auto'.") from None


def _count(low: int, high: int | None = None, optional: bool = False) -> Callable[[str, Any], int | None]:
    expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    expected += " (or None)" if optional else ""

    def check(name: str, value: Any) -> int | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            raise ValueError(f"{name}={value!r} is invalid: expected {expected}.")
        return value

    return check


def _seconds(optional: bool) -> Callable[[str, Any], float | timedelta | None]:
    def check(name: str, value: Any) -> float | timedelta | None:
        if value is None and optional:
            return None
        parse_timeout(name, value)
        return value

    return check


def _optional_seconds(name: str, value: Any) -> float | None:
    if value is None:
        return None
    return parse_timeout(name, value).total_seconds()


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in allowed:
            raise ValueError(f"{name}={value!r} is invalid: expected one of {', '.join(allowed)}.")
        return value.lower()

    return check


def _optional_choice(*allowed: str) -> Callable[[str, Any], str | None]:
    choose = _choice(*allowed)
    return lambda name, value: None if value is None else choose(name, value)


def _directory(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name}={value!r} is invalid: expected a directory path or None.")
    return None if value is None else os.fspath(value)


def _comm_hook(name: str, value: Any) -> Any:
    if value is None or callable(value) or (isinstance(value, str) and value.lower() in HOOK_NAMES):
        return value
    raise ValueError(
        f"{name}={value!r} is invalid: expected one of {', '.join(HOOK_NAMES)}, or a callable hook(state, bucket)."
    )


def _anything(name: str, value: Any) -> Any:
    return value


def _sharding_stage(name: str, value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value in (0, 1, 2)):
        return value or None  # 0 is "off", as None
    raise ValueError(f"{name}={value!r} is invalid: expected 1 (optimizer states), 2 (also gradients), 0 or None (off).")


def _optional_text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise ValueError(f"{name}={value!r} is invalid: expected a non-empty string or None.")
    return str(value)


def _positive_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is invalid: expected a positive number of seconds.")
    return float(value)


def option(
    default: Any,
    help: str,
    check: Callable[[str, Any], Any],
    *,
    scope: frozenset[str] = STRATEGIES,
    config: Any = None,
    lightning: str | None = None,
) -> Any:
    """A field of ``Options`` (see the module docstring for the metadata)."""
    metadata = {"help": help, "check": check, "scope": scope, "config": config, "lightning": lightning}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Options:
    """lit_dp's options, validated (build with ``Options.build``)."""

    comm_buffer_size: float | str = option(
        DEFAULT_BUCKET_MB, "bucket size limit in MB (Paddle's 25), or auto: candidate sizes timed in the first steps",
        _buffer_size, scope=EVERYWHERE | {DDP}, config=Any, lightning="bucket_cap_mb",
    )  # fmt: skip
    last_comm_buffer_size: float = option(
        1.0, "size limit in MB of the last bucket reduced in backward (the first layers')",
        _megabytes, scope=EVERYWHERE | {DDP}, config=float,
    )  # fmt: skip
    find_unused_parameters: bool = option(
        False, "tolerate parameters that get no gradient in an iteration (a graph walk per forward)",
        _flag, scope=EVERYWHERE | {DDP}, config=bool,
    )  # fmt: skip
    gradient_as_bucket_view: bool = option(
        False, ".grad tensors are views into the bucket buffers, stored once",
        _flag, scope=EVERYWHERE | {DDP}, config=bool,
    )  # fmt: skip
    comm_dtype: Optional[str] = option(
        None, "fp16 or bf16: all-reduce gradients in half precision (wraps comm_hook if set)",
        _optional_choice("fp16", "bf16"), scope=EVERYWHERE, config=Optional[str],
    )  # fmt: skip
    comm_stats: bool = option(
        False, "measure each step's communication: comm/bytes, buckets, time_ms, exposed_ms, overlap",
        _flag, scope=EVERYWHERE, config=bool,
    )  # fmt: skip
    trace_dir: Optional[str] = option(
        None, "write a Chrome trace of the communication there, rank{R}.json per rank",
        _directory, scope=EVERYWHERE, config=Optional[str],
    )  # fmt: skip
    trace_steps: tuple[int, int] = option(
        (1, 4), "the synchronised steps traced: start <= step < stop",
        lambda name, value: check_trace_steps(name, value), scope=EVERYWHERE, config=List[int],
    )  # fmt: skip
    backend: str = option(
        "auto", "auto (NCCL for CUDA devices, else Gloo) or any backend torch.distributed has, e.g. cpu:gloo,cuda:nccl",
        check_backend, scope=STRATEGIES | {DDP}, config=str, lightning="process_group_backend",
    )  # fmt: skip
    nrings: Optional[int] = option(
        None, f"communicators to spread buckets over, 1..{MAX_NRINGS}; None: FLAGS_nccl_nrings or 1",
        _count(1, MAX_NRINGS, optional=True), config=Optional[int],
    )  # fmt: skip
    timeout: Optional[float] = option(
        None, "seconds (or a timedelta) for the rendezvous and every collective; None: PADDLE_PG_TIMEOUT or 1800",
        _seconds(optional=True), scope=STRATEGIES | {DDP}, config=Optional[float],
    )  # fmt: skip
    start_method: str = option(
        "popen", "popen (re-run the script per rank), spawn, fork or forkserver",
        _choice(*START_METHODS), scope=STRATEGIES | {DDP}, config=str,
    )  # fmt: skip
    comm_hook: Any = option(
        None, "fp16, bf16, powersgd (torch's hook of that name) or a callable hook(state, bucket)",
        _comm_hook, scope=EVERYWHERE, config=Optional[str], lightning="ddp_comm_hook",
    )  # fmt: skip
    comm_state: Any = option(
        None, "the state handed to a callable comm_hook", _anything, scope=EVERYWHERE, lightning="ddp_comm_state"
    )
    comm_wrapper: Any = option(
        None, "wraps comm_hook, e.g. torch's fp16_compress_wrapper", _anything, scope=EVERYWHERE,
        lightning="ddp_comm_wrapper",
    )  # fmt: skip
    powersgd_rank: Optional[int] = option(
        None, "comm_hook=powersgd: matrix approximation rank; None: 1",
        _count(1, optional=True), scope=EVERYWHERE, config=Optional[int],
    )  # fmt: skip
    powersgd_start_iter: Optional[int] = option(
        None, "comm_hook=powersgd: first compressed iteration, >= 2; None: 1000",
        _count(2, optional=True), scope=EVERYWHERE, config=Optional[int],
    )  # fmt: skip
    hang_timeout: Optional[float] = option(
        DEFAULT_HANG_TIMEOUT, "seconds a lit_dp collective may wait before the job ends naming the stuck rank, with "
        "every rank's stack in <log dir>/lit_dp_hang (default 300, at most half of timeout); None: off",
        _optional_seconds, scope=EVERYWHERE, config=Optional[float],
    )  # fmt: skip
    uneven_inputs: bool = option(
        False, "ranks may have different numbers of batches: a rank that runs out takes the others' remaining "
        "steps without data, so every epoch ends together on every rank",
        _flag, scope=frozenset({TRAINER}), config=bool,
    )  # fmt: skip
    local_sgd_steps: Optional[int] = option(
        None, "LocalSGD: average the models every K local steps; None: off",
        _count(1, optional=True), scope=frozenset({TRAINER}), config=Optional[int], lightning="model_averaging_period",
    )  # fmt: skip
    local_sgd_warmup_steps: int = option(
        0, "LocalSGD: ordinary data-parallel steps before the local phase",
        _count(0), scope=frozenset({TRAINER}), config=int,
    )  # fmt: skip
    local_sgd_adaptive: bool = option(
        False, "LocalSGD: recompute K from loss and learning rate (Paddle's adaptive_localsgd)",
        _flag, scope=frozenset({TRAINER}), config=bool,
    )  # fmt: skip
    sharding_stage: Optional[int] = option(
        None, "1: each rank keeps the optimizer state of its own parameters; 2: also only their gradients; None: off",
        _sharding_stage, scope=EVERYWHERE, config=Optional[int],
    )  # fmt: skip
    sharding_overlap: bool = option(
        False, "sharding: gather updated parameters during the next forward (each module waits for its own)",
        _flag, scope=EVERYWHERE, config=bool,
    )  # fmt: skip
    # Fault tolerance (lit_dp.fault_tolerance, lit_dp.strategies.fault_tolerance; docs/fault_tolerance.md).
    fault_tolerance: Optional[str] = option(
        None, "torchft: train on while replica groups fail and recover, one process per replica group; None: off",
        _optional_choice(*FAULT_TOLERANCE_ENGINES), config=Optional[str],
    )  # fmt: skip
    ft_lighthouse: Optional[str] = option(
        None, "fault_tolerance: the torchft lighthouse's address, e.g. http://host:29510; None: TORCHFT_LIGHTHOUSE",
        _optional_text, config=Optional[str],
    )  # fmt: skip
    ft_replica_group: Optional[str] = option(
        None, "fault_tolerance: this replica group's number, distinct per group and kept across its restarts; "
        "None: REPLICA_GROUP_ID",
        _optional_text, config=Optional[str],
    )  # fmt: skip
    ft_min_replicas: int = option(
        1, "fault_tolerance: replica groups a step needs to commit", _count(1), config=int,
    )  # fmt: skip
    ft_timeout: float = option(
        60.0, "fault_tolerance: seconds an all-reduce, a commit vote or a recovery may take before the step is "
        "discarded (TORCHFT_TIMEOUT_SEC wins)",
        _positive_seconds, config=float,
    )  # fmt: skip
    ft_quorum_timeout: float = option(
        60.0, "fault_tolerance: seconds a step waits for its quorum, e.g. for ft_min_replicas groups to be up "
        "(TORCHFT_QUORUM_TIMEOUT_SEC wins)",
        _positive_seconds, config=float,
    )  # fmt: skip

    @classmethod
    def build(cls, given: Mapping[str, Any], scope: str, prefix: str = "") -> Options:
        """Validate ``given`` (the user's keyword arguments) for the front door ``scope``.

        Lightning's names are accepted for ours; every error names ``prefix + option``.
        """
        accepted = {f.name: f for f in dataclasses.fields(cls) if scope in f.metadata["scope"]}
        aliases = {f.metadata["lightning"]: f.name for f in accepted.values() if f.metadata["lightning"]}
        values: dict[str, Any] = {}
        for name, value in given.items():
            ours = aliases.get(name, name)
            if ours not in accepted:
                close = difflib.get_close_matches(name, [*accepted, *aliases], n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{prefix}{name}={value!r} is not an option of {_FRONT_DOORS[scope]}.{hint} "
                    f"Expected one of: {', '.join(accepted)}."
                )
            if ours in values:
                first = next(key for key in given if aliases.get(key, key) == ours)
                raise ValueError(
                    f"{prefix}{first}={given[first]!r} and {prefix}{name}={value!r} are the same option "
                    f"({name if name in aliases else first} is Lightning's DDPStrategy name for it): pass one of them."
                )
            values[ours] = accepted[ours].metadata["check"](f"{prefix}{name}", value)
        timeout = values.get("timeout")
        default_hang = values.get("hang_timeout", DEFAULT_HANG_TIMEOUT) == DEFAULT_HANG_TIMEOUT
        if default_hang and timeout is not None and "hang_timeout" in accepted:
            # The default (also as a Hydra schema passes it) stays well under a shorter process-group timeout.
            seconds = parse_timeout("timeout", timeout).total_seconds()
            values["hang_timeout"] = min(DEFAULT_HANG_TIMEOUT, seconds / 2)
        options = cls(**values)
        options._check_combinations(prefix)
        return options

    def _check_combinations(self, prefix: str) -> None:
        check_comm_hook_options(
            prefix,
            comm_hook=self.comm_hook,
            comm_state=self.comm_state,
            comm_wrapper=self.comm_wrapper,
            comm_dtype=self.comm_dtype,
            powersgd_rank=self.powersgd_rank,
            powersgd_start_iter=self.powersgd_start_iter,
        )
        timeout = None if self.timeout is None else parse_timeout("timeout", self.timeout).total_seconds()
        if self.hang_timeout is not None and timeout is not None and self.hang_timeout >= timeout:
            raise ValueError(
                f"{prefix}hang_timeout={self.hang_timeout:g} with {prefix}timeout={timeout:g} is invalid: the "
                "process group would time out first, without the diagnosis; expected hang_timeout < timeout "
                "(or hang_timeout=None)."
            )
        steps = self.local_sgd_steps
        if steps is None and self.local_sgd_adaptive:
            raise ValueError(
                f"{prefix}local_sgd_adaptive=True needs {prefix}local_sgd_steps: expected the initial period, e.g. 1."
            )
        hook = self.comm_hook
        hook_name = hook if hook is None or isinstance(hook, str) else getattr(getattr(hook, "func", hook), "__name__", None)
        if steps is not None and hook_name in COMM_HOOKS_SKIPPING_COMMUNICATION:
            raise ValueError(
                f"{prefix}local_sgd_steps={steps!r} with {prefix}comm_hook={hook_name!r} is invalid: that hook already "
                "skips gradient communication, so warm-up steps would not be data-parallel; expected LocalSGD or that "
                "hook, not both."
            )
        self._check_sharding(prefix, hook_name)
        self._check_fault_tolerance(prefix)

    def _check_fault_tolerance(self, prefix: str) -> None:
        if self.fault_tolerance is not None:
            check_fault_tolerance_options(self, f"{prefix}fault_tolerance={self.fault_tolerance!r}", prefix)
            return
        for f in dataclasses.fields(self):
            if f.name.startswith("ft_") and getattr(self, f.name) != f.default:
                raise ValueError(
                    f"{prefix}{f.name}={getattr(self, f.name)!r} is invalid without {prefix}fault_tolerance: expected "
                    f"{prefix}fault_tolerance='torchft' with it, or no {prefix}{f.name}."
                )

    def _check_sharding(self, prefix: str, hook_name: str | None) -> None:
        stage = self.sharding_stage
        if stage is None:
            if self.sharding_overlap:
                raise ValueError(
                    f"{prefix}sharding_overlap=True needs {prefix}sharding_stage: expected sharding_stage=1 or 2."
                )
            return
        if self.local_sgd_steps is not None:
            raise ValueError(
                f"{prefix}sharding_stage={stage} with {prefix}local_sgd_steps={self.local_sgd_steps} is invalid: "
                "LocalSGD steps every rank's optimizer on its own gradients and averages whole models, while sharding "
                "steps each parameter on one rank only; expected one of them."
            )
        if stage == 2 and (self.comm_hook is not None or self.comm_dtype is not None):
            given = f"comm_hook={hook_name!r}" if self.comm_hook is not None else f"comm_dtype={self.comm_dtype!r}"
            raise ValueError(
                f"{prefix}sharding_stage=2 with {prefix}{given} is invalid: a communication hook reduces whole buckets "
                "for every rank, stage 2 reduces each gradient to its owner only; expected sharding_stage=1 with a hook, "
                "or no hook."
            )

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` (already valid values, e.g. a tuned bucket size)."""
        return dataclasses.replace(self, **changes)

    def hook_options(self) -> dict[str, Any]:
        """The options ``lit_dp.gradients.hooks.resolve_comm_hook`` and ``describe_comm_hook`` take."""
        names = ("comm_hook", "comm_wrapper", "comm_dtype", "powersgd_rank", "powersgd_start_iter")
        return {name: getattr(self, name) for name in names}


_FRONT_DOORS = {
    TRAINER: "lit_dp.PaddleDPStrategy",
    FABRIC: "lit_dp.fabric.PaddleDPStrategy",
    MODULE: "lit_dp.DataParallel",
    DDP: "the recipes' strategy=ddp",
}


def option_fields(scope: str) -> list[dataclasses.Field]:
    """The ``Options`` fields that ``scope`` takes, in declaration order."""
    return [f for f in dataclasses.fields(Options) if scope in f.metadata["scope"]]


def options_doc(scope: str) -> str:
    """One line per option of ``scope``, for docstrings."""
    lines = []
    for f in option_fields(scope):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        alias = f" (Lightning: ``{f.metadata['lightning']}``)" if f.metadata["lightning"] else ""
        lines.append(f"        {f.name} = {default!r}: {f.metadata['help']}{alias}.")
    return "\n".join(lines)


def options_markdown() -> str:
    """docs/options.md: every option with its default, where it applies and its help."""
    fronts = ((TRAINER, "Trainer"), (FABRIC, "Fabric"), (MODULE, "DataParallel"))
    lines = [
        "# Options",
        "",
        "Every lit_dp option, generated from its one declaration in `lit_dp/options.py`",
        "(`lit_dp.options.options_markdown()`; a test keeps this page equal to it). The",
        "Trainer and Fabric strategies and `DataParallel` take them as keyword arguments; the recipes'",
        "`strategy.<option>=...` takes those with a Hydra type. Lightning `DDPStrategy`'s names are",
        "accepted for ours. Each value is checked once, where it enters, with an error naming the option.",
        "",
        "| option | default | where | Hydra | Lightning's name | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(Options):
        meta = f.metadata
        where = ", ".join(name for scope, name in fronts if scope in meta["scope"])
        hydra = "yes" if meta["config"] is not None else "no"
        lightning = f"`{meta['lightning']}`" if meta["lightning"] else ""
        lines.append(f"| `{f.name}` | `{f.default!r}` | {where} | {hydra} | {lightning} | {meta['help']} |")
    return "\n".join(lines) + "\n"
