"""Handwritten digits (scikit-learn's bundled 8x8 images; no download) and an MLP classifier."""

from __future__ import annotations

import functools
import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dp_recipes.config import is_fraction, is_number


@functools.cache
def _digits() -> Any:
    """scikit-learn's digits, read once a process (the checks before the ranks start read them too)."""
    return load_digits()


class DigitsDataModule(pl.LightningDataModule):
    """1,797 images of 64 pixels in 10 classes, split once with a fixed seed."""

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, split_seed: int = 0, num_workers: int = 0):
        super().__init__()
        for option, value, least in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"data.{option}={value!r} is invalid: expected an integer >= {least}.")
        if not is_fraction(val_fraction):
            raise ValueError(f"data.val_fraction={val_fraction!r} is invalid: expected a number in (0, 1).")
        if isinstance(split_seed, bool) or not isinstance(split_seed, int):
            raise ValueError(f"data.split_seed={split_seed!r} is invalid: expected an integer.")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.num_workers = num_workers

    def setup(self, stage: str | None = None) -> None:
        digits = _digits()
        images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(len(labels) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])

    def train_batches(self, ranks: int) -> int:
        """The batches each of ``ranks`` ranks draws in an epoch, known before any rank starts: Lightning's
        ``DistributedSampler`` gives each rank ceil(samples / ranks) of the training split, and the last
        batch may be partial."""
        samples = len(_digits().target)
        per_rank = math.ceil((samples - int(samples * self.val_fraction)) / ranks)
        return math.ceil(per_rank / self.batch_size)

    def check_model(self, model: pl.LightningModule) -> None:
        """Before any rank starts: a model of ``in_features``/``num_classes`` (the MLP's) takes these images
        and their classes (it would fail at its first batch in every rank)."""
        digits = _digits()
        expected = {"in_features": digits.data.shape[1], "num_classes": len(set(digits.target.tolist()))}
        for key, value in expected.items():
            if key in model.hparams and model.hparams[key] != value:
                raise ValueError(
                    f"model.{key}={model.hparams[key]!r} is invalid with data=digits: expected {value} "
                    f"(the digits are {expected['in_features']} pixels in {expected['num_classes']} classes)."
                )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, num_workers=self.num_workers)


class MLPClassifier(pl.LightningModule):
    """A plain MLP; ``hidden_sizes`` scales it from a toy to a communication-heavy benchmark model."""

    METRICS = ("train_loss", "val_loss", "val_acc")  # what it logs (a test keeps them equal): the names `monitor` may take

    def __init__(self, in_features: int = 64, num_classes: int = 10, hidden_sizes: tuple[int, ...] = (128, 128), lr: float = 3e-3):
        super().__init__()
        for option, value in (("in_features", in_features), ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{option}={value!r} is invalid: expected a positive integer.")
        if not isinstance(hidden_sizes, (list, tuple)) or not all(
            isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in hidden_sizes
        ):
            raise ValueError(f"model.hidden_sizes={hidden_sizes!r} is invalid: expected a list of positive integers, e.g. [128,128].")
        if not (is_number(lr) and lr > 0):
            raise ValueError(f"model.lr={lr!r} is invalid: expected a positive learning rate.")
        self.save_hyperparameters()
        sizes = [in_features, *hidden_sizes]
        layers: list[nn.Module] = []
        for width_in, width_out in zip(sizes, sizes[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True, prog_bar=True)
        self.log("val_acc", (logits.argmax(dim=1) == labels).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
