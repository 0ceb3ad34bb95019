"""LightningCLI over Lightning's ``BoringModel``: lit_dp configured as LightningCLI users configure it.

    python -m lit_dp_recipes.lightning_cli fit --trainer.strategy=paddle_dp --trainer.strategy.comm_buffer_size=5
    python -m lit_dp_recipes.lightning_cli fit --config my.yaml     # trainer.strategy: {class_path: lit_dp.PaddleDPStrategy, init_args: {...}}

Any script of yours that calls ``LightningCLI`` works the same once it imports ``lit_dp``, which
registers ``paddle_dp`` (docs/strategy.md, "LightningCLI").
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import lit_dp  # noqa: F401 - registers "paddle_dp" and its families with the Trainer
from lit_dp_recipes.spelling import did_you_mean

# The strategy's refusal of a value (``comm_buffer_size=-1.0 is invalid: ...``) as jsonargparse
# reports it: one of its tries of each type ``trainer.strategy`` may take, in a traceback.
STRATEGY_REFUSAL = re.compile(r"^\s*- (\w+=\S* is invalid: .*)$", re.MULTILINE)
# lit_dp's strategy chosen on the command line, by a registered name or its class path.
LIT_DP_STRATEGY = re.compile(r"--trainer\.strategy(?:\.class_path)?=(paddle_dp\w*|lit_dp\.\S+)$")
# One of its options: --trainer.strategy.<option>[=value], init_args spelt or not.
STRATEGY_OPTION = re.compile(r"--trainer\.strategy\.(?:init_args\.)?(\w+)(?:=|$)")


def strategy_option_mistake(arguments: Sequence[str]) -> str | None:
    """A ``--trainer.strategy.<option>`` that lit_dp's strategy does not take, named with the near
    options: jsonargparse's own report is a usage screen that suggests none."""
    chosen = next((m.group(1) for m in map(LIT_DP_STRATEGY.match, arguments) if m), None)
    if chosen is None:
        return None
    accepted = [name for name in inspect.signature(lit_dp.PaddleDPStrategy.__init__).parameters if name != "self"]
    for match in filter(None, map(STRATEGY_OPTION.match, arguments)):
        option = match.group(1)
        if option in accepted or option in ("class_path", "init_args"):
            continue
        hint = did_you_mean(option, accepted, lambda c: f"trainer.strategy.{c}")
        return f"error: trainer.strategy.{option} is not an option of {chosen}{': ' + hint if hint else ''} (docs/options.md lists them all)"
    return None


def main() -> None:
    if mistake := strategy_option_mistake(sys.argv[1:]):
        sys.exit(mistake)
    try:
        LightningCLI(BoringModel, BoringDataModule)
    except ValueError as error:  # as the strategy is built, before any rank starts
        refusal = STRATEGY_REFUSAL.search(str(error))
        if refusal is None:
            raise
        sys.exit(f"error: trainer.strategy.{refusal.group(1)}")


if __name__ == "__main__":
    main()
