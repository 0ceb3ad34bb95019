"""The strategies' feature protocol (``lit_dp.strategies.feature``) and its registry's order.

The calling rules are tested on recording features; docs/architecture.md's table of which door
calls which hook is checked against a feature that records every hook through both doors; the
worked example of docs/architecture.md ("Adding a feature") is run as written, registered with
one line, through a Trainer fit that is resumed and through a Fabric loop that is saved and loaded.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lit_dp
from lit_dp.options import FABRIC, TRAINER, Options
from lit_dp.strategies import registry
from lit_dp.strategies.fault_tolerance import FabricFaultTolerance, TrainerFaultTolerance
from lit_dp.strategies.feature import Feature, Features
from lit_dp.strategies.monitoring import Monitors
from lit_dp.strategies.resume import EpochContinuation
from lit_dp.strategies.uneven import UnevenInputs
from tests.helpers.distributed import launch_forking

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


class _Recording(Feature):
    def __init__(self, name: str, calls: list, key: str | None = None, state=None) -> None:
        self.name, self.calls, self._state = name, calls, state
        self.key = key  # type: ignore[misc]
        self.loaded = "never"

    def process_dataloader(self, dataloader):
        self.calls.append(self.name)
        return dataloader + [self.name]

    def optimizer_step(self, step, optimizer, closure):
        self.calls.append(f"{self.name} before")
        output = step(closure)
        self.calls.append(f"{self.name} after")
        return output

    @contextmanager
    def collective(self, name):
        self.calls.append(f"{self.name} enters {name}")
        yield

    def teardown(self):
        self.calls.append(f"{self.name} teardown")

    def state_dict(self):
        return self._state

    def load_state_dict(self, state):
        self.loaded = state


def test_values_pass_down_the_list_calls_nest_first_outermost_and_teardown_goes_up():
    calls: list = []
    features = Features([_Recording("a", calls), _Recording("b", calls)])
    assert features.process_dataloader([]) == ["a", "b"]
    calls.clear()
    assert features.optimizer_step(lambda closure: calls.append(f"step {closure}") or "out", None, "c") == "out"
    assert calls == ["a before", "b before", "step c", "b after", "a after"]
    calls.clear()
    with features.collective("barrier"):
        calls.append("the collective")
    assert calls == ["a enters barrier", "b enters barrier", "the collective"]
    calls.clear()
    features.teardown()
    assert calls == ["b teardown", "a teardown"]


def test_each_feature_keeps_its_own_checkpoint_entry():
    calls: list = []
    kept, empty, keyless = (
        _Recording("kept", calls, key="kept", state={"n": 1}),
        _Recording("empty", calls, key="empty", state=None),
        _Recording("keyless", calls, state={"n": 2}),
    )
    features = Features([kept, empty, keyless])
    assert features.state_dict() == {"kept": {"n": 1}}  # nothing written for no state or no key
    features.load_state_dict({"kept": {"n": 3}})
    assert (kept.loaded, empty.loaded, keyless.loaded) == ({"n": 3}, None, "never")


def test_a_feature_does_nothing_by_default():
    feature, marker = Feature(), object()
    assert feature.process_dataloader(marker) is marker and feature.batch_to_device(marker) is marker
    assert feature.setup_optimizer(marker) is marker
    assert feature.optimizer_step(lambda closure: closure, None, marker) is marker
    assert feature.training_step(lambda: marker) is marker and feature.validation_step(lambda: marker) is marker
    assert feature.wrapper_arguments(None, {"options": marker}) == {"options": marker}
    assert feature.state_dict() is None and not feature.joined and feature.key is None


def test_the_registry_order_is_the_contract():
    order = [feature for feature, _ in registry.FEATURES]
    assert order.index(TrainerFaultTolerance) < order.index(EpochContinuation) < order.index(UnevenInputs)
    assert order.index(FabricFaultTolerance) < order.index(UnevenInputs)
    assert order[-1] is Monitors
    trainer = registry.build_features(Options.build({"uneven_inputs": True}, TRAINER), TRAINER)
    assert not any(isinstance(feature, TrainerFaultTolerance) for feature in trainer), "built while off"
    fabric = registry.build_features(Options.build({}, FABRIC), FABRIC)
    assert not any(isinstance(feature, (UnevenInputs, EpochContinuation)) for feature in fabric), "not Fabric's"


# The worked example of docs/architecture.md, as written there.
def _documented_example() -> type[Feature]:
    text = ARCHITECTURE.read_text()
    section = text[text.index("### Adding a feature: a worked example") :]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    namespace: dict = {}
    exec(compile(blocks[0], f"{ARCHITECTURE}:worked example", "exec"), namespace)  # noqa: S102 - the docs' code
    namespace["BOTH"] = registry.BOTH
    # The registry line, below the comment that marks the block a fragment (tests/helpers/documented_python.py).
    registry_line = [line for line in blocks[1].splitlines() if not line.lstrip().startswith("#")][0].strip().rstrip(",")
    feature, doors = eval(registry_line, namespace)  # noqa: S307 - the docs' registry line
    assert (feature, doors) == (namespace["StepCount"], registry.BOTH)
    return feature


def _register(feature: type[Feature]) -> tuple:
    """``registry.FEATURES`` with the docs' line added where the docs place it (before the monitors)."""
    features = registry.FEATURES
    return (*features[:-1], (feature, registry.BOTH), features[-1])


@pytest.fixture
def step_count(monkeypatch):
    feature = _documented_example()
    monkeypatch.setattr(registry, "FEATURES", _register(feature))
    return feature


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)  # 8 batches


def _fit(root: Path, max_epochs: int, ckpt_path: str | None = None) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="paddle_dp", max_epochs=max_epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0)],
    )  # fmt: skip
    trainer.fit(_Regression(), train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return trainer


def test_the_worked_example_runs_through_the_trainer_and_is_resumed(tmp_path, step_count):
    trainer = _fit(tmp_path, max_epochs=1)
    assert trainer.strategy.feature(step_count).steps == 8
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["lit_dp"]["step_count"] == 8
    resumed = _fit(tmp_path / "again", max_epochs=2, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.strategy.feature(step_count).steps == 16  # counted on from the checkpoint's 8


def _fabric_steps(fabric: Fabric, checkpoint: str, steps: int, resume: bool) -> int:
    """``steps`` optimizer steps in a Fabric loop; saved at the end, or first loaded with ``resume``.
    Returns the feature's count."""
    net = nn.Linear(6, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    if resume:  # the loop's own entries come back; lit_dp's entry is the strategy's, not among them
        assert fabric.load(checkpoint, {"model": model, "optimizer": optimizer}) == {"step": 3}
    for _ in range(steps):
        fabric.backward(model(torch.randn(4, 6)).sum())
        optimizer.step()
    if not resume:
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": steps})
    count = fabric.strategy.feature(registry.FEATURES[-2][0]).steps
    fabric.strategy.teardown()
    return count


def _fabric_round_trip(checkpoint: str) -> tuple[int, int, int]:
    """The worked example registered in this (spawned) process, then two launches of 2 forked ranks: 3 steps
    saved, and a new launch that loads them and takes 2 more."""
    registry.FEATURES = _register(_documented_example())
    launch = partial(Fabric, accelerator="cpu", devices=2)
    saved = launch(strategy=lit_dp.fabric.PaddleDPStrategy(start_method="fork")).launch(_fabric_steps, checkpoint, 3, False)
    resumed = launch(strategy=lit_dp.fabric.PaddleDPStrategy(start_method="fork")).launch(_fabric_steps, checkpoint, 2, True)
    return saved, torch.load(checkpoint, weights_only=True)["lit_dp"]["step_count"], resumed


@pytest.mark.slow  # two launches from a spawned process that imports the Trainer too: about 10 s
def test_the_worked_example_runs_through_fabric_and_is_resumed(tmp_path):
    saved, in_checkpoint, resumed = launch_forking(_fabric_round_trip, str(tmp_path / "fabric.ckpt"))
    assert (saved, in_checkpoint, resumed) == (3, 3, 5)  # fabric.save kept the count; fabric.load counted on


# docs/architecture.md's table of hooks against front doors, checked by running a feature that records
# every hook it is called with through each door: a Trainer fit with validation and a checkpoint, then a
# resumed fit that fails; a Fabric loop that saves and loads.
_CALLED: dict[str, set[str]] = {}


_DOOR = ["trainer"]  # the door being run


def _record(name: str) -> None:
    _CALLED.setdefault(_DOOR[0], set()).add(name)


class _EveryHook(Feature):
    key = "every_hook"

    def setup_environment(self, strategy):
        _record("setup_environment")

    def wrapper_arguments(self, run, arguments):
        _record("wrapper_arguments")
        return arguments

    def setup(self, run):
        _record("setup")

    def setup_optimizer(self, optimizer):
        _record("setup_optimizer")
        return optimizer

    def process_dataloader(self, dataloader):
        _record("process_dataloader")
        return dataloader

    def batch_to_device(self, batch):
        _record("batch_to_device")
        return batch

    def training_step(self, step):
        _record("training_step")
        return step()

    def validation_step(self, step):
        _record("validation_step")
        return step()

    def optimizer_step(self, step, optimizer, closure):
        _record("optimizer_step")
        return step(closure)

    @property
    def joined(self):
        _record("joined")
        return False

    @contextmanager
    def collective(self, name):
        _record("collective")
        yield

    @contextmanager
    def saving(self):
        _record("saving")
        yield

    def on_validation_start(self):
        _record("on_validation_start")

    def on_validation_end(self):
        _record("on_validation_end")

    def on_train_end(self):
        _record("on_train_end")

    def on_exception(self, exception, strategy):
        _record("on_exception")

    def teardown(self):
        _record("teardown")

    def state_dict(self):
        _record("state_dict")
        return 1

    def load_state_dict(self, state):
        _record("load_state_dict")


def _documented_hooks() -> tuple[set[str], set[str], set[str], tuple[int, ...]]:
    """Every hook of the table (without ``build``), those it says each door does not call, and its counts."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("| hook | Trainer") :].split("\n\n")[0].splitlines()[2:]
    hooks, gaps = set(), {"trainer": set(), "fabric": set()}
    for row in table:
        cells = row.split(" | ")
        names = set(re.findall(r"`(\w+)[(`]", cells[0])) - {"build"}
        hooks |= names
        for door, cell in (("trainer", cells[1]), ("fabric", cells[2])):
            if "**gap**" in cell:
                gaps[door] |= names
    counts = re.search(r"the Trainer calls (\d+) of the (\d+) hooks, Fabric (\d+)", text)
    assert counts is not None, "docs/architecture.md no longer counts the hooks per door"
    return hooks, gaps["trainer"], gaps["fabric"], tuple(map(int, counts.groups()))


class _FailsAfterAStep(_Regression):
    def training_step(self, batch, batch_idx):
        if self.global_step > 8:  # the resumed epoch's second step
            raise RuntimeError("a failing step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)


def test_each_door_calls_the_hooks_docs_architecture_says(tmp_path, monkeypatch):
    hooks, trainer_gaps, fabric_gaps, counts = _documented_hooks()
    assert set(_EveryHook.__dict__) >= hooks, "the recording feature misses a documented hook"
    assert counts == (len(hooks) - len(trainer_gaps), len(hooks), len(hooks) - len(fabric_gaps))
    monkeypatch.setattr(registry, "FEATURES", _register(_EveryHook))
    _CALLED.clear()

    _DOOR[0] = "trainer"
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit = dict(accelerator="cpu", devices=1, strategy="paddle_dp", **quiet)
    trainer = pl.Trainer(max_epochs=1, limit_val_batches=2, callbacks=[checkpoints], **fit)
    trainer.fit(_FailsAfterAStep(), train_dataloaders=_loader(), val_dataloaders=_loader())
    again = pl.Trainer(max_epochs=2, **fit)
    with pytest.raises(RuntimeError, match="a failing step"):  # resumed (load_state_dict), then on_exception
        again.fit(_FailsAfterAStep(), train_dataloaders=_loader(), ckpt_path=str(tmp_path / "last.ckpt"))

    _DOOR[0] = "fabric"
    run = Fabric(strategy=lit_dp.fabric.PaddleDPStrategy(hang_timeout=None), accelerator="cpu", devices=1)
    run.launch()
    net = nn.Linear(6, 1)
    model, optimizer = run.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in run.setup_dataloaders(_loader()):
        run.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    run.barrier()
    run.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer})
    run.load(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer})
    run.strategy.teardown()

    assert _CALLED["trainer"] == hooks - trainer_gaps
    assert _CALLED["fabric"] == hooks - fabric_gaps
