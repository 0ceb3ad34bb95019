"""The work behind every recipe: build everything from the config, validate, fit."""

from __future__ import annotations

import importlib.util
import logging

import lightning.pytorch as pl
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from lit_dp_recipes.callbacks import CompileModel
from lit_dp_recipes.config import build_strategy, validate_trainer
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
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = build_checked(cfg.data)
    model = build_checked(cfg.model)
    trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        logger=_loggers(cfg.get("logger")),
        callbacks=[instantiate(node) for node in (cfg.get("callbacks") or {}).values()] + compile_callbacks,
    )
    with run.fitting(ckpt_path):
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print("[lit_dp] final " + " ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items())), flush=True)
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


def _loggers(nodes: DictConfig | None) -> list[pl.loggers.Logger] | bool:
    """The configured loggers; TensorBoard only where it is installed (it is an optional extra)."""
    if not nodes:
        return False
    loggers = []
    for name, node in nodes.items():
        if node._target_.endswith("TensorBoardLogger") and importlib.util.find_spec("tensorboard") is None:
            log.info("logger.%s skipped: tensorboard is not installed (pip install 'lit_dp[tensorboard]')", name)
            continue
        loggers.append(instantiate(node))
    return loggers
