"""Checkpoints in both formats, through both front doors, resumed exactly (``lit_dp.strategies.checkpointing``).

The oracle is the uninterrupted run: a fit (or a Fabric loop) stopped at a checkpoint and resumed from it
ends with the uninterrupted run's weights, bit for bit (the resumed run replays the same operations on the
same values), on every rank, for data parallelism, ZeRO-2 and DiLoCo saved between two syncs, with
``state_dict_type="full"`` (one file) and ``"sharded"`` (a folder every rank writes its part of), written
synchronously and in the background. Across world sizes, ZeRO-2 saved sharded at 4 ranks and resumed at 2
ends where the same checkpoint saved as one file and resumed at 2 ends; LocalSGD says what was lost.

Every Trainer fit of one world size runs in one launch (Paddle's launcher variables make the strategy join
the existing processes), since a spawn costs seconds here; the Fabric loops in one forking launch per mode.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn

import lit_dp
from lit_dp import PaddleDPStrategy
from lit_dp.checkpoint.atomic import PARTIAL_MARKER
from lit_dp.checkpoint.sharded import is_sharded
from lit_dp_recipes.resume import Checkpoint, read_checkpoint
from tests.helpers.distributed import launch_forking, run_ranks
from tests.helpers.lightning import Regressor, trainer
from tests.helpers.recipes import ROOT

# 64 samples in batches of 8: 4 optimizer steps an epoch on 2 ranks, 2 on 4. DiLoCo with K=4 after one
# warm-up step syncs after steps 5, 9, 13: the checkpoint after epoch 2 (step 8) is between two syncs.
MODES = {
    "dp": {},
    "zero2": {"sharding_stage": 2},
    "diloco": {"local_sgd_steps": 4, "local_sgd_warmup_steps": 1, "local_sgd_outer": "nesterov"},
}
# (state_dict_type, how the save is made asynchronous: None, the option, or Lightning's plugin)
SAVES = [("full", None), ("sharded", None), ("full", "plugin"), ("sharded", "option")]


class AdamRegressor(Regressor):
    """AdamW: a state per parameter, which a resume that lost it would show. Under LocalSGD it keeps the traffic
    statistics at the end of the fit (before the last average)."""

    traffic: dict = {}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)

    def on_train_end(self):
        local_sgd = self.trainer.strategy.local_sgd
        self.traffic = local_sgd.traffic() if local_sgd is not None else {}


def _fit(root: Path, epochs: int, mode: str, state_dict_type: str = "full", ckpt_path: Path | None = None,
         save: bool = False, asynchronous: str | None = None, devices: int = 2) -> dict[str, torch.Tensor]:  # fmt: skip
    module = AdamRegressor()
    strategy = PaddleDPStrategy(state_dict_type=state_dict_type, async_save=asynchronous == "option", **MODES[mode])
    callbacks = [ModelCheckpoint(dirpath=root / "checkpoints", save_last=True)] if save else []
    plugins = [AsyncCheckpointIO()] if asynchronous == "plugin" else []
    run = trainer(strategy, root, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=save, plugins=plugins,
                  devices=devices)  # fmt: skip
    if asynchronous == "plugin":
        assert run.strategy._checkpointing.asynchronous(run.strategy.checkpoint_io)
    run.fit(module, ckpt_path=ckpt_path)
    return {name: value.clone() for name, value in module.state_dict().items()}, module.traffic


def _assert_equal(resumed: dict, uninterrupted: dict, label: str) -> None:
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), f"{label}: {name} differs by {(resumed[name] - value).abs().max()}"


def trainer_resumes(rank: int, tmp_path: str, modes: list[str], saves: list) -> dict[str, bool]:
    """Each mode: 4 epochs uninterrupted; 2 epochs saving, then resumed to 4, for each kind of save."""
    tmp = Path(tmp_path)
    checked = {}
    for mode in modes:
        uninterrupted, traffic = _fit(tmp / mode / "whole", 4, mode)
        for state_dict_type, asynchronous in saves:
            name = f"{mode}-{state_dict_type}-{asynchronous or 'sync'}"
            _fit(tmp / name / "first", 2, mode, state_dict_type, save=True, asynchronous=asynchronous)
            last = tmp / name / "first" / "checkpoints" / "last.ckpt"
            assert is_sharded(last) == (state_dict_type == "sharded"), f"{name}: {last}"
            resumed, resumed_traffic = _fit(tmp / name / "resumed", 4, mode, state_dict_type, ckpt_path=last)
            _assert_equal(resumed, uninterrupted, f"rank {rank}, {name}")
            # LocalSGD's statistics count the whole run, the syncs before the checkpoint included.
            counted = ("syncs", "bytes_per_sync", "bytes_per_step")
            assert mode != "diloco" or traffic["syncs"] == 3, traffic  # after steps 5, 9 and 13: two after the checkpoint
            assert [resumed_traffic.get(k) for k in counted] == [traffic.get(k) for k in counted], (name, resumed_traffic)
            checked[name] = True
    return checked


def test_diloco_saved_sharded_between_syncs_resumes_exactly_under_the_trainer(tmp_path):
    results = run_ranks(trainer_resumes, 2, str(tmp_path), ["diloco"], [("sharded", None)], timeout=300)
    assert results == {rank: {"diloco-sharded-sync": True} for rank in (0, 1)}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_mode_and_format_resumes_exactly_under_the_trainer(tmp_path):
    results = run_ranks(trainer_resumes, 2, str(tmp_path), list(MODES), SAVES, timeout=1400)
    assert results[0] == results[1] and len(results[0]) == len(MODES) * len(SAVES)


# --- Fabric ---------------------------------------------------------------------------------------


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * step + rank))
    return x, x.sum(dim=1, keepdim=True).sin()


def _fabric_steps(fabric: Fabric, path: str, start: int, stop: int, total: int) -> list[torch.Tensor]:
    """Steps ``start`` to ``stop`` of a loop of ``total``; a start past 0 loads ``path``, a stop short of the end
    saves it. Returns the weights after ``fabric.strategy.teardown()``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.02))
    if start:
        assert fabric.load(path, {"model": model, "optimizer": optimizer}) == {"step": start}
    for step in range(start, stop):
        x, y = _batch(fabric.global_rank, step)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    if stop < total:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": stop})
    fabric.strategy.teardown()
    return [p.detach().clone() for p in model.parameters()]


def _fabric_loop(fabric: Fabric, path: str, saved_at: int, total: int) -> bool:
    uninterrupted = _fabric_steps(fabric, path, 0, total, total)
    _fabric_steps(fabric, path, 0, saved_at, total)
    resumed = _fabric_steps(fabric, path, saved_at, total, total)
    for index, (ours, theirs) in enumerate(zip(resumed, uninterrupted)):
        assert torch.equal(ours, theirs), f"rank {fabric.global_rank}: parameter {index} differs after the resume"
    return is_sharded(path)


def _fabric_launch(mode: str, state_dict_type: str, asynchronous: bool, path: str) -> bool:
    """Rank 0's outcome (Fabric's launch returns it; every rank checked its own): whether the checkpoint was a folder."""
    options = {"sharding_stage": 2} if mode == "zero2" else dict(MODES[mode])
    options.pop("local_sgd_warmup_steps", None)
    strategy = lit_dp.fabric.PaddleDPStrategy(state_dict_type=state_dict_type, async_save=asynchronous,
                                              start_method="fork", **options)  # fmt: skip
    # DiLoCo K=4: syncs after steps 4, 8, 12; saved after step 6, between two.
    return Fabric(strategy=strategy, accelerator="cpu", devices=2).launch(_fabric_loop, path, 6, 12)


def test_fabric_saves_diloco_sharded_between_syncs_and_resumes_exactly(tmp_path):
    assert launch_forking(_fabric_launch, "diloco", "sharded", False, str(tmp_path / "ckpt"), timeout=240) is True


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("state_dict_type", "asynchronous"), [("full", False), ("sharded", False), ("sharded", True)])
def test_fabric_resumes_exactly_in_every_mode_and_format(tmp_path, mode, state_dict_type, asynchronous):
    sharded = launch_forking(_fabric_launch, mode, state_dict_type, asynchronous, str(tmp_path / "ckpt"), timeout=300)
    assert sharded == (state_dict_type == "sharded")


# --- Another world size -----------------------------------------------------------------------------


def zero_saved_at_four(rank: int, tmp_path: str) -> None:
    tmp = Path(tmp_path)
    for state_dict_type in ("full", "sharded"):
        _fit(tmp / f"four-{state_dict_type}", 2, "zero2", state_dict_type, save=True, devices=4)
    folder = tmp / "four-sharded" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in folder.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    # DiLoCo saved by two ranks between syncs, resumed by four: ranks 2-3 start from the last sync's model.
    _fit(tmp / "diloco-four", 3, "diloco", "sharded", ckpt_path=tmp / "diloco-two" / "checkpoints" / "last.ckpt", devices=4)


def zero_resumed_at_two(rank: int, tmp_path: str) -> dict[str, dict[str, list]]:
    tmp = Path(tmp_path)
    resumed = {
        state_dict_type: _fit(tmp / f"two-{state_dict_type}", 4, "zero2", state_dict_type,
                              ckpt_path=tmp / f"four-{state_dict_type}" / "checkpoints" / "last.ckpt")[0]  # fmt: skip
        for state_dict_type in ("full", "sharded")
    }
    _assert_equal(resumed["sharded"], resumed["full"], f"rank {rank}, ZeRO-2 resumed at 2 ranks from 4")
    return {kind: {name: value.tolist() for name, value in weights.items()} for kind, weights in resumed.items()}


def diloco_saved_at_two(rank: int, tmp_path: str) -> None:
    _fit(Path(tmp_path) / "diloco-two", 2, "diloco", "sharded", save=True)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_zero2_saved_sharded_at_four_ranks_resumes_at_two_as_the_full_file_does(tmp_path, caplog):
    run_ranks(diloco_saved_at_two, 2, str(tmp_path), timeout=300)
    run_ranks(zero_saved_at_four, 4, str(tmp_path), timeout=600)
    results = run_ranks(zero_resumed_at_two, 2, str(tmp_path), timeout=400)
    assert results[0] == results[1]  # each rank checked the two resumes equal, bit for bit
    # At one rank (this process): the DiLoCo checkpoint of two ranks between syncs says what is lost.
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        module = AdamRegressor()
        checkpoint = tmp_path / "diloco-two" / "checkpoints" / "last.ckpt"
        run = trainer(PaddleDPStrategy(state_dict_type="sharded", **MODES["diloco"]), tmp_path / "one", devices=1, max_epochs=3)
        run.fit(module, ckpt_path=checkpoint)
    lines = [record.getMessage() for record in caplog.records if "LocalSGD" in record.getMessage()]
    assert lines == [
        "[lit_dp] LocalSGD: the checkpoint holds 2 ranks' models at step 8, between syncs (the last after step 5), "
        "this run has 1: rank 0 resumes its own; the local steps of rank 1 since step 5 are lost."
    ], lines


# --- A crash during an asynchronous save ------------------------------------------------------------


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_crash_during_an_asynchronous_save_leaves_the_previous_checkpoint(tmp_path, state_dict_type):
    script = Path(__file__).parent / "scripts" / "async_save_killed.py"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(script), str(tmp_path), state_dict_type], capture_output=True,
                            text=True, timeout=300, env=environment)  # fmt: skip
    assert result.returncode == -signal.SIGKILL, result.stdout[-2000:] + result.stderr[-4000:]
    folder = tmp_path / "checkpoints"
    partial = [path.name for path in folder.iterdir() if PARTIAL_MARKER in path.name]
    assert len(partial) == 1 and partial[0].startswith(".epoch=1-step=16.ckpt"), sorted(p.name for p in folder.iterdir())
    # The second epoch's save died in its write: the checkpoints are the first epoch's, whole, and resume.
    found = {path.name: read_checkpoint(path) for path in folder.glob("*.ckpt")}
    assert found.keys() == {"epoch=0-step=8.ckpt", "last.ckpt"}, found
    for chosen in found.values():
        assert isinstance(chosen, Checkpoint) and chosen.step == 8, chosen
        assert is_sharded(chosen.path) == (state_dict_type == "sharded")
    last = folder / "last.ckpt"
    module = AdamRegressor()
    resumed = trainer(PaddleDPStrategy(state_dict_type=state_dict_type), tmp_path / "resumed", devices=1, max_epochs=2)
    resumed.fit(module, ckpt_path=last)
    assert resumed.global_step == 16


def test_a_plugin_with_a_writer_of_its_own_is_refused_with_sharded_before_any_step(tmp_path):
    from tests.strategies.test_checkpoint_io import RecordingCheckpointIO

    message = r"state_dict_type='sharded' with the checkpoint plugin RecordingCheckpointIO, which writes its own way"
    run = trainer(PaddleDPStrategy(state_dict_type="sharded"), tmp_path, devices=1, plugins=[RecordingCheckpointIO()])
    module = AdamRegressor()
    with pytest.raises(ValueError, match=message):
        run.fit(module)
    assert run.global_step == 0
    fabric = Fabric(strategy=lit_dp.fabric.PaddleDPStrategy(state_dict_type="sharded"), plugins=[RecordingCheckpointIO()],
                    accelerator="cpu", devices=1)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        fabric.launch()
