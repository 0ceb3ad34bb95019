"""The recipes' callbacks: the MFU arithmetic, the throughput meter's options, the recompile counter."""

from __future__ import annotations

import pytest
import torch

import lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dp_recipes.callbacks import CompileModel, DynamoRecompiles, TokenThroughput, peak_bf16_flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ],
)
def test_peak_bf16_flops_by_device_name(name, peak):
    assert peak_bf16_flops(name) == peak


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"warmup": 0}, r"callbacks.throughput.warmup=0 is invalid: expected an integer >= 1"),
        ({"peak_flops": -1.0}, r"callbacks.throughput.peak_flops=-1.0 is invalid: expected a positive FLOP/s"),
    ],
)
def test_bad_throughput_options_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        TokenThroughput(**options)



class TinyRegression(pl.LightningModule):
    def __init__(self, train_samples: int) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.train_samples = train_samples

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = ((self(batch[0]) - batch[1]) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", ((self(batch[0]) - batch[1]) ** 2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def _loader(self, samples: int) -> DataLoader:
        x = torch.randn(samples, 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def train_dataloader(self):
        return self._loader(self.train_samples)

    def val_dataloader(self):
        return self._loader(8)


@pytest.mark.parametrize(("train_samples", "recompiles"), [(16, 0), (14, 1)], ids=["full_batches", "short_last_batch"])
def test_recompiles_after_the_warmup_are_counted(tmp_path, train_samples, recompiles):
    # 14 samples in batches of 4: the fourth step's batch of 2 is a new shape, compiled after the warm-up.
    counter = DynamoRecompiles(warmup=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[CompileModel("eager"), counter],
    )
    torch._dynamo.reset()
    trainer.fit(TinyRegression(train_samples))
    # The validation graph (no grad) is compiled by the first validation batch: its warm-up.
    assert counter.recompiles == recompiles
    assert trainer.callback_metrics["dynamo_recompiles"] == recompiles


def test_a_line_per_validation_has_the_step_the_metrics_to_sensible_precision_and_the_pace(capsys, monkeypatch):
    from types import SimpleNamespace

    from lit_dp_recipes import callbacks
    from lit_dp_recipes.callbacks import ProgressLines

    clock = iter([100.0, 110.0])
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    trainer = SimpleNamespace(sanity_checking=False, is_global_zero=True, current_epoch=0, global_step=0, callback_metrics={})
    lines = ProgressLines()
    lines.on_train_start(trainer, None)
    trainer.global_step = 25
    trainer.callback_metrics = {"train_loss": torch.tensor(2.123456), "tokens_per_sec": torch.tensor(24100.7129),
                                "val_loss": torch.tensor(1.5), "comm/time_ms": torch.tensor(1.0)}
    lines.on_validation_end(trainer, None)
    assert capsys.readouterr().out == (
        "[lit_dp] epoch 0, step 25: tokens_per_sec=24101 train_loss=2.1235 val_loss=1.5000 (2.50 steps/s)\n"
    )


def test_metrics_are_printed_to_the_digits_that_mean_something():
    from lit_dp_recipes.report import metric

    assert [metric(v) for v in (0.97222, 24100.7129, 512.345, -3.14159, 0.0)] == ["0.9722", "24101", "512.3", "-3.1416", "0.0000"]
