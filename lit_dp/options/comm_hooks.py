"""Named communication hooks: ``comm_hook="<name>"``, each declared once, by its own module.

A ``NamedHook`` says how to build its ``(state, hook)`` in each process, how the start-up line
names it, which options of its own it takes (a frozen dataclass of ``option`` fields, spelt
``<name>.<field>``), which other options it cannot go with, and, for a compression, the wrapper
that ``comm_dtype="<name>"`` puts around another hook. ``register_named_hook`` makes it known to
everything generated from the options: their check, the recipes' Hydra schema, docs/options.md
and ``describe()`` (docs/comm_hooks.md shows a new one end to end).

The functions below turn the ``comm_*`` options (``comm_hook``, ``comm_state``,
``comm_wrapper``, ``comm_dtype``) and the chosen hook's options into the one ``(state, hook)``
pair that ``DataParallel.register_comm_hook`` takes (torch DDP's contract, in
``lit_dp.gradients.hooks``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

Hook = Callable[[Any, Any], torch.futures.Future]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class NamedHook:
    """A communication hook chosen by name.

    Attributes:
        name: what ``comm_hook`` (and ``strategy.comm_hook``) says; its options are ``<name>.*``.
        help: one line for docs/options.md.
        build: ``build(options)`` returns the ``(state, hook)`` to register; called in each
            process once the process group exists (a hook's state may hold the group).
            ``options`` is an instance of ``options``, or None when the hook has none.
        describe: ``describe(options)``: the hook as the start-up line shows it, e.g.
            ``powerSGD_hook(rank=1,start_iter=1000)``, with every one of its options.
        options: the frozen dataclass of the hook's own options, or None.
        conflicts: options (as ``Options`` spells them, e.g. ``comm_dtype``) that cannot be set
            with this hook, each with the reason the error gives.
        compress_wrapper: for a compression, the wrapper ``comm_dtype="<name>"`` puts around
            another hook (torch's ``fp16_compress_wrapper``); None otherwise.
        stateless: True for a hook that keeps nothing from one step to the next and communicates
            only on the process group it is given: fault tolerance accepts it, since a replica
            group that joins later misses nothing (``lit_dp.options.fault_tolerance``).
        rules: the combinations of options this hook cannot go with, beyond ``conflicts``
            (``lit_dp.options.rules``), checked with every option's where the job starts.
        bucket_memory: for a hook whose state keeps memory per bucket (``GradBucket.index()``),
            ``bucket_memory(state, step)`` says why that state would keep it before synchronised
            ``step``, from which on the buckets no longer change, and what to set instead; None
            when it would not, or when ``state`` is not its kind (``comm_buffer_size="auto"``
            rebuilds the buckets until then: ``lit_dp.gradients.hooks``).
    """

    name: str
    help: str
    build: Callable[[Any], tuple[object, Hook]]
    describe: Callable[[Any], str]
    options: type | None = None
    conflicts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    compress_wrapper: Callable[[Hook], Hook] | None = None
    stateless: bool = False
    rules: tuple = ()
    bucket_memory: Callable[[Any, int], str | None] | None = None


_REGISTRY: dict[str, NamedHook] = {}


def register_named_hook(hook: NamedHook) -> NamedHook:
    """Make ``hook`` selectable as ``comm_hook=hook.name``; returns it.

    Raises:
        ValueError: for a name that is not a lower-case identifier or is taken, or options that
            are not a frozen dataclass of ``option`` fields.
    """
    if not _NAME.match(hook.name):
        raise ValueError(f"named hook {hook.name!r} is invalid: expected a lower-case identifier, e.g. 'powersgd'.")
    if hook.name in _REGISTRY and _REGISTRY[hook.name] != hook:
        raise ValueError(f"named hook {hook.name!r} is already registered: {_REGISTRY[hook.name]!r}.")
    options = hook.options
    if options is not None:
        declared = dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen
        fields = dataclasses.fields(options) if declared else ()
        if not fields or any("check" not in field.metadata for field in fields):
            raise ValueError(
                f"named hook {hook.name!r}: options={options!r} is invalid: expected a frozen dataclass whose "
                "fields are declared with lit_dp.options.option(...)."
            )
    _REGISTRY[hook.name] = hook
    return hook


def named_hook(name: str) -> NamedHook:
    return _REGISTRY[name]


def named_hooks() -> list[NamedHook]:
    """Every registered named hook, in registration order (lit_dp's own first)."""
    return list(_REGISTRY.values())


def compressions() -> list[str]:
    """The names ``comm_dtype`` takes: the named hooks that can wrap another hook."""
    return [hook.name for hook in _REGISTRY.values() if hook.compress_wrapper is not None]


def hook_name(hook: object) -> str:
    """``module.qualname`` of a hook (torch's wrappers are named ``fp16_compress_wrapper_hook``)."""
    module = getattr(hook, "__module__", None)
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"{module}.{name}" if module else name


def short_name(hook: object) -> str:
    """A hook's or wrapper's ``__qualname__``, as the start-up line shows it."""
    return getattr(hook, "__qualname__", type(hook).__qualname__)


def check_hook(name: str, hook: object) -> None:
    if not callable(hook):
        raise ValueError(f"{name}={hook!r} is invalid: expected a callable hook(state, bucket) -> torch.futures.Future.")


def check_comm_hook(name: str, value: Any) -> Any:
    """The ``comm_hook`` option: None, a callable, or a registered name (lower-cased)."""
    if value is None or callable(value):
        return value
    if isinstance(value, str) and value.lower() in _REGISTRY:
        return value.lower()
    raise ValueError(
        f"{name}={value!r} is invalid: expected one of {', '.join(_REGISTRY)}, or a callable hook(state, bucket)."
    )


def check_comm_dtype(name: str, value: Any) -> str | None:
    """The ``comm_dtype`` option: None or a registered compression's name (lower-cased)."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in compressions():
        return value.lower()
    raise ValueError(f"{name}={value!r} is invalid: expected one of {', '.join(compressions())}.")


class HookChoice(Protocol):
    """The options that choose the hook (``lit_dp.options.Options`` offers them)."""

    comm_hook: Any
    comm_state: Any
    comm_wrapper: Any
    comm_dtype: str | None

    def hook_options(self, name: str) -> Any:
        """The options of the named hook ``name`` (None when it has none)."""

    def value(self, path: str) -> Any:
        """The value of the option spelt ``path`` (``comm_dtype``, ``powersgd.rank``)."""

    def is_set(self, path: str) -> bool:
        """Whether that option differs from its default."""


def check_hook_choice(choice: HookChoice, name: Callable[[str], str]) -> None:
    """The ``comm_*`` options and named hooks' options that cannot go together.

    ``name(path)`` spells an option as the user wrote it (``strategy.comm_hook``); each value
    was already checked on its own.
    """
    hook, state, wrapper, dtype = choice.comm_hook, choice.comm_state, choice.comm_wrapper, choice.comm_dtype
    named = isinstance(hook, str)
    if wrapper is not None:
        check_hook(name("comm_wrapper"), wrapper)
        if hook is None:
            raise ValueError(f"{name('comm_wrapper')}={hook_name(wrapper)} is invalid without a comm_hook to wrap.")
    if state is not None and (hook is None or named):
        raise ValueError(
            f"{name('comm_state')}={state!r} is invalid with {name('comm_hook')}={hook!r}: a state goes with a "
            "callable comm_hook (the named hooks build their own)."
        )
    if dtype is not None and wrapper is not None:
        raise ValueError(
            f"{name('comm_dtype')}={dtype!r} is invalid with {name('comm_wrapper')}={hook_name(wrapper)}: "
            "comm_dtype wraps the hook itself; set one of them."
        )
    for path in _options_of_other_hooks(hook):
        if choice.is_set(path):
            raise ValueError(
                f"{name(path)}={choice.value(path)!r} is invalid with {name('comm_hook')}={hook!r}: "
                f"it applies to comm_hook={path.split('.')[0]!r}."
            )
    conflicts = named_hook(hook).conflicts if named else {}
    for path, why in conflicts.items():
        if choice.is_set(path):
            raise ValueError(f"{name(path)}={choice.value(path)!r} is invalid with {name('comm_hook')}={hook!r}: {why}.")


def _options_of_other_hooks(chosen: Any) -> list[str]:
    """``<name>.<field>`` for every option of a named hook other than ``chosen``."""
    return [
        f"{hook.name}.{field.name}"
        for hook in named_hooks()
        if hook.options is not None and hook.name != chosen
        for field in dataclasses.fields(hook.options)
    ]


def resolve_comm_hook(choice: HookChoice) -> tuple[object, Hook] | None:
    """The ``(state, hook)`` to register, or None for lit_dp's own all-reduce.

    Call it in each process, after the process group exists: a named hook's state is built here.
    """
    hook, wrapper, dtype = choice.comm_hook, choice.comm_wrapper, choice.comm_dtype
    if hook is None:
        return None if dtype is None else named_hook(dtype).build(choice.hook_options(dtype))
    if isinstance(hook, str):
        state, hook = named_hook(hook).build(choice.hook_options(hook))
    else:
        state = choice.comm_state
    if wrapper is not None:
        return state, wrapper(hook)
    if dtype is not None:
        return state, named_hook(dtype).compress_wrapper(hook)
    return state, hook


def declared_stateless(choice: HookChoice) -> bool:
    """Whether the options chose only named hooks that declare themselves ``stateless`` (no hook
    or wrapper given as a callable): fault tolerance trusts those (``lit_dp.fault_tolerance``)."""
    names = [name for name in (choice.comm_hook, choice.comm_dtype) if name is not None]
    return choice.comm_wrapper is None and all(isinstance(name, str) and named_hook(name).stateless for name in names)


def describe_comm_hook(choice: HookChoice) -> str:
    """The hook in effect, e.g. ``fp16_compress_wrapper(powerSGD_hook(rank=1,start_iter=1000))``."""
    hook, wrapper, dtype = choice.comm_hook, choice.comm_wrapper, choice.comm_dtype
    if hook is None:
        return "none" if dtype is None else named_hook(dtype).describe(choice.hook_options(dtype))
    text = named_hook(hook).describe(choice.hook_options(hook)) if isinstance(hook, str) else short_name(hook)
    if wrapper is not None:
        return f"{short_name(wrapper)}({text})"
    if dtype is not None:
        return f"{short_name(named_hook(dtype).compress_wrapper)}({text})"
    return text
