"""One replica group of several ranks under Fabric with ``fault_tolerance="torchft"``, run by torchrun.

    torchrun --standalone --nproc-per-node=2 -m tests.helpers.ft_fabric_group OUT STEPS [--local-sgd K]

The loop docs/fault_tolerance.md shows for Fabric, with ``devices`` the launcher's ranks (with
``--local-sgd K``, DiLoCo across the groups: ``local_sgd_steps=K, local_sgd_outer="nesterov"``);
each rank writes the parameters it ends with to ``OUT/replica<group>-rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import lit_dp
from tests.helpers.ft_lightning_replica import Classifier, dataset
from tests.helpers.ft_replica import BATCH


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--local-sgd", type=int, default=None, help="K")
    args = parser.parse_args()
    torch.set_num_threads(1)
    group, ranks = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(group * ranks + int(os.environ["RANK"]))  # every rank differs: they must start as one
    diloco = {"local_sgd_steps": args.local_sgd, "local_sgd_outer": "nesterov"} if args.local_sgd else {}
    strategy = lit_dp.fabric.PaddleDPStrategy(fault_tolerance="torchft", ft_timeout=10, ft_min_replicas=2, **diloco)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=ranks)
    fabric.launch()
    net = Classifier().net
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    ft = fabric.strategy.fault_tolerance

    def steps() -> int:  # torchft counts the syncs under DiLoCo: the steps are LocalSGD's
        return fabric.strategy.local_sgd.step_count if args.local_sgd else ft.committed_steps

    while steps() < args.steps:
        for inputs, targets, _ in loader:
            fabric.backward(F.cross_entropy(model(inputs), targets))
            optimizer.step()  # applied only if the step commits
            optimizer.zero_grad()
            if steps() >= args.steps:
                break
    fabric.strategy.teardown()  # LocalSGD's last sync, when the run did not end on one
    torch.save(net.state_dict(), args.out / f"replica{group}-rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
