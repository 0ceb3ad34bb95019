"""``sharding_stage`` through the Trainer, Fabric and the Hydra config, against the unsharded runs.

Every Trainer fit runs in one 2-rank launch (Paddle's launcher variables make the strategy join
the existing processes, as under Paddle's launcher), since a spawn costs seconds here. The
oracle is the unsharded fit: weights and optimizer state within torch.testing's tolerances
(sharding only reorders the averages' and the clipping norm's sums).
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lit_dp import PaddleDPStrategy, ShardedOptimizer, fabric
from tests.helpers.distributed import launch_forking, run_ranks
from tests.helpers.lightning import Regressor, assert_same_weights, trainer

CLIP = 1e-3  # far below the gradients' norm: clipping acts at every step


class Scheduled(Regressor):
    """AdamW with a step schedule, both as configure_optimizers returns them."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)}


def optimizer_state(path) -> dict:
    return torch.load(path, weights_only=True)["optimizer_states"][0]


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys() and theirs["state"]
    for index, state in theirs["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["state"][index][key], value, msg=lambda m: f"{index}.{key}: {m}")


def fit(tmp_path, name, stage, ckpt_path=None, max_epochs=2, callbacks=(), overlap=False, manual=False, **kwargs):
    module = Scheduled(manual=manual)
    if not manual:  # Lightning refuses both under manual optimization
        kwargs.update(gradient_clip_val=CLIP, accumulate_grad_batches=2)
    strategy = PaddleDPStrategy(sharding_stage=stage, sharding_overlap=overlap)
    run = trainer(
        strategy, tmp_path / name, max_epochs=max_epochs, callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks), **kwargs,
    )  # fmt: skip
    run.fit(module, ckpt_path=ckpt_path)
    if stage is not None:  # after fit, the optimizer configure_optimizers built, as the model is unwrapped
        assert not isinstance(run.optimizers[0], ShardedOptimizer)
    run.save_checkpoint(tmp_path / f"{name}.ckpt")  # after fit, as under "ddp"
    return {k: v.clone() for k, v in module.state_dict().items()}, tmp_path / f"{name}.ckpt"


def sharded_fits(rank, tmp_path):
    from pathlib import Path

    tmp_path = Path(tmp_path)
    plain, plain_ckpt = fit(tmp_path, "plain", None)
    for stage, overlap in ((1, True), (2, False)):
        weights, ckpt = fit(tmp_path, f"stage{stage}", stage, overlap=overlap)
        assert_same_weights(weights, plain)
        if rank == 0:
            assert_same_state(optimizer_state(ckpt), optimizer_state(plain_ckpt))
    manual_plain, _ = fit(tmp_path, "manual_plain", None, manual=True)
    manual_sharded, _ = fit(tmp_path, "manual_stage2", 2, manual=True)
    assert_same_weights(manual_sharded, manual_plain)
    bf16_plain, _ = fit(tmp_path, "bf16_plain", None, precision="bf16-mixed")
    bf16_sharded, _ = fit(tmp_path, "bf16_stage2", 2, precision="bf16-mixed")
    assert_same_weights(bf16_sharded, bf16_plain)

    # Resume: 2 epochs, then 2 more from the checkpoint, sharded and (loading the sharded
    # checkpoint without sharding) unsharded: both equal 4 uninterrupted sharded epochs.
    uninterrupted, uninterrupted_ckpt = fit(tmp_path, "four", 2, max_epochs=4)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "every", save_last=True)
    fit(tmp_path, "first_two", 2, callbacks=[checkpoints])
    last = tmp_path / "every" / "last.ckpt"
    for stage in (2, None):
        resumed, resumed_ckpt = fit(tmp_path, f"resumed_{stage}", stage, ckpt_path=last, max_epochs=4)
        assert_same_weights(resumed, uninterrupted)
        if rank == 0:
            assert_same_state(optimizer_state(resumed_ckpt), optimizer_state(uninterrupted_ckpt))
    return True


@pytest.mark.slow
def test_trainer_fits_with_sharding_equal_the_unsharded_fit(tmp_path):
    assert run_ranks(sharded_fits, 2, str(tmp_path), timeout=240) == {0: True, 1: True}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def fabric_run(run: Fabric, path: str | None) -> dict:
    net = Net()
    model, optimizer = run.setup(net, torch.optim.Adam(net.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(run.global_rank)
    for _ in range(3):
        x = torch.randn(8, 6, generator=generator)
        run.backward(((model(x) - x.sum(1, keepdim=True)) ** 2).mean())
        norm = run.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    if path is not None:
        run.save(path, {"model": model, "optimizer": optimizer})
    return {"norm": norm.item(), **{k: v.tolist() for k, v in model.state_dict().items()}}


def fork_runs(directory: str) -> dict:
    runs = {}
    for stage in (None, 2):
        strategy = fabric.PaddleDPStrategy(sharding_stage=stage, start_method="fork")
        run = Fabric(strategy=strategy, accelerator="cpu", devices=2)
        runs[stage] = run.launch(fabric_run, f"{directory}/{stage}.ckpt")
    return runs


@pytest.mark.slow
def test_fabric_with_sharding_equals_fabric_without(tmp_path):
    runs = launch_forking(fork_runs, str(tmp_path))
    for key, value in runs[None].items():
        torch.testing.assert_close(torch.tensor(runs[2][key]), torch.tensor(value), msg=lambda m: f"{key}: {m}")
    assert_same_state(
        torch.load(tmp_path / "2.ckpt", weights_only=True)["optimizer"],
        torch.load(tmp_path / "None.ckpt", weights_only=True)["optimizer"],
    )


def test_hydra_takes_strategy_sharding_stage(tmp_path):
    from hydra.utils import instantiate

    from tests.helpers.recipes import compose_config

    cfg = compose_config("digits", ["strategy.sharding.stage=2", "strategy.sharding.overlap=true"], tmp_path)
    strategy = instantiate(cfg.strategy)
    assert (strategy.options.sharding.stage, strategy.options.sharding.overlap) == (2, True)
    with pytest.raises(Exception, match="sharding.stage=5 is invalid"):
        instantiate(compose_config("digits", ["strategy.sharding.stage=5"], tmp_path).strategy)


def test_a_gradient_scaler_with_stage_two_is_refused_naming_both():
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    # fp16 AMP on CPU falls back to bf16 (no scaler) unless the plugin is given with its scaler.
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    run = Fabric(strategy=fabric.PaddleDPStrategy(sharding_stage=2), plugins=[scaler], accelerator="cpu", devices=1)
    run.launch()
    net = Net()
    with pytest.raises(ValueError, match=r"sharding_stage=2 with precision='16-mixed' \(a gradient scaler\) is invalid"):
        run.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
