"""A sharded checkpoint as one file: ``python -m lit_dp.checkpoint.consolidate`` (and Lightning's own command).

The oracle is the full-format checkpoint of the same fit: the consolidated file holds its entries (the
optimizer state in torch's form, so that a fit resumes from it), ``LightningModule.load_from_checkpoint``
reads it, and Lightning's ``consolidate_checkpoint`` reads the folder to the same weights.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_dp import PaddleDPStrategy
from tests.checkpoint.test_writers import assert_same
from tests.helpers.lightning import trainer
from tests.helpers.recipes import ROOT
from tests.strategies.test_checkpointing import AdamRegressor


class Remembered(AdamRegressor):
    """With hyper-parameters, which load_from_checkpoint rebuilds the module from."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()


def _fit(tmp_path, state_dict_type):
    run = trainer(PaddleDPStrategy(state_dict_type=state_dict_type), tmp_path / state_dict_type, devices=1, max_epochs=1,
                  enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / state_dict_type, save_last=True)])  # fmt: skip
    run.fit(Remembered())
    return tmp_path / state_dict_type / "last.ckpt"


def _command(*arguments: str) -> str:
    result = subprocess.run([sys.executable, "-m", *arguments], capture_output=True, text=True, timeout=300,  # a loaded 2-core machine
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fits")
    return _fit(tmp_path, "full"), _fit(tmp_path, "sharded")


def test_the_consolidated_folder_is_the_full_file(fitted, tmp_path):
    full, folder = fitted
    output = tmp_path / "last.full.ckpt"
    assert _command("lit_dp.checkpoint.consolidate", str(folder), "--output_file", str(output)).strip() == (
        f"[lit_dp] {folder} consolidated into {output}"
    )
    ours, theirs = torch.load(output, weights_only=False), torch.load(full, weights_only=False)
    for key in ("state_dict", "optimizer_states", "loops", "epoch", "global_step", "hyper_parameters"):
        assert_same(ours[key], theirs[key], key)
    loaded = Remembered.load_from_checkpoint(output)
    assert_same(loaded.state_dict(), theirs["state_dict"], "load_from_checkpoint")
    with pytest.raises(subprocess.CalledProcessError):  # the output is never overwritten
        subprocess.run([sys.executable, "-m", "lit_dp.checkpoint.consolidate", str(folder), "--output_file", str(output)],
                       check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


@pytest.mark.slow
def test_lightnings_consolidate_command_reads_the_folder_to_the_same_weights(fitted, tmp_path):
    full, folder = fitted
    output = tmp_path / "by_lightning.ckpt"
    _command("lightning.pytorch.utilities.consolidate_checkpoint", str(folder), "--output_file", str(output))
    loaded = Remembered.load_from_checkpoint(output)
    assert_same(loaded.state_dict(), torch.load(full, weights_only=False)["state_dict"], "Lightning's consolidation")
