"""LightningCLI over Lightning's ``BoringModel``: lit_dp configured as LightningCLI users configure it.

    python -m lit_dp_recipes.lightning_cli fit --trainer.strategy=paddle_dp --trainer.strategy.comm_buffer_size=5
    python -m lit_dp_recipes.lightning_cli fit --config my.yaml     # trainer.strategy: {class_path: lit_dp.PaddleDPStrategy, init_args: {...}}

Any script of yours that calls ``LightningCLI`` works the same once it imports ``lit_dp``, which
registers ``paddle_dp`` (docs/strategy.md, "LightningCLI").
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import lit_dp  # noqa: F401 - registers "paddle_dp" and its families with the Trainer


def main() -> None:
    LightningCLI(BoringModel, BoringDataModule)


if __name__ == "__main__":
    main()
