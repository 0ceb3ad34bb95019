"""What the features expose, as real attributes of each strategy class (``lit_dp.strategies.exposed``).

No ``__getattr__`` hides an error: an ``AttributeError`` inside a Lightning property reads as under
Lightning's ``DDPStrategy``. Each exposed name is a typed, documented property or method of the classes of
the front doors its feature serves, and of no other (``help()`` shows it); a class whose features would
shadow a name, or expose one twice, is refused as it is defined; a strategy pickles and deep-copies before
and after its process group is up, and after a run.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import pydoc
import re
import typing

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lit_dp
from lit_dp.options import Options
from lit_dp.strategies import registry
from lit_dp.strategies.base import front_door
from lit_dp.strategies.exposed import exposed
from lit_dp.strategies.feature import Feature

DOORS = [lit_dp.PaddleDPStrategy, lit_dp.fabric.PaddleDPStrategy]
IDS = ["trainer", "fabric"]
# What each door's strategy offers of its features' (docs/strategy.md, docs/fabric.md, docs/architecture.md).
EXPECTED = {
    lit_dp.PaddleDPStrategy: {
        "wait_for_parameters", "fault_tolerance", "joined", "local_sgd", "comm_buffer_size", "tuned_comm_buffer_size",
    },
    lit_dp.fabric.PaddleDPStrategy: {
        "wait_for_parameters", "fault_tolerance", "join", "local_sgd", "comm_buffer_size", "tuned_comm_buffer_size",
    },
}  # fmt: skip


class TypoEnvironment(LightningEnvironment):
    """A cluster environment with a bug: its ``global_rank`` reads an attribute that does not exist."""

    def global_rank(self) -> int:
        return self._typo_attribute  # type: ignore[attr-defined]


@pytest.mark.parametrize(("ours", "ddp"), list(zip(DOORS, [DDPStrategy, FabricDDPStrategy], strict=True)), ids=IDS)
@pytest.mark.parametrize("name", ["is_global_zero", "global_rank", "distributed_sampler_kwargs"])
def test_an_attribute_error_inside_a_lightning_property_reads_as_under_ddp(ours, ddp, name):
    """The error names the bug (``'TypoEnvironment' object has no attribute '_typo_attribute'``), not the property."""
    with pytest.raises(AttributeError) as theirs:
        getattr(ddp(cluster_environment=TypoEnvironment()), name)
    with pytest.raises(AttributeError) as mine:
        getattr(ours(cluster_environment=TypoEnvironment()), name)
    assert str(mine.value) == str(theirs.value) == "'TypoEnvironment' object has no attribute '_typo_attribute'"


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_each_exposed_name_is_a_typed_documented_attribute_of_the_class(door):
    assert set(exposed(door)) == EXPECTED[door]
    for name, kind in exposed(door).items():
        assert kind in registry.serving(door._options_scope) and name in kind.exposes
        assert hasattr(door, name) and name in dir(door), name
        attribute, feature_attribute = inspect.getattr_static(door, name), inspect.getattr_static(kind, name)
        assert attribute.__doc__ == feature_attribute.__doc__, name
        function = attribute.fget if isinstance(attribute, property) else attribute
        assert isinstance(attribute, property) == isinstance(feature_attribute, property), name
        assert "return" in typing.get_type_hints(function), name  # resolved in the feature's module


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_the_types_say_none_where_the_strategy_gives_none_while_the_feature_is_off(door):
    names = ("fault_tolerance", "local_sgd")
    hints = {name: typing.get_type_hints(inspect.getattr_static(door, name).fget)["return"] for name in names}
    from lit_dp.fault_tolerance.manager import FaultTolerance
    from lit_dp.local_sgd import LocalSGD

    assert hints == {"fault_tolerance": FaultTolerance | None, "local_sgd": LocalSGD | None}
    strategy = door()
    assert (strategy.fault_tolerance, strategy.local_sgd, strategy.tuned_comm_buffer_size) == (None, None, None)
    assert strategy.comm_buffer_size == 25.0 and door(comm_buffer_size="auto").comm_buffer_size == "auto"
    assert str(inspect.signature(door.wait_for_parameters)) == "(self) -> 'None'"  # the feature's method's
    assert strategy.wait_for_parameters() is None


def test_a_name_the_other_front_door_offers_does_not_exist():
    """``join`` is Fabric's (the Trainer's way is ``uneven_inputs=True``); ``joined`` the Trainer's."""
    trainer, fabric = lit_dp.PaddleDPStrategy(uneven_inputs=True), lit_dp.fabric.PaddleDPStrategy()
    assert not hasattr(lit_dp.PaddleDPStrategy, "join") and not hasattr(trainer, "join")
    assert not hasattr(lit_dp.fabric.PaddleDPStrategy, "joined") and not hasattr(fabric, "joined")
    assert trainer.joined is False
    with pytest.raises(TypeError, match="fabric.strategy.join expects the module returned by fabric.setup"):
        fabric.join(nn.Linear(1, 1))  # the feature's own check, reached through the strategy's method


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_help_shows_each_exposed_name_with_its_docstring(door):
    text = pydoc.render_doc(door, renderer=pydoc.plaintext)
    for name in exposed(door):
        heading = re.search(rf"^ \|  {name}(\(self.*)?$", text, re.MULTILINE)
        assert heading is not None, f"help({door.__qualname__}) does not list {name}"
        shown = text[heading.end() :].split("\n |  \n")[0]
        doc = inspect.getdoc(inspect.getattr_static(door, name))
        assert " ".join(shown.replace(" |  ", "").split()) == " ".join(doc.split()), name


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_an_exposed_attribute_is_read_only(door):
    """Before, an assignment made an instance attribute that hid the feature's, silently."""
    strategy = door()
    with pytest.raises(AttributeError, match="has no setter"):
        strategy.comm_buffer_size = 5
    assert strategy.comm_buffer_size == 25.0


class _Answering(Feature):
    """Exposes ``answer`` on the strategy, built unless ``comm_stats`` is on (standing for an option turning it off)."""

    exposes = {"answer": "off"}

    @classmethod
    def build(cls, options: Options) -> _Answering | None:
        return None if options.comm_stats else cls()

    @property
    def answer(self) -> int | str:
        """The answer, or ``"off"``."""
        return 42


class _Buggy(Feature):
    exposes = {"broken": None}

    @property
    def broken(self) -> int:
        """Reads an attribute it never set."""
        return self._typo  # type: ignore[attr-defined]


def _registered(*features: type[Feature]) -> tuple:
    """``registry.FEATURES`` with ``features`` added for both doors."""
    return (*registry.FEATURES, *((feature, registry.BOTH) for feature in features))


def _defined(door: type) -> type:
    """A strategy class of ``door``'s front door defined now, as the registry reads now (the module's classes were
    defined at import, from the registry as it was then)."""
    return front_door(type(door.__name__, (door,), {"__module__": __name__}))


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_a_feature_exposes_an_attribute_on_both_strategies_without_a_strategy_edit(monkeypatch, door):
    monkeypatch.setattr(registry, "FEATURES", _registered(_Answering, _Buggy))
    strategy = _defined(door)
    assert strategy().answer == 42
    assert strategy(comm_stats=True).answer == "off"  # the feature's value while it is off
    assert exposed(strategy)["answer"] is _Answering and not hasattr(door, "answer")  # the class defined before
    with pytest.raises(AttributeError, match="^'_Buggy' object has no attribute '_typo'$"):  # the feature's own error
        strategy().broken  # noqa: B018 - the attribute read is what is tested
    with pytest.raises(AttributeError, match="^'PaddleDPStrategy' object has no attribute 'question'$"):
        strategy().question  # noqa: B018


class _AlsoAnswering(_Answering):
    """A second feature exposing ``answer``."""


def _exposing(name: str) -> type[Feature]:
    """A feature that exposes a property called ``name``."""

    def read(self: Feature) -> int:
        """A value."""
        return 1

    return type(f"Exposing_{name}", (Feature,), {"exposes": {name: None}, name: property(read)})


@pytest.mark.parametrize("door", DOORS, ids=IDS)
def test_two_features_exposing_one_name_are_refused_naming_both(monkeypatch, door):
    monkeypatch.setattr(registry, "FEATURES", _registered(_Answering, _AlsoAnswering))
    with pytest.raises(TypeError, match=r"tests.strategies.test_exposed._Answering and "
                       r"tests.strategies.test_exposed._AlsoAnswering both expose 'answer'"):  # fmt: skip
        _defined(door)


@pytest.mark.parametrize(
    ("door", "name", "holder"),
    [
        (lit_dp.PaddleDPStrategy, "is_global_zero", "lightning.pytorch.strategies.parallel.ParallelStrategy"),
        (lit_dp.PaddleDPStrategy, "lr_scheduler_configs", "lightning.pytorch.strategies.strategy.Strategy"),  # __init__
        (lit_dp.PaddleDPStrategy, "cluster_environment", "lightning.pytorch.strategies.parallel.ParallelStrategy"),
        (lit_dp.PaddleDPStrategy, "describe", "lit_dp.strategies.trainer.PaddleDPStrategy"),
        (lit_dp.fabric.PaddleDPStrategy, "precision", "lightning.fabric.strategies.strategy.Strategy"),
        (lit_dp.fabric.PaddleDPStrategy, "barrier", "lit_dp.strategies.base.DataParallelStrategyMixin"),
    ],
)
def test_a_feature_exposing_a_name_the_strategy_has_is_refused_naming_both(monkeypatch, door, name, holder):
    feature = _exposing(name)
    monkeypatch.setattr(registry, "FEATURES", _registered(feature))
    message = f"test_exposed.Exposing_{name} exposes '{name}', which {__name__}.PaddleDPStrategy already has from {holder}"
    with pytest.raises(TypeError, match=re.escape(message)):
        _defined(door)


class _Plain(Feature):
    """Exposes a plain attribute, as the worked example's ``steps`` (docs/architecture.md)."""

    exposes = {"steps": None}

    def __init__(self) -> None:
        self.steps = 0


class _Undocumented(Feature):
    exposes = {"steps": None}

    @property
    def steps(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("feature", "message"),
    [
        (_Plain, "exposes 'steps', which is no public property or method of it"),
        (_Undocumented, "exposes 'steps' without a docstring or a return annotation"),
        (_exposing("_private"), "exposes '_private', which is no public property or method of it"),
    ],
)
def test_what_cannot_be_a_typed_documented_attribute_is_refused(monkeypatch, feature, message):
    monkeypatch.setattr(registry, "FEATURES", _registered(feature))
    with pytest.raises(TypeError, match=re.escape(message)):
        _defined(lit_dp.PaddleDPStrategy)


def test_an_annotation_object_gets_none_added_as_a_string_does(monkeypatch):
    """A feature module without postponed annotations: its property's annotation is the type itself."""
    feature = _exposing("answer")
    feature.answer.fget.__annotations__ = {"return": int}
    monkeypatch.setattr(registry, "FEATURES", _registered(feature))
    strategy = _defined(lit_dp.PaddleDPStrategy)
    assert typing.get_type_hints(strategy.answer.fget)["return"] == int | None


def _round_trips(strategy, expected: dict) -> None:
    """``strategy`` pickled and deep-copied: each copy's exposed attributes and options read as the original's."""
    for copied in (pickle.loads(pickle.dumps(strategy)), copy.deepcopy(strategy)):
        assert type(copied) is type(strategy) and copied.options == strategy.options
        assert {name: getattr(copied, name) for name in expected} == expected


OPTIONS = [{}, {"local_sgd_steps": 2}, {"sharding_stage": 1, "sharding_overlap": True}, {"comm_buffer_size": "auto"}]
OPTION_IDS = ["default", "local_sgd", "sharding", "auto"]


@pytest.mark.parametrize("door", DOORS, ids=IDS)
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_a_strategy_pickles_and_deep_copies_as_built(door, options):
    strategy = door(**options)
    _round_trips(strategy, {"comm_buffer_size": strategy.comm_buffer_size, "local_sgd": None, "fault_tolerance": None})


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_fabrics_strategy_pickles_and_deep_copies_with_its_group_up_and_after_its_run(options):
    """On a one-rank Gloo group: after ``fabric.launch()`` (the group up, the ranks set), and after a run's
    ``fabric.strategy.teardown()`` (a tuned size kept)."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=lit_dp.fabric.PaddleDPStrategy(**options))
    fabric.launch()
    strategy = fabric.strategy
    assert torch.distributed.is_initialized() and strategy.global_rank == 0
    _round_trips(strategy, {"comm_buffer_size": strategy.comm_buffer_size, "global_rank": 0, "world_size": 1})
    net = nn.Linear(4, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(2):
        fabric.backward(model(torch.randn(8, 4)).sum())
        optimizer.step()
    strategy.teardown()
    _round_trips(strategy, {"comm_buffer_size": strategy.comm_buffer_size, "local_sgd": None, "world_size": 1})


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_trainers_strategy_pickles_and_deep_copies_after_a_fit(tmp_path):
    strategy = lit_dp.PaddleDPStrategy(local_sgd_steps=2, uneven_inputs=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(_Regression(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    _round_trips(strategy, {"comm_buffer_size": 25.0, "local_sgd": None, "joined": False, "world_size": 1})
