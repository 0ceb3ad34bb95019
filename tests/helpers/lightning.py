"""A small LightningModule and the Trainer settings the strategy tests share; lit_dp's registered names;
a check of the strategies' debug log."""

from __future__ import annotations

import atexit
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dp import DataParallel, PaddleDPStrategy


class Regressor(pl.LightningModule):
    def __init__(
        self, manual: bool = False, unused: bool = False, fail_rank: int | None = None, die: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.spare = nn.Linear(2, 2) if unused else None
        self.automatic_optimization = not manual
        self.fail_rank = fail_rank
        self.die = die
        self.wrapper = None

    def on_train_start(self) -> None:
        self.wrapper = type(self.trainer.strategy.model).__name__
        if self.trainer.world_size > 1:
            expected = DataParallel if isinstance(self.trainer.strategy, PaddleDPStrategy) else nn.Module
            assert isinstance(self.trainer.strategy.model, expected), self.wrapper

    def step_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.net(x) - y) ** 2).mean()

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and batch_idx == 1:
            if self.die:
                os._exit(7)  # a crash: no exception, no cleanup
            raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
        x, y = batch
        self.log("rank_mean", float(self.global_rank), sync_dist=True)
        if self.automatic_optimization:
            return self.step_loss(x, y)
        # Manual optimization: two micro-batches, the first accumulated without synchronisation.
        optimizer = self.optimizers()
        half = len(x) // 2
        with self.trainer.strategy.block_backward_sync():
            self.manual_backward(self.step_loss(x[:half], y[:half]))
        self.manual_backward(self.step_loss(x[half:], y[half:]))
        optimizer.step()
        optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 6, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        return DataLoader(TensorDataset(x, y), batch_size=8)


class DestroyGroupAtExit(pl.Callback):
    """For Lightning's own ``"ddp"`` strategies, the oracle: they leave the Gloo group alive, and a
    spawned rank then sometimes aborts at exit ("terminate called without an active exception",
    gloo's threads destroyed with the interpreter), failing a fit that finished. lit_dp's
    strategies destroy the group they created at exit themselves."""

    def setup(self, trainer, pl_module, stage) -> None:
        atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def trainer(strategy, tmp_path, **kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    options.update(kwargs)
    if isinstance(strategy, DDPStrategy) or (isinstance(strategy, str) and strategy.startswith("ddp")):
        options["callbacks"] = [*(options.get("callbacks") or []), DestroyGroupAtExit()]
    return pl.Trainer(strategy=strategy, **options)


def fit_weights(strategy, tmp_path, module=None, **kwargs) -> dict[str, torch.Tensor]:
    module = module or Regressor()
    trainer(strategy, tmp_path, **kwargs).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_same_weights(ours, theirs):
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], msg=lambda m: f"{key}: {m}")


def assert_logged_in_order(messages: list[str], expected: list[str]) -> None:
    """Each of ``expected`` is part of one of ``messages``, in this order (others may come between)."""
    remaining = iter(messages)
    for part in expected:
        found = any(part in message for message in remaining)
        assert found, f"{part!r} not logged in this order; the log:\n" + "\n".join(messages)


# Every name lit_dp registers: (start method, find_unused_parameters), those of Lightning's `ddp` twin.
REGISTERED = {
    "paddle_dp": ("popen", False),
    "paddle_dp_find_unused_parameters_false": ("popen", False),
    "paddle_dp_find_unused_parameters_true": ("popen", True),
    "paddle_dp_spawn": ("spawn", False),
    "paddle_dp_spawn_find_unused_parameters_false": ("spawn", False),
    "paddle_dp_spawn_find_unused_parameters_true": ("spawn", True),
    "paddle_dp_fork": ("fork", False),
    "paddle_dp_fork_find_unused_parameters_false": ("fork", False),
    "paddle_dp_fork_find_unused_parameters_true": ("fork", True),
    "paddle_dp_notebook": ("fork", False),
    "paddle_dp_notebook_find_unused_parameters_false": ("fork", False),
    "paddle_dp_notebook_find_unused_parameters_true": ("fork", True),
}
