"""One replica group of the Lightning fault-tolerance tests: the Trainer or Fabric with ``fault_tolerance="torchft"``.

    python -m tests.helpers.ft_lightning_replica OUT STEPS {trainer,fabric} [--kill GROUP:STEP] [--alone-seconds S]
        [--accumulate N] [--min-replicas N] [--quorum-timeout S] [--local-sgd K] [--save-at STEP] [--resume FOLDER]

The replica group comes from ``REPLICA_GROUP_ID``, the lighthouse from ``TORCHFT_LIGHTHOUSE``
(torchft's launch variables, which the strategy reads). Every step attempt appends one JSON line
to ``OUT/replica<group>.jsonl``: torchft's committed steps after it, whether it committed, the
quorum's rank, the samples each of its micro-batches read, and a hash of the parameters' bytes at
the step's start (after the quorum, and after a recovery) and at its end. ``--kill`` and
``--alone-seconds`` as in ``tests.helpers.ft_replica``; ``--accumulate``: the Trainer's
``accumulate_grad_batches``; ``--min-replicas`` and ``--quorum-timeout``: ``ft_min_replicas`` and
``ft_quorum_timeout``; ``--local-sgd K``: DiLoCo (``local_sgd_steps=K``, ``local_sgd_outer="nesterov"``),
whose groups take a quorum only at a sync; ``--save-at`` and ``--resume`` (Fabric): ``fabric.save`` of
the model and optimizer to ``OUT/fabric<group>.ckpt`` after the step that commits step STEP, and a run
that starts with ``fabric.load`` of ``FOLDER/fabric<group>.ckpt`` (a whole-job restart). The Trainer
logs to ``OUT/replica<group>/`` (CSV) and writes its final ``global_step`` to ``OUT/replica<group>.steps``
and its loop counters (those it decides validation and the epoch's end by) to ``OUT/replica<group>.loops``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lit_dp
from tests.helpers.ft_replica import BATCH, CLASSES, DATASET_SIZE, FEATURES, parameters_hash


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(DATASET_SIZE, FEATURES, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (DATASET_SIZE,), generator=generator), torch.arange(DATASET_SIZE))


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES))

    def training_step(self, batch, batch_idx):
        inputs, targets, _ = batch
        loss = F.cross_entropy(self.net(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Recorder:
    """The JSON lines of one replica, and the kill."""

    def __init__(self, out: Path, group: int, kill: str, alone_seconds: float) -> None:
        self.path = out / f"replica{group}.jsonl"
        self.group, self.alone_seconds = group, alone_seconds
        self.victim, self.die_at = (int(part) for part in kill.split(":"))
        self.died = out / f"replica{group}.died"
        self.start: dict = {}

    def step_started(self, ft, module: nn.Module, indices: torch.Tensor) -> None:
        manager = ft.manager
        self.start = {"rank": manager.participating_rank(), "indices": [indices.tolist()], "start": parameters_hash(module)}
        step, participants = ft.committed_steps, manager.num_participants()
        if self.group == self.victim and step >= self.die_at and participants > 1 and not self.died.exists():
            self.died.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # after the quorum, before the all-reduce: the others' step fails

    def micro_batch(self, indices: torch.Tensor) -> None:
        """A later micro-batch of the step (gradient accumulation)."""
        self.start["indices"].append(indices.tolist())

    def step_ended(self, ft, module: nn.Module) -> None:
        line = {**self.start, "committed_steps": ft.committed_steps, "committed": ft.last_committed, "end": parameters_hash(module)}
        with self.path.open("a") as record:
            record.write(json.dumps(line) + "\n")
        if ft.manager.num_participants() == 1:
            time.sleep(self.alone_seconds)


class RecordingCallback(pl.Callback):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The loop counted this batch as ready before the hook: micro-batch (ready - 1) % N of its step.
        if (_ready(trainer) - 1) % trainer.accumulate_grad_batches == 0:
            self.recorder.step_started(trainer.strategy.fault_tolerance, pl_module, batch[2])
        else:
            self.recorder.micro_batch(batch[2])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if _ready(trainer) % trainer.accumulate_grad_batches == 0:
            self.recorder.step_ended(trainer.strategy.fault_tolerance, pl_module)


def _ready(trainer: pl.Trainer) -> int:
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


def trainer_replica(out: Path, steps: int, recorder: Recorder, group: int, accumulate: int, options: dict) -> None:
    model = Classifier()
    trainer = pl.Trainer(
        strategy=lit_dp.PaddleDPStrategy(fault_tolerance="torchft", ft_timeout=10, **options),
        accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=1, accumulate_grad_batches=accumulate,
        logger=CSVLogger(out, name=f"replica{group}", version=0), callbacks=[RecordingCallback(recorder)], default_root_dir=out,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    torch.save(model.state_dict(), out / f"replica{group}.pt")
    (out / f"replica{group}.steps").write_text(str(trainer.global_step))
    (out / f"replica{group}.loops").write_text(json.dumps(loop_counters(trainer)))


def loop_counters(trainer: pl.Trainer) -> dict:
    """The fit loop's counters: its epochs, batches (validation is due by their count), optimizer steps."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return {
        "epochs": trainer.fit_loop.epoch_progress.state_dict(),
        "batches": epoch_loop.batch_progress.state_dict(),
        "optimizer": epoch_loop.automatic_optimization.optim_progress.state_dict(),
        "batches_that_stepped": epoch_loop._batches_that_stepped,
    }


def fabric_replica(
    out: Path, steps: int, recorder: Recorder, group: int, options: dict, save_at: int | None, resume: Path | None
) -> None:
    fabric = Fabric(strategy=lit_dp.fabric.PaddleDPStrategy(fault_tolerance="torchft", ft_timeout=10, **options), accelerator="cpu", devices=1)
    fabric.launch()  # one process: its process group of one rank
    net = Classifier().net
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    state = {"model": model, "optimizer": optimizer}
    if resume is not None:
        fabric.load(resume / f"fabric{group}.ckpt", state)
    ft = fabric.strategy.fault_tolerance
    while ft.committed_steps < steps:
        for inputs, targets, indices in loader:
            recorder.step_started(ft, net, indices)
            fabric.backward(F.cross_entropy(model(inputs), targets))
            optimizer.step()  # applied only if the step commits
            optimizer.zero_grad()
            recorder.step_ended(ft, net)
            if ft.last_committed and ft.committed_steps == save_at:
                fabric.save(out / f"fabric{group}.ckpt", state)
            if ft.committed_steps >= steps:
                break
    torch.save(net.state_dict(), out / f"replica{group}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("front", choices=["trainer", "fabric"])
    parser.add_argument("--kill", default="-1:-1", help="GROUP:STEP")
    parser.add_argument("--alone-seconds", type=float, default=0.0)
    parser.add_argument("--accumulate", type=int, default=1, help="the Trainer's accumulate_grad_batches")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--quorum-timeout", type=float, default=60.0)
    parser.add_argument("--local-sgd", type=int, default=None, help="K: DiLoCo, a sync every K steps")
    parser.add_argument("--save-at", type=int, default=None, help="Fabric: save after the step that commits STEP")
    parser.add_argument("--resume", type=Path, default=None, help="Fabric: load FOLDER/fabric<group>.ckpt first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])
    torch.manual_seed(group)  # different starts: torchft's init_sync makes them one
    recorder = Recorder(args.out, group, args.kill, args.alone_seconds)
    options = {"ft_min_replicas": args.min_replicas, "ft_quorum_timeout": args.quorum_timeout}
    if args.local_sgd is not None:
        options.update(local_sgd_steps=args.local_sgd, local_sgd_outer="nesterov")
    if args.front == "trainer":
        trainer_replica(args.out, args.steps, recorder, group, args.accumulate, options)
    else:
        fabric_replica(args.out, args.steps, recorder, group, options, args.save_at, args.resume)


if __name__ == "__main__":
    main()
