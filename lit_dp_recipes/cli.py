"""How a recipe starts: ``python -m lit_dp_recipes.run.<name> overrides...`` (``python recipes/<name>.py`` in a clone).

``recipe_main(task, config_name)`` is the ``main()`` of every recipe (``lit_dp_recipes.run``): Hydra's
``@hydra.main`` over ``conf/<config_name>.yaml`` (packaged as ``lit_dp_recipes/conf``), with what every recipe needs registered
first (the strategy and trainer schemas, the ``lit_dp.job_folder`` resolver of
``conf/hydra/default.yaml``), and one check of the command line before Hydra runs anything.

The check (``command_line_mistakes``) follows docs/conventions.md: every mistake a user can type
is answered with one line per mistake, ``error: `` and what was typed, what is expected, and
the near names where there are some, with no traceback and before any rank starts. It composes
each job's config as Hydra will (each value of a sweep), and answers:

- a choice a group lacks (``strategy=dpp``, ``experiment=smal_buckets``), with the group's choices;
- a key the config lacks (``trainer.max_epoch=5``, ``model.lrr=1``, ``strategy.comm_bufer_size=5``),
  with the keys spelt alike; Hydra would advise ``+trainer.max_epoch=5``, which Lightning's
  Trainer then refuses with a ``TypeError`` that names neither key;
- a value of the wrong type (``trainer.max_steps=abc``) and a value the strategy, the trainer
  section or the run's own options refuse (``strategy.comm_buffer_size=-1``, ``trainer.devices=0``).

It imports neither Lightning nor the task, so that a refusal costs the imports of torch, Hydra
and lit_dp's options only (``import lit_dp`` loads its other names, and torch's compiler with
``DataParallel``, on first use). What only building the data or the model can check
(``data.batch_size=0``) is refused by the task before any rank starts: ``train`` raises ``CommandLineMistake``, which
``recipe_main`` prints the same way.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_dp.options import TRAINER, declared_options
from lit_dp_recipes.config import (
    DDP_TARGET,
    PADDLE_DP_TARGET,
    check_checkpoint_every_n_steps,
    check_ckpt_path,
    check_compile,
    check_monitor_mode,
    check_seed,
    register_configs,
    strategy_arguments,
    validate_trainer,
)
from lit_dp_recipes.spelling import did_you_mean

# The configs, shipped in the package; in the repository this folder is a link to conf/.
CONF_DIR = Path(__file__).resolve().parent / "conf"
HYDRA_VERSION_BASE = "1.3"
STRATEGY_GROUP = "strategy"
EXPERIMENT_GROUP = "experiment"
MULTIRUN_FLAGS = ("-m", "--multirun")
# Hydra's own command-line flags (its argparse parser, hydra._internal.utils.get_args_parser): everything
# else that starts with a dash is an argparse habit (`--devices=2`), answered with the override to type.
HYDRA_FLAGS = (
    "--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p", "--run", "-r",
    "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn",
    "--config-dir", "-cd", "--experimental-rerun", "--info", "-i",
)
ERROR = "error: "
HYDRA_GRAMMAR = "https://hydra.cc/docs/1.3/advanced/override_grammar/basic"


class CommandLineMistake(ValueError):
    """A value of the command line (or of a config it selects) that the recipe refuses before any rank starts."""


def recipe_main(task: str, config_name: str) -> Callable[[], None]:
    """The ``main()`` of a recipe script: checks the command line, then runs ``task`` (``"module:function"``,
    imported only then) under ``@hydra.main``; a ``CommandLineMistake`` it raises is printed as one line."""
    register_configs()

    def run(cfg: DictConfig) -> Any:
        module, _, function = task.partition(":")
        try:
            return getattr(importlib.import_module(module), function)(cfg)
        except CommandLineMistake as mistake:
            sys.exit(ERROR + str(mistake))

    hydra_main = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base=HYDRA_VERSION_BASE)(run)

    def main() -> None:
        mistakes = command_line_mistakes(config_name, sys.argv[1:])
        if mistakes:
            sys.exit("\n".join(ERROR + mistake for mistake in mistakes))
        hydra_main()

    return main


def command_line_mistakes(config_name: str, arguments: Sequence[str]) -> list[str]:
    """One message per mistake in the overrides ``arguments`` of ``config_name``; none when all is well.

    A flag that is not Hydra's (``--devices=2``, typed from argparse habit) is answered with the
    override to type instead (``argparse_habits``). Hydra's own flags other than ``-m``
    (``--cfg``, ``--help``, ``-cn``, ...) and a ``hydra.searchpath`` (config folders of the
    user's) leave the checking to Hydra. Keys added with ``+`` or removed with ``~`` are the
    user's business and not looked up.
    """
    habits = argparse_habits(config_name, arguments)
    if habits:
        return habits
    if any(argument.startswith("-") and argument not in MULTIRUN_FLAGS for argument in arguments):
        return []
    if any(argument.lstrip("+").startswith("hydra.searchpath") for argument in arguments):
        return []  # config folders of the user's (docs/configs.md): their groups and choices are Hydra's to find
    overrides = [argument for argument in arguments if argument not in MULTIRUN_FLAGS]
    unreadable = [m for m in map(_unreadable, overrides) if m]
    if unreadable:
        return unreadable
    parsed = OverridesParser.create().parse_overrides(overrides)
    mistakes: list[str] = []
    for job in _jobs(parsed):
        for mistake in _job_mistakes(config_name, job):
            if mistake not in mistakes:
                mistakes.append(mistake)
    return mistakes


def argparse_habits(config_name: str, arguments: Sequence[str]) -> list[str]:
    """One line per flag of ``arguments`` that Hydra does not take (``--devices=2``, ``--max-epochs 3``,
    ``--fast_dev_run``), naming the override that sets it (``trainer.devices=2``): Hydra would answer
    with its usage screen and "unrecognized arguments". Hydra's flags, and the abbreviations of its
    long ones that argparse accepts (``--conf``), are left to it."""
    flagged = [(i, a) for i, a in enumerate(arguments) if a.startswith("-") and a != "-" and not _hydra_flag(a.split("=", 1)[0])]
    if not flagged:
        return []
    values = _config_values(config_name)
    habits = []
    for index, argument in flagged:
        flag, given, value = argument.partition("=")
        following = arguments[index + 1] if index + 1 < len(arguments) else None
        if not given and following is not None and not following.startswith("-") and "=" not in following:
            argument, value, given = f"{argument} {following}", following, "="  # `--devices 2`
        habits.append(f"{argument}: the recipes take Hydra overrides, key=value without dashes: "
                      f"{_hydra_spelling(flag, value if given else None, values)}")
    return habits


def _hydra_flag(flag: str) -> bool:
    if flag in HYDRA_FLAGS:
        return True
    # argparse takes an unambiguous start of a long flag (allow_abbrev), and refuses an ambiguous one itself.
    return flag.startswith("--") and len(flag) > 2 and any(f.startswith(flag) for f in HYDRA_FLAGS if f.startswith("--"))


def _hydra_spelling(flag: str, value: str | None, values: dict[str, Any]) -> str:
    """The override ``flag`` meant: ``trainer.devices=2`` (``--devices=2``, ``--trainer.devices=2``); the
    keys ending so where there are several; the near ones, or how to list them, where there is none."""
    name = flag.lstrip("-").replace("-", "_")
    keys = [name] if name in values else [key for key in values if key.endswith("." + name)]

    def override(key: str) -> str:
        if value is not None:
            return f"{key}={value}"
        return f"{key}=true" if isinstance(values.get(key), bool) else f"{key}=..."

    if keys:
        return " or ".join(map(override, keys))
    last = {key.rsplit(".", 1)[-1]: key for key in reversed(values)}  # the first key of each last name
    near = did_you_mean(name, list(last), lambda c: override(last[c]))
    return (near or f"the config has no key {name}") + " (--cfg job prints the config)"


def _config_values(config_name: str) -> dict[str, Any]:
    """The config's keys, dotted, with their values (as written: interpolations unresolved); Hydra's own left out."""
    owned = not GlobalHydra.instance().is_initialized()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=HYDRA_VERSION_BASE):
            cfg = OmegaConf.to_container(compose(config_name), resolve=False)
    finally:
        if owned:
            GlobalHydra.instance().clear()
    return {key: value for key, value in _leaf_items(cfg) if not any(part.startswith("_") for part in key.split("."))}


def _leaf_items(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            items += _leaf_items(value, f"{prefix}{key}.")
        else:
            items.append((prefix + str(key), value))
    return items


def _unreadable(argument: str) -> str | None:
    """Why Hydra cannot read ``argument`` as an override (an unclosed bracket, a space unquoted); None if it can."""
    try:
        OverridesParser.create().parse_override(argument)
    except HydraException as error:
        lines = [line for line in str(error).splitlines() if line and not line.startswith(("Error when parsing", "See "))]
        why = "; ".join(lines) or _first_line(error)
        return f"{argument} is not an override Hydra can read ({why}): expected key=value ({HYDRA_GRAMMAR})."
    return None


def _jobs(parsed: list[Override]) -> list[list[Override]]:
    """The overrides of the jobs to check: the first value of every sweep, then each other value of
    each sweep with the others at their first. Every value is checked; a sweep of N by M jobs costs
    N + M - 1 compositions, not N * M."""
    values = [_values(override) for override in parsed]
    jobs = [[options[0] for options in values]]
    for index, options in enumerate(values):
        for option in options[1:]:
            jobs.append([*jobs[0][:index], option, *jobs[0][index + 1 :]])
    return jobs


def _values(override: Override) -> list[Override]:
    if not override.is_sweep_override():
        return [override]
    parser = OverridesParser.create()
    prefix = {OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++"}.get(override.type, "")
    return [
        parser.parse_override(f"{prefix}{override.get_key_element()}={value}")
        for value in override.sweep_string_iterator()
    ]


def _job_mistakes(config_name: str, job: list[Override]) -> list[str]:
    owned = not GlobalHydra.instance().is_initialized()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=HYDRA_VERSION_BASE):
            loader = GlobalHydra.instance().config_loader()
            groups = _groups(loader)
            choices = [o for o in job if _changes(o) and o.key_or_group in groups]
            mistakes = [_unknown_choice(o, loader.get_group_options(o.key_or_group)) for o in choices]
            mistakes = [m for m in mistakes if m]
            if mistakes:
                return mistakes
            try:
                base = compose(config_name, overrides=[o.input_line for o in choices], return_hydra_config=True)
            except (HydraException, OmegaConfBaseException) as error:
                return [_first_line(error)]
            experiment = [o for o in choices if o.key_or_group == EXPERIMENT_GROUP]
            if experiment:
                rest = [o.input_line for o in choices if o not in experiment]
                without = compose(config_name, overrides=rest, return_hydra_config=True)
                mistake = _foreign_experiment(experiment[0], config_name, base, without)
                if mistake:
                    return [mistake]
            keys = [o for o in job if _changes(o) and o.key_or_group not in groups]
            mistakes = [m for m in (_unknown_key(o.key_or_group, base) for o in keys) if m]
            if mistakes:
                return mistakes
            try:
                cfg = compose(config_name, overrides=[o.input_line for o in job], return_hydra_config=True)
            except ConfigCompositionException as error:
                return [_composition_mistake(error, job)]
            except (HydraException, OmegaConfBaseException) as error:
                return [_first_line(error)]
    finally:
        if owned:
            GlobalHydra.instance().clear()
    return _value_mistakes(cfg)


def _foreign_experiment(choice: Override, recipe: str, chosen: DictConfig, without: DictConfig) -> str | None:
    """An experiment written for another recipe (``experiment=gpt_tiny`` for the digits) sets keys that
    this recipe's nodes lack; the model or data would refuse them only once built, by another name.
    Keys of a group the experiment switches (``override /trainer: gpu``) are that group's own."""
    choices, before = chosen.hydra.runtime.choices, without.hydra.runtime.choices
    kept = {group for group in without if group != "hydra" and choices.get(group) == before.get(group)}
    known = set(_leaf_keys(OmegaConf.to_container(without, resolve=False)))
    added = [
        key
        for key in _leaf_keys(OmegaConf.to_container(chosen, resolve=False))
        if key not in known and key.split(".")[0] in kept
    ]
    if not added:
        return None
    shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
    return (
        f"{choice.input_line} is not an experiment of the {recipe} recipe: it sets {shown}, which its config lacks; "
        f"expected one written for it (each conf/experiment/*.yaml names its recipe in its first lines)."
    )


def _leaf_keys(node: Any) -> list[str]:
    return [key for key, _ in _leaf_items(node)]


def _groups(loader: Any, parent: str = "") -> set[str]:
    """Every config group, nested ones as ``hydra/launcher``."""
    found = set()
    for name in loader.list_groups(parent):
        path = f"{parent}/{name}" if parent else name
        found |= {path, *_groups(loader, path)}
    return found


def _changes(override: Override) -> bool:
    """A plain ``key=value`` (no ``+``, ``++`` or ``~``) on the primary config (not ``pkg@group``)."""
    return override.type == OverrideType.CHANGE and override.package is None


def _unknown_choice(override: Override, options: list[str]) -> str | None:
    value = override.value()
    group = override.key_or_group
    if value is None:  # Hydra takes no null for a group on the command line (a ValueError, with a traceback)
        return f"{group}=null is not a choice of {group}: expected ~{group} to leave the group out, or one of {', '.join(options)}."
    if value in options:
        return None
    hint = did_you_mean(value, options, lambda c: f"{group}={c}")
    return f"{group}={value} is not a choice of {group}: {hint + ' ' if hint else ''}expected one of {', '.join(options)}."


def _unknown_key(key: str, cfg: DictConfig) -> str | None:
    """``key`` is missing from ``cfg``: which node lacks it, and its keys spelt alike."""
    if key.startswith(STRATEGY_GROUP + ".") and STRATEGY_GROUP in cfg:
        option = key[len(STRATEGY_GROUP) + 1 :]
        known = _dotted_keys(OmegaConf.to_container(cfg[STRATEGY_GROUP], resolve=False))
        return None if option in known else _strategy_mistake(option, cfg)
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False) if parent else cfg
    if not isinstance(node, DictConfig):
        if node is None and parent and _unknown_key(parent, cfg) is None:
            return None  # a node left null (a callback switched off): setting a key in it is Hydra's to judge
        return _unknown_key(parent, cfg) if parent else None
    if name in node.keys():
        return None
    keys = sorted(k for k in node.keys() if not str(k).startswith("_") and (parent or k != "hydra"))
    where = _where(parent, cfg)
    dotted = f"{parent}." if parent else ""
    near = did_you_mean(name, keys, lambda c: f"{dotted}{c}")
    hint = near or (f"its keys: {', '.join(keys)}." if keys else "it has none.")
    target = node.get("_target_")
    if target is not None and not near:
        # Unlike any key, maybe an argument of the target that the config leaves out: the user's to add.
        # Not offered for a near miss (trainer.max_epoch), where `+` would only pass the typo on.
        hint += f" To pass {target} an argument the config leaves out: +{key}=..."
    return f"{key} is not a key of {where}: {hint}"


def _where(parent: str, cfg: DictConfig) -> str:
    """How a user names the node ``parent``: ``trainer=cpu``, ``callbacks.model_checkpoint``, ``the config``."""
    if not parent:
        return "the config"
    choice = cfg.hydra.runtime.choices.get(parent)
    return f"{parent}={choice}" if choice else parent


def _strategy_mistake(option: str, cfg: DictConfig) -> str:
    name = cfg.hydra.runtime.choices.get(STRATEGY_GROUP) or "its strategy"
    options = set(_dotted_keys(OmegaConf.to_container(cfg[STRATEGY_GROUP], resolve=False)))
    declared = {d.path: d for d in declared_options(TRAINER)}
    if option in declared:  # lit_dp's, absent from this strategy: strategy=ddp, where DDP has nothing like it
        return (
            f"strategy.{option} is not an option of strategy={name}: torch DDP has no counterpart ({option}: "
            f"{declared[option].field.metadata['help']}), and would run without it. Expected it left out with "
            f"strategy={name}, or strategy=paddle_dp (docs/configs.md, the ddp peer)."
        )
    candidates = sorted(o for o in options if not o.startswith("_"))
    hint = did_you_mean(option, candidates, lambda c: f"strategy.{c}") or "its options: " + ", ".join(candidates) + "."
    return f"strategy.{option} is not an option of strategy={name}: {hint} (docs/options.md lists them all)"


def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        keys.append(prefix + key)
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{key}.")
    return keys


def _composition_mistake(error: ConfigCompositionException, job: list[Override]) -> str:
    """A value Hydra could not merge (a wrong type), as ``key=value is invalid: why``."""
    cause = error.__cause__
    full_key = getattr(cause, "full_key", None)
    typed = next((o.input_line for o in job if o.key_or_group == full_key), None)
    if typed is None or cause is None:
        return _first_line(error)
    why = (getattr(cause, "msg", None) or _first_line(cause)).splitlines()[0].rstrip(".")
    if "is not a ListConfig, list or tuple" in why:  # OmegaConf's words for a scalar given for a list
        why = "expected a list in brackets, such as [1,4]"
    return f"{typed} is invalid: {why}."


def _value_mistakes(cfg: DictConfig) -> list[str]:
    """The checks ``train`` makes before anything starts, on the composed ``cfg``: the strategy's
    options, the trainer section, and the run's own keys (``checkpoint_every_n_steps``,
    ``compile``, ``seed``, ``ckpt_path``, ``monitor_mode``)."""
    cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])  # Hydra's own: set as the job runs
    if "paths" in cfg:  # Hydra's run folder is known only once the job runs; no check reads it
        OmegaConf.update(cfg, "paths.output_dir", str(Path.cwd()), force_add=True)
    checks: list[Callable[[], Any]] = []
    if "strategy" in cfg and cfg.strategy.get("_target_") in (PADDLE_DP_TARGET, DDP_TARGET):
        checks.append(lambda: strategy_arguments(cfg.strategy))
    if "trainer" in cfg:
        checks.append(lambda: validate_trainer(cfg))
    checks.append(lambda: check_checkpoint_every_n_steps(cfg.get("checkpoint_every_n_steps")))
    checks.append(lambda: check_compile(cfg.get("compile", False)))
    if "seed" in cfg:
        checks.append(lambda: check_seed(cfg.seed))
    if "ckpt_path" in cfg:
        checks.append(lambda: check_ckpt_path(cfg.ckpt_path))
    if "monitor_mode" in cfg:
        checks.append(lambda: check_monitor_mode(cfg.monitor_mode))
    mistakes = [
        f"{key} has no value: expected {key}=... on the command line."
        for key in sorted(OmegaConf.missing_keys(cfg))
    ]
    with warnings.catch_warnings():  # the run itself warns, once, where it applies
        warnings.simplefilter("ignore")
        for check in checks:
            try:
                check()
            except ValueError as error:
                mistakes.append(str(error))
    return mistakes


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
