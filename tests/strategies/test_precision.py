"""Mixed precision with fused optimizers and clipping, through the Trainer and Fabric (lit_dp.strategies.precision).

The oracle is Lightning's "ddp" with the same optimizer unfused (foreach), which Lightning can
clip: a fused AdamW (``fused=True``) and a foreach one differ by the order of a few float32
roundings (a few 1e-8 on these weights), which torch.testing's float32 defaults cover; a
gradient left scaled, or clipped by one rank's norm, is off by far more. Under ``16-mixed`` on
CPU (where the Trainer turns ``precision="16-mixed"`` into bf16) the scaler comes as an explicit
``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))`` plugin.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lit_dp import PaddleDPStrategy, fabric
from lit_dp.strategies.precision import (
    DataParallelClipping,
    DataParallelDoublePrecision,
    DataParallelHalfPrecision,
    DataParallelMixedPrecision,
    DataParallelPrecision,
    check_sharded_clipping,
    for_data_parallel,
)
from tests.helpers.distributed import launch_forking, run_ranks
from tests.helpers.lightning import Regressor, assert_same_weights, trainer

CLIP = 1e-3  # far below the gradients' norm: clipping by norm acts at every step
CLIP_VALUE = 1e-3  # far below the largest gradient: clipping by value acts at every step


def gradient_norm(module: torch.nn.Module) -> float:
    norms = [param.grad.norm() for param in module.parameters() if param.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item()


class AdamWRegressor(Regressor):
    """Records the gradients' norm before and after clipping at every step: under a scaler, a
    gradient left scaled shows there (AdamW's update is nearly blind to a constant scale)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.norms: list[tuple[float, float]] = []

    def configure_optimizers(self):
        # foreach: the unfused implementation Lightning clips; fused: the one it refuses to.
        return torch.optim.AdamW(self.parameters(), lr=0.05, fused=self.fused or None, foreach=not self.fused)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        before = gradient_norm(self)
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append((before, gradient_norm(self)))


# Low enough that these float16 gradients do not overflow once scaled: every step is taken (a
# skipped step would compare untrained weights).
INIT_SCALE = 2.0**8


def fp16_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))


# --- which plugin the Trainer strategy ends up with ---------------------------------------------


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("32-true", DataParallelPrecision),
        ("bf16-mixed", DataParallelMixedPrecision),
        ("bf16-true", DataParallelHalfPrecision),
        ("16-true", DataParallelHalfPrecision),
        ("64-true", DataParallelDoublePrecision),
    ],
)
@pytest.mark.parametrize("strategy", ["paddle_dp", "paddle_dp_spawn_find_unused_parameters_true", "instance"])
def test_the_trainer_strategy_gets_lit_dps_plugin_for_every_precision(precision, expected, strategy):
    strategy = PaddleDPStrategy() if strategy == "instance" else strategy
    run = pl.Trainer(strategy=strategy, precision=precision, accelerator="cpu", devices=1, logger=False)
    assert type(run.precision_plugin) is expected
    assert run.precision_plugin.precision == precision
    assert run.precision == precision


@pytest.mark.parametrize("where", ["plugins", "strategy"])
def test_a_users_scaler_is_kept(where):
    plugin = fp16_plugin()
    if where == "plugins":
        run = pl.Trainer(strategy="paddle_dp", plugins=[plugin], accelerator="cpu", devices=1, logger=False)
    else:
        run = pl.Trainer(strategy=PaddleDPStrategy(precision_plugin=plugin), accelerator="cpu", devices=1, logger=False)
    assert type(run.precision_plugin) is DataParallelMixedPrecision
    assert (run.precision_plugin.precision, run.precision_plugin.device) == ("16-mixed", "cpu")
    assert run.precision_plugin.scaler is plugin.scaler


def test_a_plugin_of_the_users_own_class_is_kept_as_given():
    class Mine(MixedPrecision):
        pass

    plugin = Mine("bf16-mixed", "cpu")
    run = pl.Trainer(strategy="paddle_dp", plugins=[plugin], accelerator="cpu", devices=1, logger=False)
    assert run.precision_plugin is plugin
    assert for_data_parallel(None) is None


@pytest.mark.parametrize(
    "lightning", [Precision(), MixedPrecision("bf16-mixed", "cpu"), HalfPrecision("bf16-true"), DoublePrecision()]
)
def test_each_converted_plugin_is_still_lightnings_class(lightning):
    converted = for_data_parallel(lightning)
    assert isinstance(converted, type(lightning)) and isinstance(converted, DataParallelClipping)
    assert for_data_parallel(converted) is converted


def test_the_scalers_state_is_saved_under_lightnings_class_name_so_ddp_reads_it():
    ours = for_data_parallel(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0)))
    checkpoint = {type(ours).__qualname__: ours.state_dict()}  # as Lightning's checkpoint connector writes it
    ours.on_save_checkpoint(checkpoint)
    assert set(checkpoint) == {"MixedPrecision"} and checkpoint["MixedPrecision"]["scale"] == 1024.0

    restored = for_data_parallel(fp16_plugin())
    restored.on_load_checkpoint(checkpoint)  # Lightning then finds nothing under the subclass's name
    assert restored.scaler.get_scale() == 1024.0


def test_sharded_clipping_by_norm_with_a_plugin_that_takes_one_ranks_norm_is_refused():
    class Mine(MixedPrecision):
        pass

    mine = Mine("bf16-mixed", "cpu")
    refusal = r"sharding_stage=2 with gradient_clip_val=1.0 and the precision plugin .*Mine is invalid: .*Clipping"
    with pytest.raises(ValueError, match=refusal):
        check_sharded_clipping(mine, 2, 1.0, "norm")
    check_sharded_clipping(mine, 1, 1.0, "norm")  # stage 1: every rank holds every averaged gradient
    check_sharded_clipping(mine, 2, 1.0, "value")  # element by element: nothing global
    check_sharded_clipping(mine, 2, None, None)
    check_sharded_clipping(for_data_parallel(MixedPrecision("bf16-mixed", "cpu")), 2, 1.0, "norm")

    class Clipping(DataParallelClipping, MixedPrecision):
        pass

    check_sharded_clipping(Clipping("bf16-mixed", "cpu"), 2, 1.0, "norm")


# --- the Trainer: fits ---------------------------------------------------------------------------


def fit(strategy, tmp_path, fused: bool, **kwargs) -> dict[str, torch.Tensor]:
    """The weights after one epoch, and the gradients' norms (``"norms"``: before and after clipping, per step)."""
    module = AdamWRegressor(fused)
    trainer(strategy, tmp_path, max_epochs=1, **kwargs).fit(module)
    assert not torch.equal(module.net[0].weight, AdamWRegressor(fused).net[0].weight), "no training"
    return {"norms": torch.tensor(module.norms), **{k: v.clone() for k, v in module.state_dict().items()}}


def weights_of(run: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in run.items() if key != "norms"}


def test_one_device_bf16_fused_adamw_clipped_as_ddp_clips_an_unfused_one(tmp_path):
    clipped = dict(precision="bf16-mixed", gradient_clip_val=CLIP, devices=1)
    assert_same_weights(fit("paddle_dp", tmp_path, fused=True, **clipped), fit("ddp", tmp_path, fused=False, **clipped))


def trainer_fits(rank, tmp_path):
    tmp_path = Path(tmp_path)
    cases = {
        "bf16, by norm": dict(precision="bf16-mixed", gradient_clip_val=CLIP),
        "bf16, by value": dict(precision="bf16-mixed", gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value"),
        "fp16 with a scaler, by norm": dict(plugins=[fp16_plugin()], gradient_clip_val=CLIP),
    }
    for case, options in cases.items():
        ours = fit("paddle_dp", tmp_path / case, fused=True, **options)
        options["plugins"] = [fp16_plugin()] if "plugins" in options else None  # a fresh scaler
        theirs = fit("ddp", tmp_path / case, fused=False, **options)
        try:
            assert_same_weights(ours, theirs)
        except AssertionError as error:
            raise AssertionError(f"{case}: {error}") from None
    # Sharding: the global norm, exact, with the fused optimizer rebuilt over each rank's parameters
    # (the weights only: under stage 2 a rank's module holds its own gradients only).
    clipped = dict(fused=True, precision="bf16-mixed", gradient_clip_val=CLIP)
    unsharded = fit("paddle_dp", tmp_path / "unsharded", **clipped)
    for stage in (1, 2):
        sharded = fit(PaddleDPStrategy(sharding_stage=stage), tmp_path / f"stage{stage}", **clipped)
        try:
            assert_same_weights(weights_of(sharded), weights_of(unsharded))
        except AssertionError as error:
            raise AssertionError(f"sharding stage {stage}: {error}") from None
    return True


@pytest.mark.slow
def test_trainer_mixed_precision_fused_and_clipped_on_two_ranks_as_ddp_unfused(tmp_path):
    # torchrun's variables: "ddp" and "paddle_dp" alike join the ranks the test started.
    assert run_ranks(trainer_fits, 2, str(tmp_path), timeout=300, launcher="torchrun") == {0: True, 1: True}


# --- Fabric --------------------------------------------------------------------------------------


def fabric_steps(run: Fabric, fused: bool, clip: dict) -> dict[str, list]:
    """The weights after 3 steps, and the norms per step: what ``clip_gradients`` returned, the gradients' after."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    untrained = net[0].weight.detach().clone()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05, fused=fused or None, foreach=not fused)
    model, optimizer = run.setup(net, optimizer)
    generator = torch.Generator().manual_seed(run.global_rank)
    norms = []
    for _ in range(3):
        x = torch.randn(8, 6, generator=generator)
        run.backward(((model(x) - x.sum(1, keepdim=True).sin()) ** 2).mean())
        returned = run.clip_gradients(model, optimizer, **clip)
        norms.append([float("nan") if returned is None else returned.item(), gradient_norm(net)])
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(net[0].weight, untrained), "no training"
    return {"norms": norms, **{k: v.tolist() for k, v in model.state_dict().items()}}


FABRIC_CASES = {
    "bf16, by norm": ("bf16-mixed", dict(max_norm=CLIP)),
    "bf16, by value": ("bf16-mixed", dict(clip_val=CLIP_VALUE)),
    "fp16 with a scaler, by norm": ("scaler", dict(max_norm=CLIP)),
    "fp16 with a scaler, by value": ("scaler", dict(clip_val=CLIP_VALUE)),
}


def fabric_runs() -> dict:
    runs = {}
    for case, (precision, clip) in FABRIC_CASES.items():
        for name, fused in (("paddle_dp_fork", True), ("ddp_fork", False)):
            scaler = FabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
            options = dict(plugins=[scaler]) if precision == "scaler" else dict(precision=precision)
            run = Fabric(strategy=name, accelerator="cpu", devices=2, **options)
            runs[case, name] = run.launch(fabric_steps, fused, clip)
    for stage in (None, 1, 2):
        strategy = fabric.PaddleDPStrategy(sharding_stage=stage, start_method="fork")
        run = Fabric(strategy=strategy, accelerator="cpu", devices=2, precision="bf16-mixed")
        runs["sharded", stage] = run.launch(fabric_steps, True, dict(max_norm=CLIP))
    return runs


def assert_same_run(ours: dict, theirs: dict, label: str, keys=None) -> None:
    for key in keys or theirs:
        torch.testing.assert_close(
            torch.tensor(ours[key]), torch.tensor(theirs[key]), equal_nan=True, msg=lambda m: f"{label}, {key}: {m}"
        )


@pytest.mark.slow
def test_fabric_mixed_precision_fused_and_clipped_as_ddp_unfused():
    runs = launch_forking(fabric_runs, timeout=240)
    for case in FABRIC_CASES:
        assert_same_run(runs[case, "paddle_dp_fork"], runs[case, "ddp_fork"], case)
    for stage in (1, 2):
        # The weights, and the norm clip_gradients returns: the global one. (A rank's module then holds
        # gradients it does not own unclipped, under stage 1, or none, under stage 2: no step reads them.)
        keys = [key for key in runs["sharded", None] if key != "norms"]
        assert_same_run(runs["sharded", stage], runs["sharded", None], f"sharding stage {stage}", keys)
        returned = [norm for norm, _ in runs["sharded", None]["norms"]]
        assert [norm for norm, _ in runs["sharded", stage]["norms"]] == pytest.approx(returned), stage
