"""The work behind every recipe: build everything from the config, validate, fit."""

from __future__ import annotations

import importlib.util
import logging
import warnings

import lightning.pytorch as pl
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig

from lit_dp_recipes.callbacks import CompileModel
from lit_dp_recipes.config import build_strategy, validate_trainer
from lit_dp_recipes.launch import use_job_launcher
from lit_dp_recipes.report import say
from lit_dp_recipes.resume import ResumableRun, check_checkpoint_every_n_steps, use_atomic_checkpoints

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit ``cfg.model`` on ``cfg.data`` with ``cfg.strategy``; returns the final logged metrics.

    Invalid options raise here, before Lightning starts any process: the strategy's options are
    validated once as the strategy is built, first, then the trainer section is checked.
    ``ckpt_path=auto`` resumes from the run folder's newest good checkpoint, rank 0 says where
    the run writes and how to resume it, and after a failure which checkpoint a rerun resumes
    from (``lit_dp_recipes.resume``).
    """
    strategy = use_atomic_checkpoints(build_strategy(cfg.strategy))
    validate_trainer(cfg)
    check_checkpoint_every_n_steps(cfg.get("checkpoint_every_n_steps"))
    run = ResumableRun(cfg)
    run.announce()
    ckpt_path = run.resolve(cfg.get("ckpt_path"))
    compile_callbacks = _compile_callbacks(cfg)
    _code_warnings_from_rank_zero_only()
    pl.seed_everything(cfg.seed, workers=True, verbose=rank_zero_only.rank == 0)
    datamodule = build_checked(cfg.data)
    model = build_checked(cfg.model)
    trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        logger=_loggers(cfg.get("logger")),
        callbacks=_callbacks(cfg) + compile_callbacks,
    )
    use_job_launcher(trainer.strategy)
    with run.fitting(ckpt_path):
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        say("final " + " ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items())))
    return metrics


def build_checked(node: DictConfig):
    """``instantiate(node)``, with a ``ValueError`` of the target raised as itself (it names the
    option and the value), not inside Hydra's ``InstantiationException``."""
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as error:
        if isinstance(error.__cause__, ValueError):
            raise error.__cause__ from None
        raise


def _compile_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """``compile: true`` compiles the model's forward in each rank with ``compile_backend``."""
    enabled = cfg.get("compile", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"compile={enabled!r} is invalid: expected true or false.")
    return [CompileModel(cfg.get("compile_backend", "inductor"))] if enabled else []


def _callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """``cfg.callbacks``, less a progress bar when ``trainer.enable_progress_bar=false`` (Lightning
    refuses a progress-bar callback then: the switch turns the recipe's own bar off too)."""
    callbacks = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None]
    if cfg.trainer.get("enable_progress_bar", True) is False:
        callbacks = [callback for callback in callbacks if not isinstance(callback, ProgressBar)]
    return callbacks


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
                log.info("logger.%s skipped: tensorboard is not installed (pip install 'lit_dp[tensorboard]')", name)
            continue
        loggers.append(instantiate(node))
    return loggers
