"""Trainer(strategy="paddle_dp") against Trainer(strategy="ddp") on 2 CPU processes."""

from __future__ import annotations

import logging
import time
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch.utils.data import DataLoader, DistributedSampler

from lit_dp import PaddleDPStrategy, PaddleEnvironment
from lit_dp.job import process_group
from tests.helpers.distributed import run_ranks
from tests.helpers.documented import ROOT
from tests.helpers.lightning import (
    REGISTERED,
    Regressor,
    assert_logged_in_order,
    assert_same_weights,
    fit_weights,
    trainer,
)


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


@pytest.mark.slow  # end to end: a Lightning fit on 2 spawned ranks
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


LIGHTNING_SENTENCE = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step."
)


@pytest.mark.slow
def test_unused_parameter_error_names_the_strategy_option(tmp_path):
    with pytest.raises(Exception) as error:
        trainer("paddle_dp_spawn", tmp_path, max_epochs=1).fit(Regressor(unused=True))
    message = str(error.value)
    assert message.startswith(LIGHTNING_SENTENCE), message
    assert "spare.weight (missing on 2 of 2 ranks" in message
    assert "strategy='paddle_dp_find_unused_parameters_true'" in message
    assert "PaddleDPStrategy(find_unused_parameters=True)" in message


@pytest.mark.slow
def test_one_rank_failing_fails_the_job_quickly_with_its_error(tmp_path):
    started = time.monotonic()
    with pytest.raises(Exception, match="deliberate failure on rank 1"):
        trainer(PaddleDPStrategy(start_method="spawn", timeout=30), tmp_path, max_epochs=1).fit(Regressor(fail_rank=1))
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_one_rank_dying_fails_the_job_quickly(tmp_path):
    started = time.monotonic()
    with pytest.raises(Exception, match="process 1 terminated with exit code 7"):
        trainer(PaddleDPStrategy(start_method="spawn", timeout=30), tmp_path, max_epochs=1).fit(
            Regressor(fail_rank=1, die=True)
        )
    assert time.monotonic() - started < 60


class UserSampler(Regressor):
    """User code that calls torch.distributed unconditionally, as many datamodules and callbacks do."""

    def train_dataloader(self):
        dataset = super().train_dataloader().dataset
        return DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, shuffle=False))


class RecordGroup(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.seen = (dist.get_rank(), dist.get_world_size(), dist.get_backend())


def test_one_device_is_a_one_rank_group_like_ddp(tmp_path):
    """devices=1: a group of one rank and a wrapped model, so user code calling torch.distributed runs."""
    weights = {}
    for name in ("paddle_dp", "ddp"):
        module, record = UserSampler(), RecordGroup()
        trainer(name, tmp_path, devices=1, max_epochs=1, callbacks=[record]).fit(module)
        assert record.seen == (0, 1, "gloo"), name
        weights[name] = module.state_dict()
        # As after "ddp", the group outlives the fit; "ddp" then adopts the one paddle_dp created.
        assert dist.is_initialized() and dist.get_world_size() == 1, name
        if name == "paddle_dp":
            assert module.wrapper == "DataParallel"
    assert_same_weights(weights["paddle_dp"], weights["ddp"])
    assert not torch.equal(weights["ddp"]["net.0.weight"], Regressor().state_dict()["net.0.weight"]), "no training"


def test_one_device_unused_parameter_raises_as_on_many(tmp_path):
    with pytest.raises(RuntimeError) as error:
        trainer("paddle_dp", tmp_path, devices=1, max_epochs=1).fit(Regressor(unused=True))
    message = str(error.value)
    assert message.startswith(LIGHTNING_SENTENCE), message
    assert "spare.weight (missing on 1 of 1 ranks, including this one)" in message
    trainer("paddle_dp_find_unused_parameters_true", tmp_path, devices=1, max_epochs=1).fit(Regressor(unused=True))


def test_backend_passes_through_to_the_process_group(tmp_path):
    record = RecordGroup()
    strategy = PaddleDPStrategy(backend=" CPU:Gloo ")  # torch's per-device form
    trainer(strategy, tmp_path, devices=1, max_epochs=1, limit_train_batches=1, callbacks=[record]).fit(Regressor())
    assert strategy.process_group_backend == "cpu:gloo"
    assert record.seen == (0, 1, "cpu:gloo")
    per_device = "cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "cpu:gloo,cuda:gloo"
    assert PaddleDPStrategy(backend=per_device).process_group_backend == per_device
    assert PaddleDPStrategy(backend="GLOO").process_group_backend == "gloo"


class WithTestStep(Regressor):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", self.step_loss(x, y), sync_dist=True)

    def test_dataloader(self):
        return self.train_dataloader()


def fit_test_and_fit_again_under_paddle_launcher(rank, tmp_path):
    """As under "ddp", the group outlives each run: user code calls torch.distributed after `fit`,
    and `test` and a second `fit` adopt the group instead of meeting the other ranks again."""
    assert isinstance(PaddleDPStrategy().cluster_environment, PaddleEnvironment)
    weights = []
    with mock.patch("lit_dp.job.process_group._rendezvous", wraps=process_group._rendezvous) as rendezvous:
        for _ in range(2):
            module, run = WithTestStep(), trainer(PaddleDPStrategy(), tmp_path, max_epochs=1)
            run.fit(module)
            assert module.wrapper == "DataParallel"
            run.strategy.barrier()
            ranks = torch.tensor([float(rank)])
            dist.all_reduce(ranks)
            assert ranks.item() == 1.0, "a user's collective after fit"
            run.test(module, verbose=False)
            weights.append(module.net[0].weight.sum().item())
    assert rendezvous.call_count == 1, "test and the second fit must adopt the live group"
    return weights, run.callback_metrics["test_loss"].item()


@pytest.mark.slow  # end to end: a fit, a test and a second fit on 2 ranks started with Paddle's variables
def test_paddle_launcher_variables_drive_lightning_and_the_group_outlives_each_run(tmp_path):
    results = run_ranks(fit_test_and_fit_again_under_paddle_launcher, 2, str(tmp_path), timeout=180)
    assert results[0] == results[1]
    weights, _ = results[0]
    assert weights[0] == pytest.approx(weights[1])


def launcher_start_method(launcher) -> str:
    if isinstance(launcher, _SubprocessScriptLauncher):
        return "popen"
    assert isinstance(launcher, _MultiProcessingLauncher), type(launcher)
    return launcher._start_method


def test_the_families_mirror_lightnings_ddp_names():
    ours = {name for name in StrategyRegistry.available_strategies() if name.startswith("paddle_dp")}
    lightning = {name for name in StrategyRegistry.available_strategies() if name.startswith("ddp")}
    assert ours == set(REGISTERED)
    assert ours == {"paddle_dp" + name[len("ddp") :] for name in lightning}
    for name, (start_method, find_unused) in REGISTERED.items():
        twin = StrategyRegistry["ddp" + name[len("paddle_dp") :]]["init_params"]
        assert (twin["start_method"], twin.get("find_unused_parameters", False)) == (start_method, find_unused), name


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_every_name_resolves_case_insensitively(name):
    start_method, find_unused = REGISTERED[name]
    for spelling in (name, name.upper()):
        strategy = pl.Trainer(strategy=spelling, accelerator="cpu", devices=2, logger=False).strategy
        assert type(strategy) is PaddleDPStrategy, spelling
        assert launcher_start_method(strategy.launcher) == start_method, spelling
        assert strategy.find_unused_parameters is find_unused, spelling


def test_ddp_strategy_arguments_move_by_renaming_the_class():
    moved = PaddleDPStrategy(bucket_cap_mb=5, process_group_backend="gloo", find_unused_parameters=True)
    assert (moved.options.comm_buffer_size, moved.process_group_backend, moved.find_unused_parameters) == (5, "gloo", True)
    with pytest.raises(ValueError, match=r"comm_buffer_size=10 and bucket_cap_mb=5 are the same option"):
        PaddleDPStrategy(comm_buffer_size=10, bucket_cap_mb=5)
    with pytest.raises(ValueError, match=r"bucket_cap_mb=-1 is invalid"):
        PaddleDPStrategy(bucket_cap_mb=-1)


def test_a_mocked_init_process_group_sets_up_like_ddp():
    # Lightning's own tests, and users', mock the process-group creation; lit_dp must not need the group.
    strategy = pl.Trainer(strategy=PaddleDPStrategy(backend="gloo"), accelerator="cpu", devices=1, logger=False).strategy
    with mock.patch("torch.distributed.init_process_group") as init:
        strategy.setup_environment()
    assert init.call_args.kwargs["world_size"] == 1 and init.call_args.args[0] == "gloo"


def test_debug_log_shows_each_step_of_setup_and_teardown(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="lit_dp")
    strategy = PaddleDPStrategy(uneven_inputs=True)
    trainer(strategy, tmp_path, devices=1, max_epochs=1, limit_train_batches=2).fit(Regressor())
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("lit_dp.strategies")]
    assert_logged_in_order(
        messages,
        [
            "PaddleDPStrategy: setting up distributed",
            "PaddleDPStrategy: creating the process group: rank 0 of 1 from LightningEnvironment, backend gloo "
            "(backend=auto, device cpu), timeout 0:30:00, 1 ring(s)",
            "PaddleDPStrategy: setting up for fit",
            "PaddleDPStrategy: wrapping Regressor in lit_dp.DataParallel with Options(comm_buffer_size=25.0,",
            "PaddleDPStrategy: no hang watchdog (hang_timeout=300.0, world size 1)",
            "uneven inputs: off (world size 1)",
            "PaddleDPStrategy: tearing down strategy",
            "PaddleDPStrategy: unwrapping the model from lit_dp.DataParallel",
            "PaddleDPStrategy: leaving the process group alive, as \"ddp\" does",
        ],
    )
    # docs/strategy.md's "The debug log" shows this run: each line's logger and message, in order.
    logged = [f"{record.name} {record.getMessage()}" for record in caplog.records if record.name.startswith("lit_dp")]
    documented = (ROOT / "docs" / "strategy.md").read_text().split("## The debug log")[1].split("```")[1]
    shown = [line.split(", ...)")[0] for line in documented.strip().splitlines()]  # "...)": options left out
    assert len(shown) == 9 and all(line.startswith("lit_dp.strategies.") for line in shown), shown
    assert_logged_in_order(logged, shown)


class RecordBufferSize(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen = (trainer.strategy.comm_buffer_size, trainer.strategy.model.comm_buffer_size)


def test_comm_buffer_size_is_the_size_in_effect_and_after_auto_the_tuned_one(tmp_path):
    """docs/observability.md: after comm_buffer_size=auto, the strategy returns the tuned size."""
    assert PaddleDPStrategy(comm_buffer_size=5).comm_buffer_size == 5
    strategy, record = PaddleDPStrategy(comm_buffer_size="auto"), RecordBufferSize()
    assert strategy.comm_buffer_size == "auto"  # nothing tuned, nothing wrapped yet
    trainer(strategy, tmp_path, devices=1, max_epochs=1, limit_train_batches=3, callbacks=[record]).fit(Regressor())
    chosen = strategy.tuned_comm_buffer_size
    assert isinstance(chosen, (int, float)), "a one-bucket model settles at its first step"
    assert record.seen == (chosen, chosen)
    assert strategy.comm_buffer_size == chosen  # kept after the fit, as for checkpoints
