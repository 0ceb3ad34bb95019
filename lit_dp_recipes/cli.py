"""How a recipe starts: ``python -m lit_dp_recipes.run.<name> overrides...`` (``python recipes/<name>.py`` in a clone).

``recipe_main(task, config_name)`` is the ``main()`` of every recipe (``lit_dp_recipes.run``): Hydra's
``@hydra.main`` over ``conf/<config_name>.yaml`` (packaged as ``lit_dp_recipes/conf``), with what every recipe needs registered
first (the strategy and trainer schemas, the ``lit_dp.job_folder`` resolver of
``conf/hydra/default.yaml``), and one check of the command line before Hydra composes:
a ``strategy.<key>`` override that the selected strategy does not have is answered with the
options it does have that are spelled alike. Hydra would answer "To append to your config use
+strategy.<key>=...", which is the wrong advice for a misspelled option.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from lit_dp.options import TRAINER, declared_options
from lit_dp_recipes.config import register_configs

# The configs, shipped in the package; in the repository this folder is a link to conf/.
CONF_DIR = Path(__file__).resolve().parent / "conf"
HYDRA_VERSION_BASE = "1.3"
STRATEGY_GROUP = "strategy"


def recipe_main(task: Callable[[DictConfig], Any], config_name: str) -> Callable[[], None]:
    """The ``main()`` of a recipe script: checks the command line, then runs ``task`` under ``@hydra.main``."""
    register_configs()
    hydra_main = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base=HYDRA_VERSION_BASE)(task)

    def main() -> None:
        mistake = unknown_strategy_keys(config_name, sys.argv[1:])
        if mistake:
            sys.exit(mistake)
        hydra_main()

    return main


def unknown_strategy_keys(config_name: str, arguments: Sequence[str]) -> str | None:
    """A message naming each ``strategy.<key>=...`` in ``arguments`` that the selected strategy lacks, with
    the close matches among its options; None when every key exists (or there is none to check).

    The strategy is the one the command line selects (``strategy=ddp``; each choice of a sweep
    ``strategy=paddle_dp,ddp``), else the config's default, composed as Hydra will compose it.
    Keys added with ``+`` or removed with ``~`` are the user's business and not checked.
    """
    overrides = [argument for argument in arguments if not argument.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None  # a syntax error: Hydra's own message says where
    keys = [o.key_or_group for o in parsed if o.key_or_group.startswith(STRATEGY_GROUP + ".") and _changes(o)]
    if not keys:
        return None
    choices = [None]
    for override in parsed:
        if override.key_or_group == STRATEGY_GROUP and _changes(override):
            choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    problems = []
    for choice in choices:
        composed = _strategy_options(config_name, choice)
        if composed is None:
            return None  # the config does not compose without our overrides: Hydra says why
        name, options = composed
        for key in keys:
            option = key[len(STRATEGY_GROUP) + 1 :]
            if option not in options:
                problems.append(_did_you_mean(option, options, name))
    return "\n".join(dict.fromkeys(problems)) or None


def _changes(override: Override) -> bool:
    """A plain ``key=value`` (no ``+``, ``++`` or ``~``) on the primary config (not ``pkg@group``)."""
    return override.type == OverrideType.CHANGE and override.package is None


def _strategy_options(config_name: str, choice: str | None) -> tuple[str, set[str]] | None:
    """The name of the strategy ``choice`` (None: the default) in ``config_name``, and every option
    it has (dotted, nested ones included)."""
    overrides = [] if choice is None else [f"{STRATEGY_GROUP}={choice}"]
    owned = not GlobalHydra.instance().is_initialized()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=HYDRA_VERSION_BASE):
            cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, ValueError):
        return None
    finally:
        if owned:
            GlobalHydra.instance().clear()
    name = cfg.hydra.runtime.choices.get(STRATEGY_GROUP) or "its strategy"
    return name, set(_dotted_keys(OmegaConf.to_container(cfg[STRATEGY_GROUP], resolve=False)))


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        keys.append(prefix + key)
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{key}.")
    return keys


def _did_you_mean(option: str, options: set[str], strategy: str) -> str:
    declared = {d.path: d for d in declared_options(TRAINER)}
    if option in declared:  # lit_dp's, absent from this strategy: strategy=ddp, where DDP has nothing like it
        return (
            f"strategy.{option} is not an option of strategy={strategy}: torch DDP has no counterpart ({option}: "
            f"{declared[option].field.metadata['help']}), and would run without it. Expected it left out with "
            f"strategy={strategy}, or strategy=paddle_dp (docs/configs.md, the ddp peer)."
        )
    candidates = sorted(o for o in options if not o.startswith("_"))
    close = difflib.get_close_matches(option, candidates, n=3, cutoff=0.6)
    hint = (
        "did you mean " + " or ".join(f"strategy.{c}" for c in close) + "?"
        if close
        else "its options: " + ", ".join(candidates) + "."
    )
    return f"strategy.{option} is not an option of strategy={strategy}: {hint} (docs/options.md lists them all)"
