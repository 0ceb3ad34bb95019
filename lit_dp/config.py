"""Structured configs: typed, documented, validated options for the Hydra recipes.

Hydra checks types when it composes (``strategy.comm_buffer_size=abc`` fails there);
``validate`` then builds the dataclasses, whose ``__post_init__`` checks values, before any
process starts. The same checks guard ``PaddleDPStrategy``'s constructor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, OmegaConf

from lit_dp.autotune import check_comm_buffer_size
from lit_dp.backends import check_backend
from lit_dp.buckets import megabytes_to_bytes
from lit_dp.comm_hooks import check_comm_hook_options
from lit_dp.comm_stats import check_trace_steps
from lit_dp.env import MAX_NRINGS
from lit_dp.process_group import parse_timeout

START_METHODS = ("popen", "spawn", "fork", "forkserver")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def check_strategy_options(
    prefix: str = "",
    *,
    comm_buffer_size: Any = 25,
    last_comm_buffer_size: Any = 1,
    find_unused_parameters: Any = False,
    gradient_as_bucket_view: Any = False,
    backend: Any = "auto",
    nrings: Any = None,
    timeout: Any = None,
    start_method: Any = "popen",
    local_sgd_steps: Any = None,
    local_sgd_warmup_steps: Any = 0,
    local_sgd_adaptive: Any = False,
    comm_stats: Any = False,
    trace_dir: Any = None,
    trace_steps: Any = (1, 4),
    **comm_hook_options: Any,
) -> None:
    """Raise ``ValueError`` naming ``prefix + option``, the value and what is allowed.

    ``comm_hook_options``: ``comm_hook``, ``comm_state``, ``comm_wrapper``, ``comm_dtype``,
    ``powersgd_rank``, ``powersgd_start_iter`` (see ``lit_dp.comm_hooks``).
    """
    check_local_sgd_options(
        prefix,
        local_sgd_steps=local_sgd_steps,
        local_sgd_warmup_steps=local_sgd_warmup_steps,
        local_sgd_adaptive=local_sgd_adaptive,
        comm_hook=comm_hook_options.get("comm_hook"),
    )
    check_comm_buffer_size(f"{prefix}comm_buffer_size", comm_buffer_size)
    megabytes_to_bytes(f"{prefix}last_comm_buffer_size", last_comm_buffer_size)
    _check_flag(f"{prefix}find_unused_parameters", find_unused_parameters)
    _check_flag(f"{prefix}gradient_as_bucket_view", gradient_as_bucket_view)
    check_backend(f"{prefix}backend", backend)
    _check_choice(f"{prefix}start_method", start_method, START_METHODS)
    if nrings is not None and (isinstance(nrings, bool) or not isinstance(nrings, int) or not 1 <= nrings <= MAX_NRINGS):
        raise ValueError(f"{prefix}nrings={nrings!r} is invalid: expected an integer in [1, {MAX_NRINGS}].")
    if timeout is not None:
        parse_timeout(f"{prefix}timeout", timeout)
    check_comm_hook_options(prefix, **comm_hook_options)
    _check_flag(f"{prefix}comm_stats", comm_stats)
    if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
        raise ValueError(f"{prefix}trace_dir={trace_dir!r} is invalid: expected a directory path or null.")
    check_trace_steps(f"{prefix}trace_steps", trace_steps)


def check_local_sgd_options(
    prefix: str = "",
    *,
    local_sgd_steps: Any = None,
    local_sgd_warmup_steps: Any = 0,
    local_sgd_adaptive: Any = False,
    model_averaging_period: Any = None,
    comm_hook: Any = None,
) -> int | None:
    """Check LocalSGD's options (see ``lit_dp.local_sgd``); return the period K in effect (None: off).

    ``model_averaging_period`` is Lightning's name for ``local_sgd_steps``; giving both with
    different values is an error. ``comm_hook`` is checked against LocalSGD: a hook that itself
    skips gradient communication (torch's ``post_localSGD_hook``, ``noop_hook``) would make the
    warm-up steps local too.
    """
    steps = local_sgd_steps
    if model_averaging_period is not None:
        if local_sgd_steps is not None and local_sgd_steps != model_averaging_period:
            raise ValueError(
                f"{prefix}local_sgd_steps={local_sgd_steps!r} and {prefix}model_averaging_period="
                f"{model_averaging_period!r} disagree: they are the same option (Lightning's name); give one."
            )
        steps = model_averaging_period
        option = f"{prefix}model_averaging_period"
    else:
        option = f"{prefix}local_sgd_steps"
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"{option}={steps!r} is invalid: expected an integer >= 1 (or None: no LocalSGD).")
    warmup = local_sgd_warmup_steps
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"{prefix}local_sgd_warmup_steps={warmup!r} is invalid: expected an integer >= 0.")
    _check_flag(f"{prefix}local_sgd_adaptive", local_sgd_adaptive)
    if steps is None and local_sgd_adaptive:
        raise ValueError(
            f"{prefix}local_sgd_adaptive=True needs {prefix}local_sgd_steps: expected the initial period, e.g. 1."
        )
    hook_name = _hook_name(comm_hook)
    if steps is not None and hook_name in COMM_HOOKS_SKIPPING_COMMUNICATION:
        raise ValueError(
            f"{option}={steps!r} with {prefix}comm_hook={hook_name!r} is invalid: that hook already skips gradient "
            "communication, so warm-up steps would not be data-parallel; expected LocalSGD or that hook, not both."
        )
    return steps


# Hooks (by function or config name) that leave gradients local, which LocalSGD does itself.
COMM_HOOKS_SKIPPING_COMMUNICATION = ("post_localSGD_hook", "noop_hook", "post_local_sgd", "noop")


def _hook_name(hook: Any) -> str | None:
    """A comm hook's name: the string itself, or the function's (through ``functools.partial``)."""
    if hook is None or isinstance(hook, str):
        return hook
    return getattr(getattr(hook, "func", hook), "__name__", None)


def _check_choice(option: str, value: object, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"{option}={value!r} is invalid: expected one of {', '.join(allowed)}.")


def _check_flag(option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{option}={value!r} is invalid: expected True or False.")


# Optional[...] rather than "X | None": OmegaConf reads these annotations at runtime.
@dataclass
class PaddleDPStrategyConfig:
    """``strategy=paddle_dp``: lit_dp's bucketed reducer (see ``PaddleDPStrategy``)."""

    _target_: str = "lit_dp.PaddleDPStrategy"
    # Any: MB (a number) or "auto"; OmegaConf's Union[float, str] would refuse an int such as 25.
    comm_buffer_size: Any = 25  # bucket size limit, MB, or auto (tuned during the first steps)
    last_comm_buffer_size: float = 1  # limit of the last bucket reduced in backward, MB
    find_unused_parameters: bool = False  # tolerate parameters without a gradient
    gradient_as_bucket_view: bool = False  # .grad tensors are views into the bucket buffers
    backend: str = "auto"  # auto (NCCL on CUDA, else Gloo), or any available: gloo, nccl, cpu:gloo,cuda:nccl, ...
    nrings: Optional[int] = None  # communicators to spread buckets over; default FLAGS_nccl_nrings or 1
    timeout: Optional[float] = None  # seconds; default PADDLE_PG_TIMEOUT or 1800
    start_method: str = "popen"  # popen (re-run the script per rank) or spawn/fork/forkserver
    local_sgd_steps: Optional[int] = None  # LocalSGD: average the models every K local steps; null: off
    local_sgd_warmup_steps: int = 0  # LocalSGD: ordinary data-parallel steps before the local phase
    local_sgd_adaptive: bool = False  # LocalSGD: recompute K from loss and learning rate (Paddle's adaptive_localsgd)
    comm_hook: Optional[str] = None  # fp16, bf16 or powersgd: torch's communication hook of that name
    comm_dtype: Optional[str] = None  # fp16 or bf16: half-precision all-reduce (wraps comm_hook if set)
    powersgd_rank: Optional[int] = None  # comm_hook=powersgd's matrix approximation rank; default 1
    powersgd_start_iter: Optional[int] = None  # first compressed iteration (>= 2); default 1000
    comm_stats: bool = False  # log comm/bytes, buckets, time_ms, exposed_ms, overlap every log_every_n_steps
    trace_dir: Optional[str] = None  # write a Chrome trace of the communication, rank{R}.json, there
    trace_steps: List[int] = field(default_factory=lambda: [1, 4])  # traced steps: start <= step < stop

    def __post_init__(self) -> None:
        # Any-typed for "auto": a number gets the float type the other sizes have (5 -> 5.0).
        if isinstance(self.comm_buffer_size, int) and not isinstance(self.comm_buffer_size, bool):
            self.comm_buffer_size = float(self.comm_buffer_size)
        check_strategy_options("strategy.", **_options(self))


@dataclass
class DDPStrategyConfig:
    """``strategy=ddp``: torch DDP, with the same option names for side-by-side runs."""

    _target_: str = "lit_dp.config.ddp_strategy"
    comm_buffer_size: float = 25  # DDP's bucket_cap_mb
    last_comm_buffer_size: float = 1  # accepted for sweeps shared with paddle_dp; DDP sizes its first bucket itself
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    backend: str = "auto"
    timeout: Optional[float] = None
    start_method: str = "popen"

    def __post_init__(self) -> None:
        check_strategy_options("strategy.", **_options(self))


@dataclass
class TrainerConfig:
    """The ``lightning.pytorch.Trainer`` arguments the recipes expose."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"  # cpu, gpu, cuda, mps or auto
    devices: Any = 2  # processes per node: a positive integer, "auto", or a list of device ids
    num_nodes: int = 1
    max_epochs: Optional[int] = None
    max_steps: int = -1
    precision: Any = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    log_every_n_steps: int = 10
    val_check_interval: Any = None
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    enable_model_summary: bool = True
    default_root_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _check_choice("trainer.accelerator", self.accelerator, ACCELERATORS)
        devices = self.devices
        valid = (
            devices == "auto"
            or (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1)
            or (isinstance(devices, (list, tuple)) and devices and all(isinstance(d, int) and d >= 0 for d in devices))
        )
        if not valid:
            raise ValueError(
                f"trainer.devices={devices!r} is invalid: expected a positive integer, 'auto', "
                "or a list of device ids such as [0,1]."
            )
        for option in ("num_nodes", "accumulate_grad_batches"):
            value = getattr(self, option)
            if value < 1:
                raise ValueError(f"trainer.{option}={value!r} is invalid: expected an integer >= 1.")
        if self.max_epochs is not None and self.max_epochs < -1:
            raise ValueError(f"trainer.max_epochs={self.max_epochs!r} is invalid: expected >= -1 (or null).")


def _options(config: Any) -> dict[str, Any]:
    """A strategy config's options: every field but ``_target_``."""
    return {name: value for name, value in vars(config).items() if name != "_target_"}


def ddp_strategy(
    comm_buffer_size: float = 25,
    last_comm_buffer_size: float = 1,
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = False,
    backend: str = "auto",
    timeout: float | None = None,
    start_method: str = "popen",
) -> DDPStrategy:
    """Lightning's ``DDPStrategy`` configured from lit_dp's option names."""
    del last_comm_buffer_size  # DDP has no such knob; accepted so that one sweep covers both
    return DDPStrategy(
        bucket_cap_mb=comm_buffer_size,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        process_group_backend=None if backend == "auto" else backend,
        timeout=timedelta(seconds=timeout if timeout is not None else 1800),
        start_method=start_method,
    )


SCHEMAS = {
    ("strategy", "paddle_dp_schema"): PaddleDPStrategyConfig,
    ("strategy", "ddp_schema"): DDPStrategyConfig,
    ("trainer", "trainer_schema"): TrainerConfig,
}


def register_configs() -> None:
    """Make the schemas available to ``conf/`` (``defaults: [paddle_dp_schema]`` and so on)."""
    store = ConfigStore.instance()
    for (group, name), schema in SCHEMAS.items():
        store.store(group=group, name=name, node=schema)


def validate(cfg: DictConfig) -> None:
    """Check the strategy and trainer sections; raises ``ValueError`` naming the key."""
    for section in ("strategy", "trainer"):
        node = cfg[section]
        if OmegaConf.get_type(node) in SCHEMAS.values():
            OmegaConf.to_object(node)  # runs __post_init__
