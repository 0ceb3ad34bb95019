"""Structured configs for the recipes: typed Hydra schemas for ``strategy=`` and ``trainer=``.

The strategy schemas are generated from ``lit_dp.options.Options``, the one declaration of
lit_dp's options: every field of the strategy's scope that a command line can express, with
its default. Hydra checks the types when it composes (``strategy.nrings=abc`` fails there);
the values themselves are checked once, by ``Options.build`` in ``build_strategy``, which
``train`` calls before anything else, and the strategy receives them built.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import get_method, instantiate
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from lit_dp.options import DDP, TRAINER, Options, option_fields
from lit_dp_recipes.resume import register_resolvers

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
# CPU ranks per core beyond which a run is refused: past it every rank waits for a core most of
# each step, and its memory (a model, an optimizer, a process) adds up for nothing.
MAX_CPU_RANKS_PER_CORE = 4


def strategy_schema(name: str, target: str, scope: str) -> type:
    """A Hydra schema with ``_target_`` and the command-line options of ``scope``."""
    fields: list[tuple[str, Any, Any]] = [("_target_", str, dataclasses.field(default=target))]
    for option in option_fields(scope):
        config_type = option.metadata["config"]
        if config_type is None:
            continue  # a Python object (a hook callable, its state): not expressible in YAML
        default = option.default
        if isinstance(default, tuple):  # OmegaConf keeps sequences as lists
            fields.append((option.name, config_type, dataclasses.field(default_factory=lambda d=default: list(d))))
        else:
            fields.append((option.name, config_type, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(name, fields)


# Options tagged `ddp`: the recipes' torch-DDP config shares our names for side-by-side runs.
PaddleDPStrategyConfig = strategy_schema("PaddleDPStrategyConfig", "lit_dp.PaddleDPStrategy", TRAINER)
DDPStrategyConfig = strategy_schema("DDPStrategyConfig", "lit_dp_recipes.config.ddp_strategy", DDP)


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
    check_val_every_n_epoch: Optional[int] = 1  # null: val_check_interval counts steps across epochs
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


def ddp_strategy(options: Options | None = None, **values: Any) -> DDPStrategy:
    """Lightning's ``DDPStrategy`` configured from lit_dp's option names (validated like ours)."""
    options = options if options is not None else Options.build(values, DDP)
    # last_comm_buffer_size has no DDP counterpart (DDP sizes its first bucket itself): accepted
    # so that one sweep covers both strategies.
    return DDPStrategy(
        bucket_cap_mb=options.comm_buffer_size,
        find_unused_parameters=options.find_unused_parameters,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        process_group_backend=None if options.backend == "auto" else options.backend,
        timeout=timedelta(seconds=options.timeout if options.timeout is not None else 1800),
        start_method=options.start_method,
    )


STRATEGY_SCOPES = {PaddleDPStrategyConfig: TRAINER, DDPStrategyConfig: DDP}
# Stored outside the groups they type (conf/strategy/*.yaml say `- /paddle_dp_schema@_here_`),
# so that --help lists the choices a user has, not the schemas.
SCHEMAS = {
    "paddle_dp_schema": PaddleDPStrategyConfig,
    "ddp_schema": DDPStrategyConfig,
    "trainer_schema": TrainerConfig,
}


def register_configs() -> None:
    """Make the schemas available to ``conf/`` (``defaults: [/paddle_dp_schema@_here_]`` and so on), and
    the ``lit_dp.job_folder`` resolver that names run folders (``conf/hydra/default.yaml``)."""
    register_resolvers()
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(name=name, node=schema)


def build_strategy(node: DictConfig) -> Any:
    """The strategy ``cfg.strategy`` describes, its options validated once, named as on the command line.

    A config of lit_dp's schemas is validated by ``Options.build`` (errors read
    ``strategy.comm_buffer_size=-1.0 is invalid: ...``) and handed over built; any other
    strategy config is instantiated as it is.
    """
    scope = STRATEGY_SCOPES.get(OmegaConf.get_type(node))
    if scope is None:
        return instantiate(node)
    values = OmegaConf.to_container(node, resolve=True)
    target = get_method(values.pop("_target_"))
    return target(options=Options.build(values, scope, prefix="strategy."))


def validate_trainer(cfg: DictConfig) -> None:
    """Check the trainer section (``TrainerConfig.__post_init__``, then ``check_cpu_devices``); raises
    ``ValueError`` naming the key."""
    if OmegaConf.get_type(cfg.trainer) is TrainerConfig:
        OmegaConf.to_object(cfg.trainer)
    check_cpu_devices(cfg.trainer.get("accelerator", "auto"), cfg.trainer.get("devices", "auto"))


def check_cpu_devices(accelerator: Any, devices: Any, cores: int | None = None) -> None:
    """On CPU, ``trainer.devices`` processes against the cores this process may run on: a warning
    above them, a ``ValueError`` above ``MAX_CPU_RANKS_PER_CORE`` per core."""
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if not on_cpu or isinstance(devices, bool) or not isinstance(devices, int):
        return
    cores = cores if cores is not None else available_cores()
    bound = MAX_CPU_RANKS_PER_CORE * cores
    if devices > bound:
        raise ValueError(
            f"trainer.devices={devices} is too many CPU processes: this machine gives {cores} cores, and at most "
            f"{bound} processes ({MAX_CPU_RANKS_PER_CORE} per core) are accepted. Use trainer.devices={cores} "
            "(one per core), or GPUs (trainer=gpu), or more machines (trainer.num_nodes)."
        )
    if devices > cores:
        rank_zero_warn(
            f"trainer.devices={devices} starts more CPU processes than the {cores} cores this machine gives: "
            f"they share the cores, so each step takes longer (at most {bound} are accepted)."
        )


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's limit), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def is_fraction(value: object) -> bool:
    """A number strictly between 0 and 1 (not a string such as ``abc``, not a bool): a ``val_fraction``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1


def _check_choice(option: str, value: object, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"{option}={value!r} is invalid: expected one of {', '.join(allowed)}.")
