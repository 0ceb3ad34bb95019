"""The work behind every recipe: build everything from the config, validate, fit."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import warnings
from typing import Any

import lightning.pytorch as pl
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig

from lit_dp_recipes.callbacks import CompileModel, ProgressLines, draws_a_bar
from lit_dp_recipes.cli import CommandLineMistake
from lit_dp_recipes.config import (
    build_strategy,
    check_accelerator_available,
    check_checkpoint_every_n_steps,
    check_ckpt_path,
    check_compile,
    check_epoch_against_trainer,
    check_model_against_data,
    check_monitor,
    check_monitor_mode,
    check_seed,
    validate_trainer,
)
from lit_dp_recipes.launch import sweep_job, use_job_launcher
from lit_dp_recipes.report import metric, say
from lit_dp_recipes.resume import AUTO, NoUsableCheckpoint, ResumableRun, check_epochs_left, use_atomic_checkpoints
from lit_dp_recipes.spelling import did_you_mean

log = logging.getLogger(__name__)
# Lightning's tips for its other products ("Tip: ... try installing litlogger"), and who logs them.
LIGHTNING_TIP = "\N{ELECTRIC LIGHT BULB} Tip:"
LIGHTNING_TIP_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
CHECKPOINTS_EXIST = r"Checkpoint directory .* exists and is not empty"  # ModelCheckpoint's warning
# What Lightning says on a resume that the recipe arranged (ckpt_path=auto), about the run it resumes: its
# ModelCheckpoint's folder (an earlier run's, or the same), and callbacks the checkpoint has state of.
RESUME_WARNINGS = (r"The dirpath has changed from", r"Be aware that when using `ckpt_path`")
SEED_LOGGER = "lightning.fabric.utilities.seed"  # where Lightning's seed_everything says "Seed set to N"
# How Python names a keyword argument a callable does not take.
UNEXPECTED_ARGUMENT = re.compile(r"unexpected keyword argument '(\w+)'")


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit ``cfg.model`` on ``cfg.data`` with ``cfg.strategy``; returns the final logged metrics.

    Invalid options raise here, before Lightning starts any process: the strategy's options are
    validated once as the strategy is built, first, then the trainer section is checked.
    ``ckpt_path=auto`` resumes from the run folder's newest good checkpoint, rank 0 says where
    the run writes and how to resume it, and after a failure which checkpoint a rerun resumes
    from (``lit_dp_recipes.resume``).
    """
    _quiet_lightning()
    try:  # every refusal here comes before any rank starts: one line, no traceback (lit_dp_recipes.cli)
        strategy = use_atomic_checkpoints(build_strategy(cfg.strategy))
        validate_trainer(cfg)
        check_accelerator_available(cfg.trainer.get("accelerator"))
        check_checkpoint_every_n_steps(cfg.get("checkpoint_every_n_steps"))
        check_ckpt_path(cfg.get("ckpt_path"))
        check_seed(cfg.seed)
        if "monitor_mode" in cfg:
            check_monitor_mode(cfg.monitor_mode)
        compile_callbacks = _compile_callbacks(cfg)
        _code_warnings_from_rank_zero_only()
        # Said below, once everything is checked: a refusal is the only line a mistake prints.
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        _validate_by_the_last_step(cfg)
        datamodule = build_checked(cfg.data, "data")
        check_epoch_against_trainer(cfg.trainer, datamodule)
        model = build_checked(cfg.model, "model")
        check_model_against_data(datamodule, model)
        check_monitor(cfg.get("monitor"), model)
        trainer = build_checked(
            cfg.trainer,
            "trainer",
            enable_progress_bar=_progress_bar(cfg),
            strategy=strategy,
            logger=_loggers(cfg.get("logger")),
            callbacks=_callbacks(cfg) + compile_callbacks,
        )
        if rank_zero_only.rank == 0:
            logging.getLogger(SEED_LOGGER).info(f"Seed set to {cfg.seed}")  # Lightning's line, where it logs it
        run = ResumableRun(cfg)
        run.announce()
        ckpt_path = run.resolve(cfg.get("ckpt_path"))
        check_epochs_left(ckpt_path, cfg.trainer.get("max_epochs"))
    except (ValueError, NoUsableCheckpoint) as error:
        raise CommandLineMistake(str(error)) from None
    if ckpt_path is not None:
        # Resuming: the folder's checkpoints are what the run resumes from, not a folder reused by mistake
        # (Lightning's warning stays for a run that starts over in a folder that has some: ckpt_path=null).
        warnings.filterwarnings("ignore", message=CHECKPOINTS_EXIST)
    if ckpt_path is not None and cfg.get("ckpt_path") == AUTO:
        # The recipe chose the checkpoint and built the callbacks from the same config: the line saying what was
        # resumed is the story, not Lightning's notes on callbacks' folders and states, once per rank.
        for message in RESUME_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
    use_job_launcher(trainer.strategy)
    with sweep_job(), run.fitting(ckpt_path):
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        say(_final_line(trainer, metrics))
    return metrics


def _validate_by_the_last_step(cfg: DictConfig) -> None:
    """A run counted in steps whose ``trainer.val_check_interval`` exceeds ``trainer.max_steps`` would
    end without validating (Lightning validates every ``val_check_interval`` steps only): it
    validates at its last step instead, and says so."""
    trainer = cfg.trainer
    interval, max_steps = trainer.get("val_check_interval"), trainer.get("max_steps", -1)
    if trainer.get("check_val_every_n_epoch") is not None or not isinstance(interval, int) or isinstance(interval, bool):
        return
    if 0 < max_steps < interval:
        trainer.val_check_interval = max_steps
        say(f"validating at step {max_steps}, the last (trainer.max_steps={max_steps} < trainer.val_check_interval={interval})")


def _final_line(trainer: pl.Trainer, metrics: dict[str, float]) -> str:
    """``final name=value ...``; for a fit that had nothing left to do, why not."""
    if metrics:
        return "final " + " ".join(f"{name}={metric(value)}" for name, value in sorted(metrics.items()))
    limits = [f"trainer.max_steps={trainer.max_steps}"] if trainer.max_steps > 0 else []
    limits += [f"trainer.max_epochs={trainer.max_epochs}"] if trainer.max_epochs not in (None, -1) else []
    return (
        f"final: nothing trained: the checkpoint resumed is at step {trainer.global_step}, epoch {trainer.current_epoch}, "
        f"where {' and '.join(limits) or 'the run'} already stopped it; raise it to train on, or pass ckpt_path=null "
        "to start over"
    )


def build_checked(node: DictConfig, name: str, **arguments: Any) -> Any:
    """``instantiate(node, **arguments)``, with a ``ValueError`` of the target raised as itself (it
    names the option and the value), not inside Hydra's ``InstantiationException``; a key the target
    does not take (``+trainer.max_epoch=5``), Lightning's refusal of a value, a value of the wrong
    kind or a target that does not exist, as a ``ValueError`` naming ``name``'s key."""
    try:
        return instantiate(node, _convert_="all", **arguments)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ValueError) and str(cause).startswith(f"{name}."):  # ours: it names the key
            raise cause from None
        unexpected = UNEXPECTED_ARGUMENT.search(str(cause)) if isinstance(cause, TypeError) else None
        if unexpected:
            raise ValueError(_not_an_argument(name, unexpected.group(1), node)) from None
        if isinstance(cause, (ValueError, MisconfigurationException)):  # the target's own words (Lightning's)
            raise ValueError(_refused_by_the_target(name, node, cause)) from None
        if isinstance(cause, TypeError):  # a value of the wrong kind (logger.csv.save_dir=null)
            raise ValueError(f"{name}: {node.get('_target_')} refused its arguments: {cause}") from None
        if isinstance(cause, ImportError):  # a _target_ Hydra cannot find
            raise ValueError(f"{name}._target_={node.get('_target_')!r} is invalid: expected an importable class or function.") from None
        raise


def _refused_by_the_target(name: str, node: DictConfig, refusal: Exception) -> str:
    """The target's own words, after the key and value they are about where they name one key of
    ``node`` (Lightning's "logging_interval should be `step` or `epoch`" is about
    ``callbacks.lr_monitor.logging_interval``)."""
    words = str(refusal).strip()
    named = [key for key in node if not str(key).startswith("_") and re.search(rf"\b{re.escape(str(key))}\b", words)]
    if len(named) != 1:
        return f"{name}: {words}"
    return f"{name}.{named[0]}={node[named[0]]!r} is invalid: {words}"


def _not_an_argument(name: str, key: str, node: DictConfig) -> str:
    target = node.get("_target_")
    accepted = [p for p in inspect.signature(get_class(target)).parameters if p not in ("self", "args", "kwargs")]
    hint = did_you_mean(key, accepted, lambda c: f"{name}.{c}") or f"it takes {', '.join(accepted)}."
    return f"{name}.{key} is not an argument of {target}: {hint}"


def _compile_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """``compile: true`` compiles the model's forward in each rank with ``compile_backend``."""
    enabled = check_compile(cfg.get("compile", False))
    return [CompileModel(cfg.get("compile_backend", "inductor"))] if enabled else []


def _callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """``cfg.callbacks``, less a progress bar when ``trainer.enable_progress_bar=false`` (Lightning
    refuses a progress-bar callback then: the switch turns the recipe's own bar off too), and with
    ``ProgressLines`` in the bar's place where no bar would be seen (``_progress_bar``)."""
    nodes = (cfg.get("callbacks") or {}).items()
    callbacks = [build_checked(node, f"callbacks.{name}") for name, node in nodes if node is not None]
    if not _progress_bar(cfg):
        callbacks = [callback for callback in callbacks if not isinstance(callback, ProgressBar)]
        if cfg.trainer.get("enable_progress_bar", True) is not False:
            callbacks.append(ProgressLines())
    return callbacks


def _progress_bar(cfg: DictConfig) -> bool:
    """Whether the run draws a progress bar: where asked, and only where it is seen, standard output
    on a terminal that reports its width (``draws_a_bar``; Lightning's bars write there, not to
    standard error)."""
    return cfg.trainer.get("enable_progress_bar", True) is not False and draws_a_bar()


def _quiet_lightning() -> None:
    """Leave out what Lightning prints that is not about this run: its tips for other products, and
    its own use of a name torch deprecated (Lightning 2.6 with torch 2.13; no setting of ours changes it)."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    for name in LIGHTNING_TIP_LOGGERS:
        logging.getLogger(name).addFilter(_no_tips)


def _no_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(LIGHTNING_TIP)


def _code_warnings_from_rank_zero_only() -> None:
    """Deprecation and future warnings are about the code, the same in every rank: rank 0 shows them once."""
    if rank_zero_only.rank != 0:
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category)


def _loggers(nodes: DictConfig | None) -> list[pl.loggers.Logger] | bool:
    """The configured loggers; TensorBoard only where it is installed (it is an optional extra)."""
    if not nodes:
        return False
    loggers = []
    for name, node in nodes.items():
        if node._target_.endswith("TensorBoardLogger") and importlib.util.find_spec("tensorboard") is None:
            if rank_zero_only.rank == 0:
                # Debug only: the CSV log is there, and the docs say TensorBoard's is written where installed.
                log.debug("logger.%s skipped: tensorboard is not installed (pip install 'lit_dp[tensorboard]')", name)
            continue
        loggers.append(build_checked(node, f"logger.{name}"))
    return loggers
