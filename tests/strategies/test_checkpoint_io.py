"""AtomicCheckpointIO's writes, and the strategy's choice of writer beside a user's CheckpointIO plugin."""

import os
import shutil
import subprocess
import sys
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import StrategyRegistry

from lit_dp import PaddleDPStrategy, fabric
from lit_dp.strategies.checkpoint_io import PARTIAL_MARKER, AtomicCheckpointIO, write_atomically
from tests.helpers.lightning import Regressor, trainer
from tests.helpers.recipes import ROOT


class _FailsToPickle:
    def __reduce__(self):
        raise RuntimeError("the rank died while writing")


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_partial_file(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "weights": torch.ones(1000)}, path)
    with pytest.raises(RuntimeError, match="died while writing"):
        io.save_checkpoint({"global_step": 2, "weights": torch.zeros(1000), "last": _FailsToPickle()}, path)
    assert io.load_checkpoint(path)["global_step"] == 1
    assert os.listdir(path.parent) == ["last.ckpt"]


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint({"global_step": step}, path)
    assert io.load_checkpoint(path) == {"global_step": 2}
    assert not any(PARTIAL_MARKER in name for name in os.listdir(tmp_path))


class RecordingCheckpointIO(CheckpointIO):
    """A user's plugin with a writer of its own."""

    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved.append(os.path.basename(path))
        torch.save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return torch.load(path, weights_only=False)

    def remove_checkpoint(self, path):
        os.remove(path)


def test_a_users_plugin_is_used_as_given_where_ddp_would_use_it(tmp_path):
    plugin = RecordingCheckpointIO()
    # Trainer(plugins=...) was refused ("checkpoint_io set through both strategy class and plugins").
    run = trainer("paddle_dp", tmp_path, devices=1, max_epochs=1, limit_train_batches=2, plugins=[plugin],
                  enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    assert run.strategy.checkpoint_io is plugin
    run.fit(Regressor())
    assert "last.ckpt" in plugin.saved
    assert PaddleDPStrategy(checkpoint_io=plugin).checkpoint_io is plugin
    StrategyRegistry.register("paddle_dp_recording_io", PaddleDPStrategy, checkpoint_io=plugin, override=True)
    try:  # as Lightning's own test does: a registered name that carries the plugin
        assert pl.Trainer(strategy="paddle_dp_recording_io", accelerator="cpu", devices=2).strategy.checkpoint_io is plugin
    finally:
        StrategyRegistry.remove("paddle_dp_recording_io")


def test_fabric_uses_a_users_plugin_as_given_where_ddp_would_use_it(tmp_path):
    from lightning.fabric import Fabric

    # Fabric(plugins=...) was refused ("checkpoint_io set through both strategy class and plugins").
    for strategy in (fabric.PaddleDPStrategy(), "paddle_dp"):
        plugin = RecordingCheckpointIO()
        run = Fabric(strategy=strategy, plugins=[plugin], accelerator="cpu", devices=1)
        assert run.strategy.checkpoint_io is plugin, strategy
    run.launch()
    run.save(tmp_path / "state.ckpt", {"step": 1})
    assert plugin.saved == ["state.ckpt"]
    assert type(Fabric(strategy="paddle_dp", accelerator="cpu", devices=1).strategy.checkpoint_io) is AtomicCheckpointIO


def test_atomic_writes_are_the_default_and_the_base_of_a_wrapping_plugin():
    assert isinstance(PaddleDPStrategy().checkpoint_io, AtomicCheckpointIO)
    for name, base in (("paddle_dp", AtomicCheckpointIO), ("ddp", TorchCheckpointIO)):
        wrapping = AsyncCheckpointIO()  # Lightning fills its base with the strategy's default
        run = pl.Trainer(strategy=name, plugins=[wrapping], accelerator="cpu", devices=2, logger=False)
        assert run.strategy.checkpoint_io is wrapping and type(wrapping.checkpoint_io) is base, name
        wrapping.teardown()


class CustomLoading(TorchCheckpointIO):
    """A user's plugin that changes only loading: it saves with TorchCheckpointIO's own writer."""

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return {**super().load_checkpoint(path, weights_only=False), "loaded_by": "CustomLoading"}


def test_a_plugin_saving_with_torchs_writer_gets_atomic_local_writes(tmp_path):
    strategy = PaddleDPStrategy(checkpoint_io=CustomLoading())
    path = tmp_path / "sub" / "step.ckpt"
    with mock.patch("lit_dp.checkpoint.full.write_atomically", wraps=write_atomically) as atomic:
        strategy.save_checkpoint({"global_step": 3}, path)
        atomic.assert_called_once_with({"global_step": 3}, path)
        strategy = PaddleDPStrategy(checkpoint_io=RecordingCheckpointIO())
        strategy.save_checkpoint({"global_step": 4}, tmp_path / "own.ckpt")
        atomic.assert_called_once()  # a writer of the plugin's own is the plugin's business
    assert CustomLoading().load_checkpoint(path) == {"global_step": 3, "loaded_by": "CustomLoading"}
    assert os.listdir(path.parent) == ["step.ckpt"]


def test_both_strategies_write_atomically_unless_given_another_writer():
    assert type(PaddleDPStrategy().checkpoint_io) is AtomicCheckpointIO
    assert type(fabric.PaddleDPStrategy().checkpoint_io) is AtomicCheckpointIO
    mine = AtomicCheckpointIO()
    assert fabric.PaddleDPStrategy(checkpoint_io=mine).checkpoint_io is mine


# Run inside a mount namespace of its own (`unshare`), on a 256 KiB tmpfs: a real full disk.
_FULL_DISK_SCRIPT = """
import errno, sys, torch
from pathlib import Path
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO, CheckpointWriteError
path = Path(sys.argv[1]) / "checkpoints" / "last.ckpt"
io = AtomicCheckpointIO()
io.save_checkpoint({"global_step": 1, "weights": torch.ones(1000)}, path)
try:
    io.save_checkpoint({"global_step": 2, "weights": torch.zeros(200_000)}, path)
except CheckpointWriteError as error:
    assert error.errno == errno.ENOSPC, error.errno
    print(error)
assert io.load_checkpoint(path)["global_step"] == 1
print(sorted(p.name for p in path.parent.iterdir()))
"""


def test_a_full_disk_names_the_checkpoint_and_keeps_the_previous_one(tmp_path):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode:
        pytest.skip("needs `unshare -Urm` (user and mount namespaces) to mount a small tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(_FULL_DISK_SCRIPT)
    command = f"mount -t tmpfs -o size=256k tmpfs {mount} && {sys.executable} {script} {mount}"
    result = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", command], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    message, listing = result.stdout.strip().splitlines()
    path = mount / "checkpoints" / "last.ckpt"
    assert message.startswith(f"[Errno 28] lit_dp: could not write the checkpoint {path}: No space left on device (")
    assert f" free of 256.0 KiB in {path.parent}); the previous file of that name, if any, is intact." in message
    assert "Remedy: free space there or point the checkpoints elsewhere" in message
    assert listing == "['last.ckpt']"  # no partial file left behind
