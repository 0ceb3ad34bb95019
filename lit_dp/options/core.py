"""``Options``: every lit_dp option, the core ones and one group per feature, validated once.

The Trainer strategy, the Fabric strategy and ``DataParallel`` hand their keyword arguments to
``Options.build``, which checks each value once, where it enters, and returns a frozen
``Options`` that the layers below read without checking again (``options.sharding.stage``).
The recipes' Hydra schema, docs/options.md, the front doors' docstrings and the start-up line
(``describe``) are generated from the same declarations (``declared_options``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional

from lit_dp.options.backends import check_backend
from lit_dp.options.comm_hooks import (
    check_comm_dtype,
    check_comm_hook,
    check_hook_choice,
    describe_comm_hook,
    named_hooks,
)
from lit_dp.options.declare import (
    EVERYWHERE,
    STRATEGIES,
    TRAINER,
    Declared,
    anything,
    choice,
    count,
    duration,
    flag,
    group,
    is_group,
    megabytes,
    option,
    parse_timeout,
    seconds,
    show_value,
)
from lit_dp.options.consistency import ConsistencyOptions
from lit_dp.options.fault_tolerance import FaultToleranceOptions, check_engine, check_fault_tolerance
from lit_dp.options.local_sgd import COMM_HOOKS_SKIPPING_COMMUNICATION, LocalSGDOptions, check_local_sgd
from lit_dp.options.sharding import ShardingOptions
from lit_dp.options.spelling import Spellings
from lit_dp.options.straggler import StragglerOptions
from lit_dp.options.trace import TraceOptions

DEFAULT_BUCKET_MB = 25.0  # Paddle's comm_buffer_size (and torch DDP's bucket_cap_mb)
AUTO = "auto"  # comm_buffer_size="auto": sizes timed in the first steps (lit_dp.observability.autotune)
MAX_NRINGS = 8
DEFAULT_HANG_TIMEOUT = 300.0
START_METHODS = ("popen", "spawn", "fork", "forkserver")


def _hang_timeout(name: str, value: Any) -> float | str | None:
    if value == AUTO:
        return AUTO
    if isinstance(value, str):
        raise ValueError(f"{name}={value!r} is invalid: expected a positive number of seconds, '{AUTO}' or None.")
    return seconds(name, value)


def _buffer_size(name: str, value: Any) -> float | str:
    if value == AUTO:
        return AUTO
    if isinstance(value, str):
        raise ValueError(f"{name}={value!r} is invalid: expected a positive number of megabytes or '{AUTO}'.")
    try:
        return megabytes(name, value)
    except ValueError as error:
        raise ValueError(f"{error.args[0].rstrip('.')} or '{AUTO}'.") from None


def _in_megabytes(value: Any, options: Options) -> str:
    return value if value == AUTO else f"{value}MB"


@dataclasses.dataclass(frozen=True)
class Options:
    """lit_dp's options, validated (build with ``Options.build``); docs/options.md lists them."""

    comm_buffer_size: float | str = option(
        default=DEFAULT_BUCKET_MB,
        help="bucket size limit in MB (Paddle's 25), or auto: candidate sizes timed in the first steps",
        check=_buffer_size,
        scope=EVERYWHERE,
        config=Any,
        lightning="bucket_cap_mb",
        show=_in_megabytes,
    )
    last_comm_buffer_size: float = option(
        default=1.0,
        help="size limit in MB of the last bucket reduced in backward (the first layers')",
        check=megabytes,
        scope=EVERYWHERE,
        config=float,
        show=_in_megabytes,
    )
    find_unused_parameters: bool = option(
        default=False,
        help="tolerate parameters that get no gradient in an iteration (a graph walk per forward)",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
    )
    gradient_as_bucket_view: bool = option(
        default=False,
        help=".grad tensors are views into the bucket buffers, stored once",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
    )
    broadcast_buffers: bool = option(
        default=True,
        help="broadcast the first rank's buffers (BatchNorm statistics) before each forward that follows a "
        "synchronised one, and at the start, as torch DDP does; False keeps buffers local",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
    )
    comm_hook: Any = option(
        default=None,
        help="a named hook (fp16, bf16, powersgd: docs/comm_hooks.md) or a callable hook(state, bucket)",
        check=check_comm_hook,
        scope=EVERYWHERE,
        config=Optional[str],
        lightning="ddp_comm_hook",
        show=lambda value, options: describe_comm_hook(options),
    )
    comm_state: Any = option(
        default=None,
        help="the state handed to a callable comm_hook",
        check=anything,
        scope=EVERYWHERE,
        lightning="ddp_comm_state",
        shown_by="comm_hook",
    )
    comm_wrapper: Any = option(
        default=None,
        help="wraps comm_hook, e.g. torch's fp16_compress_wrapper",
        check=anything,
        scope=EVERYWHERE,
        lightning="ddp_comm_wrapper",
        shown_by="comm_hook",
    )
    comm_dtype: Optional[str] = option(
        default=None,
        help="fp16 or bf16: all-reduce gradients in half precision (wraps comm_hook if set)",
        check=check_comm_dtype,
        scope=EVERYWHERE,
        config=Optional[str],
        shown_by="comm_hook",
    )
    comm_stats: bool = option(
        default=False,
        help="measure each step's communication: comm/bytes, buckets, time_ms, exposed_ms, overlap",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
    )
    hang_timeout: Any = option(
        default=AUTO,
        help="seconds a lit_dp collective may wait (after the first steps) before the job ends naming the stuck "
        "rank, with every rank's stack in <log dir>/lit_dp_hang; auto: 300, or half of a shorter process-group "
        "timeout; a number given must be below that timeout (else refused); None: off",
        check=_hang_timeout,
        scope=EVERYWHERE,
        config=Any,
    )
    backend: str = option(
        default="auto",
        help="auto (NCCL for CUDA devices, else Gloo) or any backend torch.distributed has, e.g. cpu:gloo,cuda:nccl",
        check=check_backend,
        scope=STRATEGIES,
        config=str,
        lightning="process_group_backend",
    )
    nrings: Optional[int] = option(
        default=None,
        help=f"communicators to spread buckets over, 1..{MAX_NRINGS}; None: FLAGS_nccl_nrings or 1",
        check=count(1, MAX_NRINGS, optional=True),
        scope=STRATEGIES,
        config=Optional[int],
    )
    timeout: Optional[float] = option(
        default=None,
        help="seconds (or a timedelta) for the rendezvous and every collective; None: PADDLE_PG_TIMEOUT or 1800",
        check=duration,
        scope=STRATEGIES,
        config=Optional[float],
    )
    start_method: str = option(
        default="popen",
        help="popen (re-run the script per rank), spawn, fork or forkserver",
        check=choice(*START_METHODS),
        scope=STRATEGIES,
        config=str,
    )
    uneven_inputs: bool = option(
        default=False,
        help="ranks may have different numbers of batches: a rank that runs out takes the others' remaining "
        "steps without data, so every epoch ends together on every rank",
        check=flag,
        scope=frozenset({TRAINER}),
        config=bool,
    )
    fault_tolerance: Optional[str] = option(
        default=None,
        help="torchft: train on while replica groups fail and recover, one process per replica group "
        "(docs/fault_tolerance.md); None: off",
        check=check_engine,
        scope=STRATEGIES,
        config=Optional[str],
    )
    trace: TraceOptions = group(TraceOptions)
    local_sgd: LocalSGDOptions = group(LocalSGDOptions)
    sharding: ShardingOptions = group(ShardingOptions)
    ft: FaultToleranceOptions = group(FaultToleranceOptions)
    straggler: StragglerOptions = group(StragglerOptions)
    consistency: ConsistencyOptions = group(ConsistencyOptions)
    # The options of every registered named hook, by its name (lit_dp.options.comm_hooks): spelt
    # <name>.<field> like a group's, e.g. powersgd.rank. Read only.
    hooks: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {hook.name: hook.options() for hook in named_hooks() if hook.options is not None}
    )
    # Not an option: whether hang_timeout was given as a number (the watchdog then keeps it or
    # refuses it against the process group's own timeout) or resolved from "auto". Read only.
    hang_timeout_given: bool = dataclasses.field(default=False, metadata={"derived": True})

    @classmethod
    def build(cls, given: Mapping[str, Any], scope: str, prefix: str = "", *, nested: bool = False) -> Options:
        """Validate ``given`` for the front door ``scope``; every error names ``prefix`` + the option as written.

        Keyword arguments (``nested=False``) spell a group's option ``<group>_<field>``
        (``trace_dir``) or pass the group whole, as a mapping or its dataclass
        (``trace={"dir": ...}``); Lightning's names are accepted for ours. A config
        (``nested=True``, the recipes' Hydra schema) spells groups as mappings only, and an
        error for any other spelling names the config key to use.
        """
        names = Spellings(declared_options(scope), scope, nested)
        values: dict[str, Any] = {}  # path -> checked value
        written: dict[str, tuple[str, Any]] = {}  # path -> (name as written, value as given)
        for key, value in given.items():
            for path, name, item in names.resolve(key, value, prefix):
                if path in written:
                    first, first_value = written[path]
                    raise ValueError(
                        f"{first}={first_value!r} and {name}={item!r} are the same option ({path}): pass one of them."
                    )
                written[path] = (name, item)
                values[path] = names.declared[path].field.metadata["check"](name, item)
        timeout = values.get("timeout")
        if values.get("hang_timeout", AUTO) == AUTO and "hang_timeout" in names.declared:
            # "auto" stays well under a shorter process-group timeout; a number given is kept, or
            # refused below, never changed.
            short = None if timeout is None else parse_timeout("timeout", timeout).total_seconds() / 2
            values["hang_timeout"] = DEFAULT_HANG_TIMEOUT if short is None else min(DEFAULT_HANG_TIMEOUT, short)
        options = cls._compose(values)
        if "hang_timeout" in written and written["hang_timeout"][1] not in (AUTO, None):
            options = options.replace(hang_timeout_given=True)
        options._check_combinations(lambda path: written[path][0] if path in written else prefix + names.spell(path))
        return options

    @classmethod
    def _compose(cls, values: dict[str, Any]) -> Options:
        """An ``Options`` from checked values by path; what is not given keeps its default."""
        composed: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if is_group(field):
                composed[field.name] = field.metadata["group"](**_members(values, field.name))
            elif field.name != "hooks" and field.name in values:
                composed[field.name] = values[field.name]
        composed["hooks"] = {
            hook.name: hook.options(**_members(values, hook.name)) for hook in named_hooks() if hook.options is not None
        }
        return cls(**composed)

    def _check_combinations(self, name: Callable[[str], str]) -> None:
        """The options that cannot go together; ``name(path)`` spells an option as the user wrote it."""
        check_hook_choice(self, name)
        timeout = None if self.timeout is None else parse_timeout("timeout", self.timeout).total_seconds()
        if self.hang_timeout is not None and timeout is not None and self.hang_timeout >= timeout:
            raise ValueError(
                f"{name('hang_timeout')}={self.hang_timeout:g} with {name('timeout')}={timeout:g} is invalid: the "
                f"process group would time out first, without the diagnosis; expected {name('hang_timeout')} below "
                f"{name('timeout')} (e.g. {timeout / 2:g}), 'auto' (half of it) or None."
            )
        steps = self.local_sgd.steps
        if steps is None and self.local_sgd.adaptive:
            raise ValueError(
                f"{name('local_sgd.adaptive')}=True needs {name('local_sgd.steps')}: expected the initial period, e.g. 1."
            )
        check_local_sgd(self, name)
        hook = self.comm_hook
        hook_name = hook if hook is None or isinstance(hook, str) else getattr(getattr(hook, "func", hook), "__name__", None)
        if steps is not None and hook_name in COMM_HOOKS_SKIPPING_COMMUNICATION:
            raise ValueError(
                f"{name('local_sgd.steps')}={steps!r} with {name('comm_hook')}={hook_name!r} is invalid: that hook "
                "already skips gradient communication, so warm-up steps would not be data-parallel; expected LocalSGD "
                "or that hook, not both."
            )
        self._check_sharding(name, hook_name)
        self._check_consistency(name)
        check_fault_tolerance(self, name)

    def _check_sharding(self, name: Callable[[str], str], hook_name: str | None) -> None:
        stage = self.sharding.stage
        if stage is None:
            if self.sharding.overlap:
                raise ValueError(
                    f"{name('sharding.overlap')}=True needs {name('sharding.stage')}: expected "
                    f"{name('sharding.stage')}=1 or 2."
                )
            return
        if self.local_sgd.steps is not None:
            raise ValueError(
                f"{name('sharding.stage')}={stage} with {name('local_sgd.steps')}={self.local_sgd.steps} is invalid: "
                "LocalSGD steps every rank's optimizer on its own gradients and averages whole models, while sharding "
                "steps each parameter on one rank only; expected one of them."
            )
        if stage == 2 and (self.comm_hook is not None or self.comm_dtype is not None):
            given = (
                f"{name('comm_hook')}={hook_name!r}" if self.comm_hook is not None else f"{name('comm_dtype')}={self.comm_dtype!r}"
            )
            raise ValueError(
                f"{name('sharding.stage')}=2 with {given} is invalid: a communication hook reduces whole buckets for "
                f"every rank, stage 2 reduces each gradient to its owner only; expected {name('sharding.stage')}=1 "
                "with a hook, or no hook."
            )

    def _check_consistency(self, name: Callable[[str], str]) -> None:
        if not self.consistency.optimizer_state:
            return
        if self.consistency.every_n_steps is None:
            raise ValueError(
                f"{name('consistency.optimizer_state')}=True needs {name('consistency.every_n_steps')}: expected a "
                f"number of steps, e.g. {name('consistency.every_n_steps')}=100."
            )
        if self.sharding.stage is not None:
            raise ValueError(
                f"{name('consistency.optimizer_state')}=True with {name('sharding.stage')}={self.sharding.stage} is "
                "invalid: under sharding each rank holds the optimizer state of its own parameters only, so the "
                f"states differ by design; expected {name('consistency.optimizer_state')}=False (the parameters are "
                "still compared)."
            )

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` (already valid values, e.g. a tuned bucket size)."""
        return dataclasses.replace(self, **changes)

    def value(self, path: str) -> Any:
        """The value of the option spelt ``path``: ``comm_hook``, ``trace.dir``, ``powersgd.rank``."""
        owner, _, member = path.rpartition(".")
        if not owner:
            return getattr(self, member)
        return getattr(self.hooks[owner] if owner in self.hooks else getattr(self, owner), member)

    def is_set(self, path: str) -> bool:
        """Whether the option spelt ``path`` differs from its default."""
        return self.value(path) != _declared_field(path).default

    def hook_options(self, name: str) -> Any:
        """The options of the named hook ``name``, or None for a hook without options."""
        return self.hooks.get(name)

    def describe(self, scope: str, skip: tuple[str, ...] = ()) -> str:
        """The options of ``scope`` in effect, ``name=value`` each, for the start-up line.

        A named hook's options are part of its ``comm_hook=`` text; ``skip`` names options the
        caller shows itself (the strategy shows the backend resolved).
        """
        shown = []
        for declared in declared_options(scope):
            meta = declared.field.metadata
            if declared.hook is not None or meta["shown_by"] is not None or declared.path in skip:
                continue
            value = self.value(declared.path)
            shown.append(f"{declared.path}={meta['show'](value, self) if meta['show'] else show_value(value)}")
        return " ".join(shown)


def declared_options(scope: str | None = None) -> list[Declared]:
    """Every option, in declaration order (groups' options after the core ones, named hooks'
    last); with ``scope``, those that front door takes (a named hook's go where ``comm_hook`` goes)."""
    declared = []
    for field in dataclasses.fields(Options):
        if is_group(field):
            declared += [Declared(f"{field.name}.{member.name}", member) for member in dataclasses.fields(field.metadata["group"])]
        elif field.name != "hooks" and not field.metadata.get("derived"):
            declared.append(Declared(field.name, field))
    fields = {field.name: field for field in dataclasses.fields(Options)}
    for hook in named_hooks():
        members = dataclasses.fields(hook.options) if hook.options is not None else ()
        declared += [Declared(f"{hook.name}.{member.name}", member, hook.name) for member in members]
    _check_names_are_unique(declared, fields)
    if scope is None:
        return declared
    hooks_taken = scope in fields["comm_hook"].metadata["scope"]
    return [
        d for d in declared if (hooks_taken and d.hook is not None) or (d.hook is None and scope in d.field.metadata["scope"])
    ]


def _check_names_are_unique(declared: list[Declared], fields: Mapping[str, dataclasses.Field]) -> None:
    """A named hook must not take an option's name, nor two options one keyword (``a_b.c``, ``a.b_c``)."""
    for hook in named_hooks():
        if hook.name in fields:
            raise ValueError(f"named hook {hook.name!r} has the name of an option of Options: register it under another.")
    keywords: dict[str, str] = {}
    for option in declared:
        other = keywords.setdefault(option.keyword, option.path)
        if other != option.path:
            raise ValueError(f"options {other} and {option.path} have one keyword spelling, {option.keyword}: rename one.")


def _declared_field(path: str) -> dataclasses.Field:
    return next(declared.field for declared in declared_options() if declared.path == path)


def _members(values: dict[str, Any], owner: str) -> dict[str, Any]:
    """The checked values of ``owner``'s options (a group or a named hook), by field name."""
    return {path.split(".", 1)[1]: value for path, value in values.items() if path.split(".")[0] == owner and "." in path}
