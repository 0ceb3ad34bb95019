"""``broadcast_buffers`` through the Trainer and Fabric strategies, against Lightning's ``"ddp"``.

Each rank is its own process (Paddle's launcher variables) and trains on its own batches, so
BatchNorm's running statistics differ between ranks unless the first rank's are broadcast
before each forward (torch DDP's default, ``broadcast_buffers=True``). After a few steps every
rank's weights and buffers must equal those Lightning's ``DDPStrategy`` gives that rank, with
the argument on and off; the two settings must give different buffers, or the check proves
nothing. Tolerance: ``assert_close``'s defaults (the same sums, reordered at most).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from lit_dp import PaddleDPStrategy, PaddleEnvironment, fabric
from tests.helpers.distributed import run_ranks
from tests.helpers.lightning import trainer

STEPS = 3


class Normalised(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s own batches, different on each rank (so are their BatchNorm statistics)."""
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(STEPS, 4, 6, generator=generator) * (1 + rank)
    return [(x[step], x[step].sum(dim=1, keepdim=True).sin()) for step in range(STEPS)]


def state(module: nn.Module) -> dict[str, list]:
    return {key: value.tolist() for key, value in module.state_dict().items()}


def fit(strategy, rank: int, tmp_path: str) -> dict[str, list]:
    module = Normalised()
    run = trainer(strategy, tmp_path, max_epochs=1, use_distributed_sampler=False, num_sanity_val_steps=0)
    run.fit(module, DataLoader(batches(rank), batch_size=None))
    return state(module)


def loop(strategy, rank: int) -> dict[str, list]:
    run = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    run.launch()  # Paddle's launcher started the processes: nothing to launch
    module = Normalised()
    model, optimizer = run.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for x, y in batches(rank):
        run.backward(((model(x) - y) ** 2).mean())
        optimizer.step()
        optimizer.zero_grad()
    return state(module)


def both_front_doors(rank: int, tmp_path: str) -> dict:
    """Trainer and Fabric, paddle_dp and ddp, broadcast_buffers on and off, in one process: the
    first run creates the process group, the others adopt it."""
    results: dict = {}
    for broadcast in (True, False):
        results["trainer", broadcast] = (
            fit(PaddleDPStrategy(broadcast_buffers=broadcast), rank, tmp_path),
            fit(DDPStrategy(broadcast_buffers=broadcast, cluster_environment=PaddleEnvironment()), rank, tmp_path),
        )
        results["fabric", broadcast] = (
            loop(fabric.PaddleDPStrategy(broadcast_buffers=broadcast), rank),
            loop(FabricDDPStrategy(broadcast_buffers=broadcast, cluster_environment=PaddleEnvironment()), rank),
        )
    return results


@pytest.mark.slow
def test_batchnorm_buffers_match_ddp_with_broadcast_buffers_on_and_off(tmp_path):
    results = run_ranks(both_front_doors, 2, str(tmp_path), timeout=240)
    for rank, outcome in results.items():
        for (front_door, broadcast), (ours, theirs) in outcome.items():
            for key in theirs:
                torch.testing.assert_close(
                    torch.tensor(ours[key]),
                    torch.tensor(theirs[key]),
                    msg=lambda m: f"rank {rank}, {front_door}, broadcast_buffers={broadcast}, {key}: {m}",
                )
    for front_door in ("trainer", "fabric"):  # rank 1 keeps its own statistics only when off
        on, off = results[1][front_door, True][1], results[1][front_door, False][1]
        assert on["net.1.running_mean"] != off["net.1.running_mean"], f"{front_door}: the setting changed nothing"
