"""One replica group of several ranks under the Trainer, DiLoCo across the groups, saving once and resuming.

    torchrun --standalone --nproc-per-node=2 -m tests.helpers.ft_resume OUT STEPS [--sync-dtype D] [--save-at N]
        [--resume CHECKPOINT_FOLDER]

The classifier of ``tests.helpers.ft_lightning_replica`` (``--hidden``: its width) under
``PaddleDPStrategy(fault_tolerance="torchft", local_sgd_steps=2, local_sgd_outer="nesterov")`` with
``local_sgd_sync_dtype`` D, for STEPS optimizer steps. ``--save-at N``: a checkpoint after step N
(``ModelCheckpoint``, to ``OUT/group<g>/``); ``--resume FOLDER``: the fit resumes from
``FOLDER/group<g>/``'s checkpoint (``ckpt_path``). At the end every rank saves its parameters to
``OUT/group<g>-rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lit_dp
from tests.helpers.ft_lightning_replica import Classifier, dataset
from tests.helpers.ft_replica import BATCH


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--sync-dtype", default=None, help="local_sgd_sync_dtype")
    parser.add_argument("--hidden", type=int, default=16, help="the classifier's hidden width")
    parser.add_argument("--save-at", type=int, default=None, help="N: a checkpoint after optimizer step N")
    parser.add_argument("--resume", type=Path, default=None, help="FOLDER: resume from FOLDER/group<g>/'s checkpoint")
    args = parser.parse_args()
    torch.set_num_threads(1)
    group, ranks, rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(group * ranks + rank)  # every rank differs: they must start as one
    strategy = lit_dp.PaddleDPStrategy(
        fault_tolerance="torchft", ft_timeout=20, ft_min_replicas=2, local_sgd_steps=2, local_sgd_outer="nesterov",
        local_sgd_sync_dtype=args.sync_dtype,
    )  # fmt: skip
    saves = [ModelCheckpoint(args.out / f"group{group}", every_n_train_steps=args.save_at, save_top_k=-1)] if args.save_at else []
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=ranks, max_steps=args.steps, default_root_dir=args.out / f"root{group}",
        callbacks=saves, enable_checkpointing=bool(saves), logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Classifier(args.hidden)
    resume = next((args.resume / f"group{group}").glob("*.ckpt")) if args.resume else None
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH, shuffle=True), ckpt_path=resume)
    torch.save(model.state_dict(), args.out / f"group{group}-rank{rank}.pt")


if __name__ == "__main__":
    main()
