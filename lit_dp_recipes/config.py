"""Structured configs for the recipes: typed Hydra schemas for ``strategy=`` and ``trainer=``.

The strategy schemas are generated from lit_dp's declarations of its options
(``lit_dp.options.declared_options``): every option of the Trainer strategy that a command line
can express, with its default; a feature's options, and a named communication hook's, form a
node of their own (``strategy.trace.dir``, ``strategy.powersgd.rank``). Hydra checks the types
when it composes (``strategy.nrings=abc`` fails there); the values themselves are checked once,
by ``Options.build`` in ``build_strategy``, which ``train`` calls before anything else, and the
strategy receives them built.

The ``paddle_dp`` schema is open at its top level, so that a key it lacks reaches
``Options.build``, whose error names the key to use: ``strategy.trace_dir=...`` (the keyword
spelling of ``strategy.trace.dir``), ``strategy.bucket_cap_mb`` (Lightning's name), a typo.
``register_configs`` generates the schemas again, with the named hooks registered by then.

``strategy=ddp`` is torch DDP for side-by-side runs (``lit_dp_recipes.ddp_peer.DDPPeer``): its schema holds the options
whose declarations say what DDP has for them (``ddp=``: ``comm_buffer_size`` is
``bucket_cap_mb``, a named ``comm_hook`` is torch's hook). It is open too, so that any other
lit_dp option, from the command line or an ``experiment=``, reaches
``lit_dp.ddp_arguments.ddp_strategy_arguments``, which refuses it by name before any rank
starts: DDP would run without it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_dp.ddp_arguments import ddp_strategy_arguments
from lit_dp.options import TRAINER, Declared, Options, declared_options
from lit_dp.options.warning import LitDPWarning
from lit_dp_recipes.run_folder import register_resolvers
from lit_dp_recipes.spelling import did_you_mean

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
# Lightning's values of ``precision`` (its ``_PRECISION_INPUT``; a test keeps them equal), written
# here so that the command line is checked before Lightning loads.
PRECISIONS = (
    "16-mixed", "bf16-mixed", "32-true", "16-true", "bf16-true", "64-true",
    "transformer-engine", "transformer-engine-float16", "64", "32", "16", "bf16",
)
# CPU ranks per core beyond which a run is refused: past it every rank waits for a core most of
# each step, and its memory (a model, an optimizer, a process) adds up for nothing.
MAX_CPU_RANKS_PER_CORE = 4
MONITOR_MODES = ("min", "max")
PADDLE_DP_TARGET = "lit_dp.PaddleDPStrategy"
DDP_TARGET = "lit_dp_recipes.ddp_peer.ddp_strategy"
DDP_PEER = "lit_dp_recipes.ddp_peer.DDPPeer"


def ddp_options() -> list[Declared]:
    """The options of ``strategy=ddp``: those a config can express whose declaration says what DDP
    has for them (``ddp=``); a named hook's go with ``comm_hook``."""
    return [
        declared
        for declared in declared_options(TRAINER)
        if declared.field.metadata["config"] is not None
        and (declared.field.metadata["ddp"] is not None or declared.hook is not None)
    ]


def strategy_schema(name: str, target: str, options: list[Declared]) -> type:
    """A Hydra schema with ``_target_`` and those of ``options`` a command line can express."""
    fields: list[tuple[str, Any, Any]] = [("_target_", str, dataclasses.field(default=target))]
    nodes: dict[str, list[tuple[str, Any, Any]]] = {}
    for declared in options:
        if declared.field.metadata["config"] is None:
            continue  # a Python object (a hook callable, its state): not expressible in YAML
        owner, _, member = declared.path.rpartition(".")
        (nodes.setdefault(owner, []) if owner else fields).append(_schema_field(member, declared.field))
    for owner, members in nodes.items():
        node = dataclasses.make_dataclass("".join(part.title() for part in owner.split("_")) + "Config", members)
        fields.append((owner, node, dataclasses.field(default_factory=node)))
    return dataclasses.make_dataclass(name, fields)


def _schema_field(name: str, declared: dataclasses.Field) -> tuple[str, Any, Any]:
    default = declared.default
    if isinstance(default, tuple):  # OmegaConf keeps sequences as lists
        return name, declared.metadata["config"], dataclasses.field(default_factory=lambda d=default: list(d))
    return name, declared.metadata["config"], dataclasses.field(default=default)


def paddle_dp_schema() -> type:
    """``strategy=paddle_dp``'s schema: every option of the Trainer strategy, named hooks' included."""
    return strategy_schema("PaddleDPStrategyConfig", PADDLE_DP_TARGET, declared_options(TRAINER))


def ddp_schema() -> type:
    """``strategy=ddp``'s schema: the options DDP has a counterpart for (``ddp_options``)."""
    return strategy_schema("DDPStrategyConfig", DDP_TARGET, ddp_options())


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
        # What Lightning refuses only once the Trainer is built, or not at all and then fails in each
        # rank (a log interval or a validation every 0 epochs), refused here in the check of the command line.
        if self.max_steps < -1:
            raise ValueError(
                f"trainer.max_steps={self.max_steps!r} is invalid: expected a number of steps >= 0, or -1 (no limit)."
            )
        if str(self.precision) not in PRECISIONS:
            raise ValueError(
                f"trainer.precision={self.precision!r} is invalid: expected one of {', '.join(PRECISIONS)}."
            )
        if self.log_every_n_steps < 1:
            raise ValueError(
                f"trainer.log_every_n_steps={self.log_every_n_steps!r} is invalid: expected an integer >= 1."
            )
        every = self.check_val_every_n_epoch
        if every is not None and every < 1:
            raise ValueError(
                f"trainer.check_val_every_n_epoch={every!r} is invalid: expected an integer >= 1, "
                "or null (trainer.val_check_interval then counts batches across epochs)."
            )
        clip = self.gradient_clip_val
        if clip is not None and clip < 0:
            raise ValueError(f"trainer.gradient_clip_val={clip!r} is invalid: expected a norm >= 0, or null (no clipping).")
        between = "the training batches between validations"
        _check_batches("trainer.val_check_interval", self.val_check_interval, least=1, what=between)
        for option in ("limit_train_batches", "limit_val_batches"):
            _check_batches(f"trainer.{option}", getattr(self, option), least=0, what="the batches of an epoch to use")


def register_configs() -> None:
    """Make the schemas available to ``conf/`` (``defaults: [/paddle_dp_schema@_here_]`` and so on), and
    the ``lit_dp.job_folder`` resolver that names run folders (``conf/hydra/default.yaml``).

    The strategy schemas are generated here, so they hold the named hooks registered so far. They
    are stored outside the groups they type, so that ``--help`` lists the choices a user has, not
    the schemas.
    """
    register_resolvers()
    paddle_dp = OmegaConf.structured(paddle_dp_schema())
    OmegaConf.set_struct(paddle_dp, False)  # open: Options.build names a moved or misspelt key (module docstring)
    store = ConfigStore.instance()
    store.store(name="paddle_dp_schema", node=paddle_dp)
    ddp = OmegaConf.structured(ddp_schema())
    OmegaConf.set_struct(ddp, False)  # open: a lit_dp option DDP lacks is refused by name (module docstring)
    store.store(name="ddp_schema", node=ddp)
    store.store(name="trainer_schema", node=TrainerConfig)


def build_strategy(node: DictConfig) -> Any:
    """The strategy ``cfg.strategy`` describes, its options validated once, named as on the command line.

    A config of lit_dp's strategy or of the recipes' ``ddp`` is validated by ``Options.build``
    (errors read ``strategy.comm_buffer_size=-1.0 is invalid: ...``), ``ddp``'s options mapped to
    DDP's or refused (``lit_dp_recipes.ddp_peer``); any other strategy config is instantiated as it is.
    """
    target = node.get("_target_")
    if target not in (PADDLE_DP_TARGET, DDP_TARGET):
        return instantiate(node)
    # By name, so that this module does not load Lightning (the peer is Lightning's DDPStrategy).
    built = PADDLE_DP_TARGET if target == PADDLE_DP_TARGET else DDP_PEER
    return get_method(built)(**strategy_arguments(node))


def strategy_arguments(node: DictConfig) -> dict[str, Any]:
    """The keyword arguments ``build_strategy`` gives lit_dp's strategy or the ``ddp`` peer, checked;
    raises ``ValueError`` naming the option as typed. Lightning-free: the command line's check
    (``lit_dp_recipes.cli``) calls it before any import of Lightning."""
    values = OmegaConf.to_container(node, resolve=True)
    target = values.pop("_target_")
    if target == DDP_TARGET:
        return ddp_strategy_arguments(values, "strategy.", nested=True)
    return {"options": Options.build(values, TRAINER, prefix="strategy.", nested=True)}


def validate_trainer(cfg: DictConfig) -> None:
    """Check the trainer section (``TrainerConfig.__post_init__``, then ``check_cpu_devices`` and
    ``check_sharded_precision``); raises ``ValueError`` naming the key."""
    if OmegaConf.get_type(cfg.trainer) is TrainerConfig:
        OmegaConf.to_object(cfg.trainer)
    accelerator, devices = cfg.trainer.get("accelerator", "auto"), cfg.trainer.get("devices", "auto")
    check_cpu_devices(accelerator, devices)
    strategy = cfg.get("strategy") or {}
    check_sharded_precision((strategy.get("sharding") or {}).get("stage"), cfg.trainer.get("precision"))


def world_size(trainer: DictConfig) -> int:
    """The ranks the trainer section starts, counted as Lightning does: ``devices`` per node (a
    number, a list of ids, or ``auto``: every GPU on a GPU accelerator, one process on a CPU)
    times ``num_nodes``."""
    devices, accelerator = trainer.get("devices", "auto"), str(trainer.get("accelerator", "auto"))
    if devices == "auto":
        on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        per_node = torch.cuda.device_count() if on_gpu else 1
    else:
        per_node = len(devices) if isinstance(devices, (list, ListConfig)) else int(devices)
    return per_node * trainer.get("num_nodes", 1)


def epoch_batches(batches: int, limit: Any) -> int:
    """An epoch's training batches under ``trainer.limit_train_batches`` (null: all; an integer: at most
    that many; a fraction: that share, rounded down), as Lightning counts them."""
    if limit is None:
        return batches
    if isinstance(limit, float) and not (limit > 1 and limit.is_integer()):
        return int(batches * limit)
    return min(batches, int(limit))


def check_epoch_against_trainer(trainer: DictConfig, datamodule: Any) -> None:
    """What Lightning checks only in each rank, once the data is set up and with a traceback, checked
    before any rank starts for a datamodule that says how many batches a rank draws in an epoch
    (``train_batches(ranks)``; the recipes' do, and raise where a rank would draw none): that
    ``trainer.val_check_interval``, in batches counted within an epoch, is at most an epoch's."""
    train_batches = getattr(datamodule, "train_batches", None)
    if train_batches is None:
        return
    ranks = world_size(trainer)
    if ranks < 1:
        return  # trainer=gpu on a machine without one: Lightning refuses the accelerator, by name
    batches = train_batches(ranks)
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float) and interval > 1 and interval.is_integer():
        interval = int(interval)  # Lightning's reading of 100.0
    counts_within_an_epoch = trainer.get("check_val_every_n_epoch", 1) is not None
    if not isinstance(interval, int) or isinstance(interval, bool) or not counts_within_an_epoch:
        return
    if trainer.get("limit_val_batches") == 0:
        return  # no validation, so no interval: Lightning does not check it either
    limit = trainer.get("limit_train_batches")
    epoch = epoch_batches(batches, limit)
    if interval > epoch:
        limited = f", trainer.limit_train_batches={limit}" if epoch < batches else ""
        raise ValueError(
            f"trainer.val_check_interval={interval} is invalid: an epoch is {epoch} training batches per rank here "
            f"(data.batch_size={datamodule.batch_size}, {ranks} rank{'s' * (ranks != 1)}{limited}); expected at most {epoch}, a fraction "
            "of an epoch (0.5: twice an epoch), or trainer.check_val_every_n_epoch=null to count batches across epochs."
        )


def check_model_against_data(datamodule: Any, model: Any) -> None:
    """A model that does not fit the data (the digits' 64 pixels, the tokens' window and vocabulary)
    fails at its first batch in every rank: a datamodule that can tell (``check_model(model)``; the
    recipes' can) refuses it before any rank starts."""
    check = getattr(datamodule, "check_model", None)
    if check is not None:
        check(model)


def check_monitor(monitor: Any, model: Any) -> None:
    """``monitor`` spelt like a metric the model logs (its ``METRICS``; the recipes' models declare
    them) but none of them: a typo that ``ModelCheckpoint`` would find only at the first
    validation, in every rank. A name unlike them all may be a callback's (``tokens_per_sec``),
    and is left to Lightning."""
    metrics = getattr(model, "METRICS", ())
    if monitor is None or not metrics or monitor in metrics:
        return
    if hint := did_you_mean(monitor, metrics, lambda name: f"monitor={name}"):
        raise ValueError(f"monitor={monitor!r} is invalid: the model logs {', '.join(metrics)}; {hint}")


def check_monitor_mode(mode: Any) -> str:
    """``monitor_mode``: whether the best checkpoint has the least (``min``) or the most (``max``) of ``monitor``."""
    if mode not in MONITOR_MODES:
        raise ValueError(
            f"monitor_mode={mode!r} is invalid: expected min (the least monitor is best, a loss) or max (an accuracy)."
        )
    return mode


def check_checkpoint_every_n_steps(value: Any) -> int | None:
    """A positive number of optimizer steps, or None (checkpoints once an epoch)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(
            f"checkpoint_every_n_steps={value!r} is invalid: expected a positive number of optimizer steps, "
            "or null for one checkpoint an epoch."
        )
    return value


def check_seed(seed: Any) -> int:
    """``seed``: an integer."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} is invalid: expected an integer.")
    return seed


def check_ckpt_path(value: Any) -> Any:
    """``ckpt_path``: ``auto``, null, or a file that exists (Lightning would fail on a missing one
    only once the ranks are up)."""
    if value is None or value == "auto" or Path(str(value)).is_file():
        return value
    raise ValueError(
        f"ckpt_path={value!r} is invalid: no such file from {Path.cwd()}; expected the path of a checkpoint, "
        "auto (the run folder's newest good one, the default) or null (from scratch)."
    )


def check_compile(enabled: Any) -> bool:
    """``compile``: true or false."""
    if not isinstance(enabled, bool):
        raise ValueError(f"compile={enabled!r} is invalid: expected true or false.")
    return enabled


def check_sharded_precision(stage: Any, precision: Any) -> None:
    """``strategy.sharding.stage=2`` with a gradient scaler (``trainer.precision=16-mixed``) is refused
    here, before Lightning starts the ranks (the strategy refuses it too, but only in each rank)."""
    if stage == 2 and str(precision) in ("16-mixed", "16"):
        raise ValueError(
            f"trainer.precision={precision!r} with strategy.sharding.stage=2 is invalid: a gradient scaler checks for "
            "infs in each rank's gradients, and under stage 2 each rank holds only its own, so the ranks could "
            "disagree on skipping a step; expected trainer.precision=bf16-mixed or 32-true, or strategy.sharding.stage=1."
        )


def check_cpu_devices(accelerator: Any, devices: Any, cores: int | None = None) -> None:
    """On CPU, ``trainer.devices`` processes against the cores this process may run on: a warning
    above them, a ``ValueError`` above ``MAX_CPU_RANKS_PER_CORE`` per core."""
    if not _on_cpu(accelerator) or isinstance(devices, bool) or not isinstance(devices, int):
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
        # Imported here: the command line is checked before Lightning loads (lit_dp_recipes.cli).
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            f"trainer.devices={devices} starts more CPU processes than the {cores} cores this machine gives: "
            f"they share the cores, so each step takes longer (at most {bound} are accepted).",
            category=LitDPWarning,
        )


def check_accelerator_available(accelerator: Any) -> None:
    """A GPU accelerator where torch sees none: Lightning's refusal ("No supported gpu backend found!")
    names neither the key nor what to use. Checked as the run starts, not on the command line, so
    that a GPU command still composes on a CPU machine (tests/test_documented_commands.py)."""
    available = {
        "gpu": torch.cuda.is_available() or torch.backends.mps.is_available(),  # Lightning's "gpu": CUDA or Apple's MPS
        "cuda": torch.cuda.is_available(),
        "mps": torch.backends.mps.is_available(),
    }
    if not available.get(str(accelerator), True):
        raise ValueError(
            f"trainer.accelerator={accelerator!r} is invalid here: torch {torch.__version__} sees no such device on "
            "this machine; expected trainer=cpu (or trainer.accelerator=cpu), or a torch built for the GPU."
        )


def _on_cpu(accelerator: Any) -> bool:
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's limit), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def is_number(value: object) -> bool:
    """An int or a float (not a string such as ``abc``, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_fraction(value: object) -> bool:
    """A number strictly between 0 and 1 (not a string such as ``abc``, not a bool): a ``val_fraction``."""
    return is_number(value) and 0 < value < 1


def _check_batches(option: str, value: Any, least: int, what: str) -> None:
    """A count of batches as Lightning reads one: null, an integer (a float such as 100.0 is one), or
    a fraction of an epoch's; ``least`` is the smallest count (and the fraction is above 0 when it is 1)."""
    if value is None:
        return
    whole = is_number(value) and (isinstance(value, int) or (value > 1 and float(value).is_integer()))
    fraction = is_number(value) and not isinstance(value, int) and (least <= value <= 1 if least == 0 else 0 < value <= 1)
    if (whole and value >= least) or fraction:
        return
    share = "[0, 1]" if least == 0 else "(0, 1]"
    raise ValueError(
        f"{option}={value!r} is invalid: expected {what}: an integer >= {least}, a share of an epoch in {share}, or null."
    )


def _check_choice(option: str, value: object, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"{option}={value!r} is invalid: expected one of {', '.join(allowed)}.")
