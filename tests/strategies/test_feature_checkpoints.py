"""Checkpoints written before the features had one protocol resume with the same state.

``data/checkpoint_66206ac.ckpt`` was written by lit_dp at commit 66206ac, the last before
``lit_dp.strategies.feature``, by ``scripts/make_resume_checkpoint.py``: a one-rank fit with
``comm_buffer_size="auto"`` and LocalSGD, stopped inside its first epoch. Its ``lit_dp`` entry
holds ``tuned_comm_buffer_size``, ``local_sgd`` and ``loader`` in that commit's layout; each
feature reads its own entry back. The file is kept: a later change that cannot resume it breaks
users' checkpoints.
"""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lit_dp.data_parallel import DataParallel
from lit_dp.options.local_sgd import AUTOTUNE_STEPS
from tests.strategies.scripts.make_resume_checkpoint import STOP_AFTER, tiny_fit

CHECKPOINT = Path(__file__).parent / "data" / "checkpoint_66206ac.ckpt"
# Since issue 39, comm_buffer_size="auto" with LocalSGD needs a warm-up the tuner can time (LocalSGD's
# local phase all-reduces no gradient): the checkpoint's run (a warm-up of 3) is resumed with one that
# long; the restored schedule and size are what is compared.
WARMUP = AUTOTUNE_STEPS


class _Look(pl.Callback):
    """What the strategy holds once the fit is set up, before its first step; a checkpoint at the epoch's end."""

    def __init__(self, end: Path) -> None:
        self.seen: dict = {}
        self.end = end

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.end)

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        assert isinstance(strategy.model, DataParallel)
        self.seen = {
            "local_sgd": strategy.local_sgd.state_dict(),
            "tuned": strategy.tuned_comm_buffer_size,
            "bucket_size": strategy.model.comm_buffer_size,
            "autotuner": strategy.model.autotuner,
        }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return tiny_fit(tmp_path_factory.mktemp("reference"), [], warmup_steps=WARMUP)[1]


def test_the_checkpoint_holds_the_entries_of_its_commit():
    entry = torch.load(CHECKPOINT, weights_only=False)["lit_dp"]
    assert set(entry) == {"tuned_comm_buffer_size", "local_sgd", "loader"}


def test_the_loader_position_localsgd_schedule_and_tuned_size_are_resumed(tmp_path, uninterrupted):
    saved = torch.load(CHECKPOINT, weights_only=False)["lit_dp"]
    look = _Look(tmp_path / "end.ckpt")
    trainer, resumed = tiny_fit(tmp_path, [look], ckpt_path=str(CHECKPOINT), warmup_steps=WARMUP)
    # LocalSGD's schedule: the averager built by setup took the saved one (entries added later aside).
    assert {key: look.seen["local_sgd"][key] for key in saved["local_sgd"]} == saved["local_sgd"]
    # The tuned size replaced "auto" when the model was wrapped: no step spent tuning again.
    assert look.seen["tuned"] == look.seen["bucket_size"] == saved["tuned_comm_buffer_size"]
    assert look.seen["autotuner"] is None
    # The loader went on after the batches the checkpoint had trained, in the epoch's order.
    trained = STOP_AFTER - 1
    assert resumed.seen == uninterrupted.seen[trained:]
    assert trainer.global_step == len(uninterrupted.seen)
    # And the next checkpoint keeps every entry, in the same layout.
    entry = torch.load(look.end, weights_only=False)["lit_dp"]
    assert entry["tuned_comm_buffer_size"] == saved["tuned_comm_buffer_size"]
    assert entry["loader"] == saved["loader"]
    assert entry["local_sgd"]["step"] == len(uninterrupted.seen)
