import os

import pytest
import torch

from lit_dp.strategies.checkpoint_io import PARTIAL_MARKER, AtomicCheckpointIO


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
