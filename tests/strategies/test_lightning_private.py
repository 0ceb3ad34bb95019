"""lit_dp.strategies.lightning_private: each private Lightning name lit_dp uses is where this Lightning keeps
it and does what lit_dp relies on; no other module of lit_dp uses one.

A failure names the installed Lightning's version (``lightning_private.moved``): an upgrade that
moves a name fails here, in one place.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import textwrap
from functools import cache
from pathlib import Path
from unittest import mock

import lightning
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from torch import nn

from lit_dp import PaddleDPStrategy
from lit_dp.strategies import lightning_private as private

LIBRARY = Path(__file__).resolve().parents[2] / "lit_dp"
RECIPES = LIBRARY.parent / "lit_dp_recipes"
HOME = LIBRARY / "strategies" / "lightning_private.py"
LIGHTNING_PACKAGES = ("lightning", "lightning_utilities", "pytorch_lightning", "lightning_fabric")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def tiny_trainer(tmp_path: Path, **kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=tmp_path, **kwargs)


@pytest.mark.parametrize(("module", "name"), private.LOOKED_UP, ids=lambda value: value)
def test_each_private_class_and_function_is_where_this_lightning_keeps_it(module, name):
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        pytest.fail(private.moved(f"{module}.{name}") + f" ({error})")


@cache
def lightning_members(cls: type) -> frozenset[str]:
    """The private names Lightning's classes in ``cls``'s MRO define: methods, class attributes and
    what their methods assign on ``self`` (read from Lightning's source)."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in LIGHTNING_PACKAGES:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        for node in ast.walk(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self":
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return frozenset(name for name in names if is_private(name))


@pytest.mark.parametrize(
    ("base", "member"), [(base, member) for base, members in private.SUBCLASSED.items() for member in members],
    ids=lambda value: getattr(value, "__qualname__", value),
)
def test_each_member_lit_dps_subclasses_use_is_still_lightnings(base, member):
    assert member in lightning_members(base), private.moved(f"{base.__module__}.{base.__qualname__}.{member}")


@pytest.mark.parametrize("name", private.DDP_STRATEGY_NAMES)
def test_each_ddp_strategy_name_lit_dp_mirrors_is_still_ddps(name):
    assert name in lightning_members(DDPStrategy), private.moved(f"DDPStrategy.{name}") + (
        ": code written against \"ddp\" no longer reads it, nor should lit_dp's strategies keep it"
    )
    assert hasattr(PaddleDPStrategy(), name)


def test_attached_trainer_is_none_until_a_trainer_holds_the_module(tmp_path):
    module, trainer = BoringModel(), tiny_trainer(tmp_path)
    assert private.attached_trainer(module) is None
    module.trainer = trainer
    assert private.attached_trainer(module) is trainer


def test_what_the_signal_connector_puts_back_at_teardown_is_replaced(tmp_path):
    import signal

    def mine(signum, frame):
        pass

    trainer = tiny_trainer(tmp_path)
    connector = private.signal_connector(trainer)
    before = signal.getsignal(signal.SIGTERM)
    connector.register_signal_handlers()
    try:
        private.replace_saved_signal_handlers(trainer, lambda signum, handler: mine if signum == signal.SIGTERM else handler)
        connector.teardown()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_signal_connector_is_read_and_replaced_where_the_trainer_keeps_it(tmp_path):
    trainer = tiny_trainer(tmp_path)
    connector = private.signal_connector(trainer)
    assert isinstance(connector, private.SignalConnector)
    replacement = private.SignalConnector(trainer)
    private.replace_signal_connector(trainer, replacement)
    assert private.signal_connector(trainer) is replacement


def test_the_sigterm_broadcast_is_skipped_on_one_loop_and_comes_back(tmp_path):
    epoch_loop = tiny_trainer(tmp_path).fit_loop.epoch_loop
    private.skip_sigterm_broadcast(epoch_loop)
    with mock.patch("torch.distributed.broadcast") as broadcast:
        epoch_loop._broadcast_sigterm_tensor()
    broadcast.assert_not_called()
    private.restore_sigterm_broadcast(epoch_loop)
    assert epoch_loop._broadcast_sigterm_tensor.__func__ is type(epoch_loop)._broadcast_sigterm_tensor


def test_slurm_requeue_is_lightnings_handler_with_its_checkpoint_path(tmp_path):
    trainer = tiny_trainer(tmp_path)
    with mock.patch.object(private.SignalConnector, "_slurm_sigusr_handler_fn") as handler:
        checkpoint = private.slurm_requeue(trainer, 10)
    handler.assert_called_once_with(10, None)
    assert checkpoint == os.path.join(tmp_path, "hpc_ckpt_1.ckpt")


def test_cluster_environment_is_the_trainers(tmp_path):
    trainer = tiny_trainer(tmp_path)
    assert isinstance(private.cluster_environment(trainer), ClusterEnvironment)


def test_batches_that_stepped_restored_is_what_lightning_saves(tmp_path):
    epoch_loop = tiny_trainer(tmp_path).fit_loop.epoch_loop
    assert private.batches_that_stepped(epoch_loop) == 0
    private.restore_batches_that_stepped(epoch_loop, 7)
    assert private.batches_that_stepped(epoch_loop) == 7
    assert epoch_loop.on_save_checkpoint()["_batches_that_stepped"] == 7


class RecordResults(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("synced", torch.tensor(2.0), on_step=False, on_epoch=True, sync_dist=True)
        pl_module.log("local", torch.tensor(3.0), on_step=False, on_epoch=True)
        self.entries = private.synced_epoch_metrics(private.logged_results(trainer))


def test_a_synced_epoch_metric_travels_to_a_rank_that_logged_nothing(tmp_path):
    record = RecordResults()
    # A distributed strategy: Lightning syncs `sync_dist=True` values only there (one rank here).
    trainer = tiny_trainer(tmp_path, strategy=PaddleDPStrategy(), max_steps=1, limit_val_batches=0, callbacks=[record])
    assert private.logged_results(trainer) is None  # no loop running
    trainer.fit(BoringModel())
    [(key, fields)] = record.entries  # the synced one only
    assert key.endswith(".synced"), key
    empty = _ResultCollection(training=True)
    sums = []
    private.add_synced_metric(empty, key, fields, lambda value, **kwargs: sums.append(value) or value, torch.device("cpu"))
    metric = empty[key]
    assert metric.meta.name == "synced" and metric.meta.sync.should and metric.update_called
    assert key in dict(empty.valid_items())
    metric.compute()
    assert sums, "the strategy's reduction takes part in the epoch's value"


def test_forward_module_is_the_module_inside_fabrics_wrapper():
    linear = nn.Linear(2, 2)
    wrapped = Fabric(accelerator="cpu", devices=1).setup_module(linear)
    assert wrapped is not linear and private.forward_module(wrapped) is linear
    assert private.forward_module(linear) is linear


def test_the_child_process_observer_calls_the_check_lit_dp_replaces():
    observer = private._ChildProcessObserver(os.getpid(), [], sleep_period=0.01)
    assert private.observed_processes(observer) == []
    assert callable(private.observer_check(observer))
    private.replace_observer_check(observer, lambda: False)
    observer.start()
    try:
        assert observer in private.child_process_observers()
    finally:
        private.replace_observer_check(observer, lambda: True)  # Lightning's loop stops on True
        observer.join(timeout=30)
    assert not observer.is_alive()


def test_a_replacement_of_an_attribute_lightning_no_longer_has_fails_naming_the_version():
    with pytest.raises(AttributeError, match=rf"Lightning {lightning.__version__} has no object\._signal_connector"):
        private.replace_signal_connector(object(), None)


# --- No other module of lit_dp uses a private Lightning name ------------------------------------
@cache
def lightnings_private_names() -> frozenset[str]:
    """Every private name Lightning (and lightning_utilities) defines: functions, classes, module
    and class attributes, and attributes its methods set."""
    import lightning_utilities

    roots = [Path(lightning.__file__).parent / part for part in ("fabric", "pytorch")]
    roots.append(Path(lightning_utilities.__file__).parent)
    names = set()
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
    return frozenset(name for name in names if is_private(name))


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def uses_of_private_lightning_names(path: Path) -> list[str]:
    """Where ``path`` imports, reads or writes a private Lightning name itself (``file:line: what``)."""
    tree = ast.parse(path.read_text())
    where = f"{path.relative_to(LIBRARY.parent)}"
    found = []
    imports_lightning = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIGHTNING_PACKAGES:
            imports_lightning = True
            names = [alias.name for alias in node.names]
            if any(is_private(part) for part in node.module.split(".")) or any(is_private(name) for name in names):
                found.append(f"{where}:{node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIGHTNING_PACKAGES:
                    imports_lightning = True
                    if any(is_private(part) for part in alias.name.split(".")):
                        found.append(f"{where}:{node.lineno}: import {alias.name}")
    if not imports_lightning:
        return found  # the layers that know nothing of Lightning hold none of its objects
    lightnings = lightnings_private_names()
    module = importlib.import_module(module_name(path))
    for class_node in [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]:
        cls = getattr(module, class_node.name, None)
        bases = [base for base in getattr(cls, "__mro__", ())[1:] if base.__module__.split(".")[0] in LIGHTNING_PACKAGES]
        inherited = set().union(*(lightning_members(base) for base in bases)) if bases else set()
        declared = {member for base in bases for member in private.SUBCLASSED.get(base, ())}
        for node in ast.walk(class_node):
            name = None
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self":
                name = node.attr
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            if name in inherited and name not in declared | set(private.DDP_STRATEGY_NAMES):
                found.append(f"{where}:{node.lineno}: {class_node.name} uses {name}, a private member of its Lightning "
                             "base class not declared in lightning_private.SUBCLASSED")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in lightnings and ast.unparse(node.value) not in ("self", "cls"):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in lightnings
        ):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("package", [LIBRARY, RECIPES], ids=lambda package: package.name)
def test_no_other_module_of_lit_dp_or_the_recipes_uses_a_private_lightning_name(package):
    paths = [path for path in sorted(package.rglob("*.py")) if path != HOME]
    found = [use for path in paths for use in uses_of_private_lightning_names(path)]
    assert not found, (
        f"private Lightning names (Lightning {lightning.__version__}) used outside "
        "lit_dp/strategies/lightning_private.py: move each there, behind a function or a public name:\n"
        + "\n".join(found)
    )


def test_the_scan_finds_each_kind_of_use(tmp_path, monkeypatch):
    """The scan itself (a scan that finds nothing passes everything)."""
    package = tmp_path / "lit_dp_scan_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(textwrap.dedent('''
        from lightning.pytorch.strategies import ParallelStrategy
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available
        from lightning.pytorch.trainer.connectors import signal_connector


        class Probe(ParallelStrategy):
            def _configure_launcher(self):
                self._launcher = None
                self._lightning_optimizers = []


        def reach(trainer, module):
            trainer._signal_connector = None
            return getattr(module, "_trainer"), module._options
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(f"{__name__}.LIBRARY", package)
    uses = uses_of_private_lightning_names(package / "probe.py")
    assert [use.split(": ", 1)[1] for use in uses] == [
        "from lightning.fabric.utilities.distributed import _sync_ddp_if_available",
        "Probe uses _lightning_optimizers, a private member of its Lightning base class not declared in "
        "lightning_private.SUBCLASSED",
        "trainer._signal_connector",
        "getattr(module, '_trainer')",
    ], uses


def test_the_ranks_a_script_launcher_starts_are_started_by_lightnings_own_method(monkeypatch):
    from lit_dp.strategies.lightning_private import FabricScriptLauncher, TrainerScriptLauncher, start_script_ranks

    for launcher_class in (TrainerScriptLauncher, FabricScriptLauncher):
        started = []
        monkeypatch.setattr(launcher_class, "_call_children_scripts", started.append)
        start_script_ranks("the launcher", launcher_class)
        assert started == ["the launcher"]
