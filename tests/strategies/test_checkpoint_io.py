import os
import shutil
import subprocess
import sys

import pytest
import torch

from lit_dp import PaddleDPStrategy, fabric
from lit_dp.strategies.checkpoint_io import PARTIAL_MARKER, AtomicCheckpointIO
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
