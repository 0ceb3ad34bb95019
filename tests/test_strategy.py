"""Trainer(strategy="paddle_dp") against Trainer(strategy="ddp") on 2 CPU processes."""

from __future__ import annotations

import os
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lit_dp
from lit_dp import DataParallel, PaddleDPStrategy, PaddleEnvironment
from tests.distributed import run_ranks


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
    return pl.Trainer(strategy=strategy, **options)


def fit_weights(strategy, tmp_path, module=None, **kwargs) -> dict[str, torch.Tensor]:
    module = module or Regressor()
    trainer(strategy, tmp_path, **kwargs).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_same_weights(ours, theirs):
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], msg=lambda m: f"{key}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_same_weights_as_ddp(tmp_path, accumulate):
    ours = fit_weights("paddle_dp_spawn", tmp_path, accumulate_grad_batches=accumulate)
    theirs = fit_weights("ddp_spawn", tmp_path, accumulate_grad_batches=accumulate)
    assert_same_weights(ours, theirs)
    untrained = Regressor().state_dict()
    assert not torch.equal(ours["net.0.weight"], untrained["net.0.weight"]), "training changed nothing"


@pytest.mark.slow
def test_manual_optimization_matches_ddp(tmp_path):
    ours = fit_weights("paddle_dp_spawn", tmp_path, module=Regressor(manual=True))
    theirs = fit_weights("ddp_spawn", tmp_path, module=Regressor(manual=True))
    assert_same_weights(ours, theirs)


def test_sync_dist_logging_averages_over_ranks(tmp_path):
    run = trainer("paddle_dp_spawn", tmp_path, max_epochs=1, limit_train_batches=2)
    run.fit(Regressor())
    assert run.callback_metrics["rank_mean"].item() == pytest.approx(0.5)


@pytest.mark.slow
def test_checkpoint_resume_matches_uninterrupted_run(tmp_path):
    uninterrupted = fit_weights("paddle_dp_spawn", tmp_path / "a", max_epochs=4)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = trainer("paddle_dp_spawn", tmp_path / "b", enable_checkpointing=True, callbacks=[checkpoints])
    first.fit(Regressor())
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    assert not any(key.startswith(("_layers.", "module.")) for key in state), "wrapper prefix in checkpoint"
    resumed = Regressor()
    trainer("paddle_dp_spawn", tmp_path / "c", max_epochs=4).fit(resumed, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert_same_weights(resumed.state_dict(), uninterrupted)


def test_unused_parameter_error_names_the_strategy_option(tmp_path):
    with pytest.raises(Exception) as error:
        trainer("paddle_dp_spawn", tmp_path, max_epochs=1).fit(Regressor(unused=True))
    message = str(error.value)
    assert "spare.weight (missing on 2 of 2 ranks" in message
    assert "PaddleDPStrategy(find_unused_parameters=True)" in message


def test_one_rank_failing_fails_the_job_quickly_with_its_error(tmp_path):
    started = time.monotonic()
    with pytest.raises(Exception, match="deliberate failure on rank 1"):
        trainer(PaddleDPStrategy(start_method="spawn", timeout=30), tmp_path, max_epochs=1).fit(Regressor(fail_rank=1))
    assert time.monotonic() - started < 60


def test_one_rank_dying_fails_the_job_quickly(tmp_path):
    started = time.monotonic()
    with pytest.raises(Exception, match="process 1 terminated with exit code 7"):
        trainer(PaddleDPStrategy(start_method="spawn", timeout=30), tmp_path, max_epochs=1).fit(
            Regressor(fail_rank=1, die=True)
        )
    assert time.monotonic() - started < 60


def test_single_device_runs_without_a_process_group(tmp_path):
    module = Regressor()
    trainer("paddle_dp", tmp_path, devices=1, max_epochs=1, limit_train_batches=2).fit(module)
    assert module.wrapper == "Regressor"
    assert not dist.is_initialized()


def fit_twice_under_paddle_launcher(rank, tmp_path):
    assert isinstance(PaddleDPStrategy().cluster_environment, PaddleEnvironment)
    weights = []
    for _ in range(2):  # a second fit in the same process must work after teardown
        module = Regressor()
        trainer(PaddleDPStrategy(), tmp_path, max_epochs=1).fit(module)
        assert module.wrapper == "DataParallel"
        assert not dist.is_initialized(), "teardown must destroy the process group"
        weights.append(module.net[0].weight.sum().item())
    return weights


def test_paddle_launcher_variables_drive_lightning_and_a_second_fit_works(tmp_path):
    results = run_ranks(fit_twice_under_paddle_launcher, 2, str(tmp_path), timeout=120)
    assert results[0] == results[1]
    assert results[0][0] == pytest.approx(results[0][1])


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("comm_buffer_size", -1, "comm_buffer_size=-1 is invalid: expected a positive number of megabytes"),
        ("last_comm_buffer_size", 0, "last_comm_buffer_size=0 is invalid"),
        ("backend", "mpi", "backend='mpi' is invalid: expected one of auto, nccl, gloo"),
        ("nrings", 9, r"nrings=9 is invalid: expected an integer in \[1, 8\]"),
        ("timeout", -3, "timeout=-3 is invalid: expected a positive duration"),
        ("start_method", "thread", "start_method='thread' is invalid"),
        ("find_unused_parameters", "yes", "find_unused_parameters='yes' is invalid: expected True or False"),
    ],
)
def test_options_are_validated(option, value, message):
    with pytest.raises(ValueError, match=message):
        PaddleDPStrategy(**{option: value})


def test_import_registers_both_names():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["paddle_dp"]["init_params"]["start_method"] == "popen"
    assert StrategyRegistry["paddle_dp_spawn"]["init_params"]["start_method"] == "spawn"
    assert lit_dp.PaddleDPStrategy is StrategyRegistry["paddle_dp"]["strategy"]
