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
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lit_dp.options.backends import check_backend
from lit_dp.options.comm_hooks import (
    check_comm_dtype,
    check_comm_hook,
    check_hook_choice,
    compressions,
    describe_comm_hook,
    named_hooks,
    resolve_comm_hook,
)
from lit_dp.options.declare import (
    EVERYWHERE,
    FABRIC,
    MODULE,
    STRATEGIES,
    TRAINER,
    Declared,
    anything,
    choice,
    count,
    duration,
    flag,
    group,
    in_ddp,
    is_group,
    megabytes,
    option,
    parse_timeout,
    seconds,
    show_value,
)
from lit_dp.options.consistency import RULES as CONSISTENCY_RULES
from lit_dp.options.consistency import ConsistencyOptions
from lit_dp.options.fault_tolerance import RULES as FAULT_TOLERANCE_RULES
from lit_dp.options.fault_tolerance import ENGINES, FaultToleranceOptions, check_engine, check_fault_tolerance
from lit_dp.options.forecast import RULES as FORECAST_RULES
from lit_dp.options.forecast import ForecastOptions
from lit_dp.options.local_sgd import RULES as LOCAL_SGD_RULES
from lit_dp.options.local_sgd import LocalSGDOptions
from lit_dp.options.rules import Rule
from lit_dp.options.sharding import RULES as SHARDING_RULES
from lit_dp.options.sharding import ShardingOptions
from lit_dp.options.spelling import Spellings
from lit_dp.options.straggler import StragglerOptions
from lit_dp.options.trace import RULES as TRACE_RULES
from lit_dp.options.trace import TraceOptions

DEFAULT_BUCKET_MB = 25.0  # Paddle's comm_buffer_size (and torch DDP's bucket_cap_mb)
AUTO = "auto"  # comm_buffer_size="auto": sizes timed in the first steps (lit_dp.observability.autotune)
# From this synchronised step on, "auto" no longer changes the buckets: what a hook keeping memory
# per bucket must wait for. lit_dp.observability.autotune.settled_step() (a test keeps them equal).
AUTO_SETTLED_STEP = 121
MAX_NRINGS = 8
DEFAULT_HANG_TIMEOUT = 300.0
START_METHODS = ("popen", "spawn", "fork", "forkserver")
# Lightning's names (its FSDPStrategy's state_dict_type): one file, or a folder of every rank's part.
STATE_DICT_TYPES = ("full", "sharded")


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


def _bucket_cap_mb(name: str, value: Any) -> float:
    if value == AUTO:
        raise ValueError(
            f"{name}={AUTO!r} is invalid under torch DDP: DDP has no automatic bucket size (its bucket_cap_mb is a "
            f"number of MB); expected a number, e.g. {name}={DEFAULT_BUCKET_MB:g} (DDP's default), or lit_dp's "
            "strategy (paddle_dp), which times the sizes."
        )
    return value


def _process_group_backend(name: str, value: str) -> str | None:
    return None if value == "auto" else value  # DDPStrategy's None is the same choice as our "auto"


def _ddp_timeout(name: str, value: Any) -> timedelta | None:
    return None if value is None else parse_timeout(name, value)


def _comm_hook_in_ddp(path: str, options: Options, name: Callable[[str], str]) -> dict[str, Any]:
    """The hook lit_dp would register (named hooks built, ``comm_dtype`` wrapped), for DDP's ``register_comm_hook``."""
    for given in ("comm_hook", "comm_dtype"):
        if options.value(given) == "bf16" and not ddp_takes_bf16_hooks():
            raise ValueError(
                f"{name(given)}='bf16' is invalid under torch DDP with this torch build: DDP registers its bf16 hooks "
                "only where torch was built with CUDA and NCCL 2.10+ (or XPU and XCCL), and refuses them in each rank "
                f"otherwise; expected {name(given)}='fp16' under DDP here, or lit_dp's strategy (paddle_dp), which "
                "all-reduces in bf16 on any backend."
            )
    resolved = resolve_comm_hook(options)
    return {} if resolved is None else {"ddp_comm_state": resolved[0], "ddp_comm_hook": resolved[1]}


def ddp_takes_bf16_hooks() -> bool:
    """torch DDP's own condition for its bf16 hooks (``DistributedDataParallel._check_comm_hook``): a build
    with CUDA (or ROCm) and NCCL 2.10+, or an XPU with XCCL."""
    cuda = torch.version.cuda is not None or torch.version.hip is not None
    nccl = dist.is_available() and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    xccl = dist.is_available() and hasattr(dist, "is_xccl_available") and dist.is_xccl_available()
    return (cuda and nccl) or (xccl and torch.xpu.is_available())


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
        ddp=in_ddp("bucket_cap_mb", _bucket_cap_mb),
        examples=(AUTO, 5.0),
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
        ddp=in_ddp("find_unused_parameters"),
    )
    gradient_as_bucket_view: bool = option(
        default=False,
        help=".grad tensors are views into the bucket buffers, stored once",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
        ddp=in_ddp("gradient_as_bucket_view"),
    )
    broadcast_buffers: bool = option(
        default=True,
        help="broadcast the first rank's buffers (BatchNorm statistics) before each forward that follows a "
        "synchronised one, and at the start, as torch DDP does; False keeps buffers local",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
        # Passed only when off: torch 2.9+ warns on broadcast_buffers given at all (its default is on, as ours).
        ddp=in_ddp("broadcast_buffers", lambda name, value: None if value else False),
    )
    comm_hook: Any = option(
        default=None,
        help="a named hook (fp16, bf16, powersgd: docs/comm_hooks.md) or a callable hook(state, bucket)",
        check=check_comm_hook,
        scope=EVERYWHERE,
        config=Optional[str],
        lightning="ddp_comm_hook",
        show=lambda value, options: describe_comm_hook(options),
        ddp=_comm_hook_in_ddp,
        examples=lambda: tuple(hook.name for hook in named_hooks()),  # those registered by the time it is asked
    )
    comm_state: Any = option(
        default=None,
        help="the state handed to a callable comm_hook",
        check=anything,
        scope=EVERYWHERE,
        lightning="ddp_comm_state",
        shown_by="comm_hook",
        ddp="comm_hook",
        examples=(),
    )
    comm_wrapper: Any = option(
        default=None,
        help="wraps comm_hook, e.g. torch's fp16_compress_wrapper",
        check=anything,
        scope=EVERYWHERE,
        lightning="ddp_comm_wrapper",
        shown_by="comm_hook",
        ddp="comm_hook",
        examples=(),
    )
    comm_dtype: Optional[str] = option(
        default=None,
        help="fp16 or bf16: all-reduce gradients in half precision (wraps comm_hook if set)",
        check=check_comm_dtype,
        scope=EVERYWHERE,
        config=Optional[str],
        shown_by="comm_hook",
        ddp="comm_hook",
        examples=lambda: tuple(compressions()),
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
        examples=(None, 60.0),
    )
    backend: str = option(
        default="auto",
        help="auto (NCCL for CUDA devices, else Gloo) or any backend torch.distributed has, e.g. cpu:gloo,cuda:nccl",
        check=check_backend,
        scope=STRATEGIES,
        config=str,
        lightning="process_group_backend",
        ddp=in_ddp("process_group_backend", _process_group_backend),
        examples=("gloo",),
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
        ddp=in_ddp("timeout", _ddp_timeout),
        examples=(120.0,),
    )
    start_method: str = option(
        default="popen",
        help="popen (re-run the script per rank), spawn, fork or forkserver",
        check=choice(*START_METHODS),
        scope=STRATEGIES,
        config=str,
        ddp=in_ddp("start_method"),
    )
    uneven_inputs: bool = option(
        default=False,
        help="ranks may have different numbers of batches: a rank that runs out takes the others' remaining "
        "steps without data, so every epoch ends together on every rank",
        check=flag,
        scope=frozenset({TRAINER}),
        instead={
            FABRIC: "ranks with different numbers of batches train inside `with fabric.strategy.join(model):` "
            "(torch's Join; docs/reliability.md, Uneven inputs)",
            MODULE: "ranks with different numbers of batches train inside `with model.join():` (torch's Join)",
        },
        config=bool,
    )
    fault_tolerance: Optional[str] = option(
        default=None,
        help="torchft: train on while replica groups fail and recover, each group a launcher's job of one "
        "rank or many (docs/fault_tolerance.md); None: off",
        check=check_engine,
        scope=STRATEGIES,
        config=Optional[str],
        examples=ENGINES,
    )
    state_dict_type: str = option(
        default="full",
        help="full: one checkpoint file (every Lightning tool reads it), rank 0 writing what the others stream to it; "
        "sharded: a folder, each rank writing and reading its own part (torch.distributed.checkpoint; "
        "docs/checkpoints.md)",
        check=choice(*STATE_DICT_TYPES),
        scope=STRATEGIES,
        config=str,
        examples=("sharded",),
    )
    async_save: bool = option(
        default=False,
        help="save checkpoints in the background: the state copied off the device at the save, written by a thread "
        "while training goes on (also with Lightning's AsyncCheckpointIO plugin)",
        check=flag,
        scope=STRATEGIES,
        config=bool,
    )
    trace: TraceOptions = group(TraceOptions, TRACE_RULES)
    local_sgd: LocalSGDOptions = group(LocalSGDOptions, LOCAL_SGD_RULES)
    sharding: ShardingOptions = group(ShardingOptions, SHARDING_RULES)
    ft: FaultToleranceOptions = group(FaultToleranceOptions, FAULT_TOLERANCE_RULES)
    straggler: StragglerOptions = group(StragglerOptions)
    consistency: ConsistencyOptions = group(ConsistencyOptions, CONSISTENCY_RULES)
    forecast: ForecastOptions = group(ForecastOptions, FORECAST_RULES)
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
        taken = declared_options(scope)
        paths = {declared.path for declared in taken}
        names = Spellings(taken, scope, nested, [other for other in declared_options() if other.path not in paths])
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
        for rule in rules():
            rule.check(self, name)
        check_hook_choice(self, name)
        timeout = None if self.timeout is None else parse_timeout("timeout", self.timeout).total_seconds()
        if self.hang_timeout is not None and timeout is not None and self.hang_timeout >= timeout:
            raise ValueError(
                f"{name('hang_timeout')}={self.hang_timeout:g} with {name('timeout')}={timeout:g} is invalid: the "
                f"process group would time out first, without the diagnosis; expected {name('hang_timeout')} below "
                f"{name('timeout')} (e.g. {timeout / 2:g}), 'auto' (half of it) or None."
            )
        check_fault_tolerance(self, name)

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

    def describe(self, scope: str, skip: tuple[str, ...] = (), changed_only: bool = False) -> str:
        """The options of ``scope`` in effect, ``name=value`` each, for the start-up line.

        A named hook's options are part of its ``comm_hook=`` text; ``skip`` names options the
        caller shows itself (the strategy shows the backend resolved). ``changed_only``: only
        those that differ from what ``scope`` builds with no options given, for a line short
        enough to read in a log (the recipes' start-up line).
        """
        defaults = Options.build({}, scope) if changed_only else None
        shown = []
        for declared in declared_options(scope):
            meta = declared.field.metadata
            if declared.hook is not None or meta["shown_by"] is not None or declared.path in skip:
                continue
            value = self.value(declared.path)
            if defaults is not None and value == defaults.value(declared.path):
                continue
            shown.append(f"{declared.path}={meta['show'](value, self) if meta['show'] else show_value(value)}")
        return " ".join(shown)


def rules() -> list[Rule]:
    """Every declared rule (``lit_dp.options.rules``): the groups', then the registered named hooks'."""
    declared = [rule for field in dataclasses.fields(Options) if is_group(field) for rule in field.metadata["rules"]]
    return declared + [rule for hook in named_hooks() for rule in hook.rules]


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
    for declared_option in declared:
        keyword, path = declared_option.keyword, declared_option.path
        other = keywords.setdefault(keyword, path)
        if other != path:
            raise ValueError(f"options {other} and {path} have one keyword spelling, {keyword}: rename one.")


def _declared_field(path: str) -> dataclasses.Field:
    return next(declared.field for declared in declared_options() if declared.path == path)


def _members(values: dict[str, Any], owner: str) -> dict[str, Any]:
    """The checked values of ``owner``'s options (a group or a named hook), by field name."""
    return {path.split(".", 1)[1]: value for path, value in values.items() if path.split(".")[0] == owner and "." in path}
