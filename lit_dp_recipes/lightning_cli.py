"""LightningCLI over Lightning's ``BoringModel``: lit_dp configured as LightningCLI users configure it.

    python -m lit_dp_recipes.lightning_cli fit --trainer.strategy=paddle_dp --trainer.strategy.comm_buffer_size=5
    python -m lit_dp_recipes.lightning_cli fit --config my.yaml     # trainer.strategy: {class_path: lit_dp.PaddleDPStrategy, init_args: {...}}

Any script of yours that calls ``LightningCLI`` works the same once it imports ``lit_dp``, which
registers ``paddle_dp`` (docs/strategy.md, "LightningCLI").
"""

from __future__ import annotations

import re
import sys

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import lit_dp  # noqa: F401 - registers "paddle_dp" and its families with the Trainer

# The strategy's refusal of a value (``comm_buffer_size=-1.0 is invalid: ...``) as jsonargparse
# reports it: one of its tries of each type ``trainer.strategy`` may take, in a traceback.
STRATEGY_REFUSAL = re.compile(r"^\s*- (\w+=\S* is invalid: .*)$", re.MULTILINE)


def main() -> None:
    try:
        LightningCLI(BoringModel, BoringDataModule)
    except ValueError as error:  # as the strategy is built, before any rank starts
        refusal = STRATEGY_REFUSAL.search(str(error))
        if refusal is None:
            raise
        sys.exit(f"error: trainer.strategy.{refusal.group(1)}")


if __name__ == "__main__":
    main()
