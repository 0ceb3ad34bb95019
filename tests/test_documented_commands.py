"""Every command the README and docs/ show works as a user types it (tests/helpers/documented.py says how).

Quick tier: every command is accounted for (run, composed, or not run for a stated reason);
the recipes' and benchmarks' commands, those not run here included, compose with their
overrides and pass the checks made before any process starts, a transcript's error is the one
the command raises, and the lighthouse's flags are its own. Slow tier: the commands run,
document by document, from a fresh working directory.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from lit_dp_recipes.cli import argparse_habits, command_line_mistakes
from lit_dp_recipes.config import build_strategy, register_configs, validate_trainer
from tests.helpers.documented import (
    NOT_RUN,
    ROOT,
    SHRINK,
    SIZES,
    TRAINED,
    DocumentedCommand,
    documented_commands,
    expected_pattern,
    fresh_working_directory,
    gpu_commands,
    on_device,
    provide_shards,
    shrunk,
    split_output,
)

COMMANDS = documented_commands()
UNIQUE = list({c.text: c for c in reversed(COMMANDS)}.values())[::-1]  # the first of identical commands
BENCHMARK_CONF = ROOT / "benchmarks" / "conf"
# Modules the docs run as typed: tools run on a run's output, and LightningCLI over BoringModel (docs/strategy.md).
TOOLS = (
    "lit_dp.observability.trace", "lit_dp.forecast", "lit_dp_recipes.trace_render", "lit_dp_recipes.run.sample",
    "lit_dp_recipes.lightning_cli", "lit_dp.checkpoint.consolidate", "lightning.pytorch.utilities.consolidate_checkpoint",
)  # fmt: skip


def kind(command: DocumentedCommand) -> str:
    """``run`` (the slow tier runs it), ``composed`` (its config is composed and checked, not run),
    ``not run`` (``NOT_RUN`` says why) or ``unknown``."""
    benchmark = bool(command.module and command.module.startswith("benchmarks."))
    if command.not_run_reason():
        return "composed" if command.script in TRAINED or benchmark else "not run"
    if benchmark:
        return "composed"
    if command.script in SHRINK or command.module in TOOLS:
        return "run"
    return "unknown"


def test_every_documented_command_is_run_composed_or_not_run_for_a_stated_reason():
    assert COMMANDS, "no command found in the docs"
    unknown = [f"{c.source}: {c.text}" for c in COMMANDS if kind(c) == "unknown"]
    assert not unknown, "commands no test knows how to run (add a SHRINK entry, or a NOT_RUN reason):\n" + "\n".join(unknown)


def test_every_not_run_reason_still_matches_a_documented_command():
    stale = [pattern for pattern, _ in NOT_RUN if not any(re.search(pattern, c.text) for c in COMMANDS)]
    assert not stale, f"NOT_RUN entries that match no documented command: {stale}"


def script_arguments(command: DocumentedCommand) -> list[str]:
    """What ``command`` gives its script, but arguments naming a run the test has not made
    (ckpt_path=outputs/digits/<run>/...) and the docs' "..." for options left out."""
    start = command.argv.index(next(a for a in command.argv if a.endswith(".py") or a.startswith(("benchmarks.", "lit_dp_recipes.run.")))) + 1
    return [a for a in command.argv[start:] if "<run>" not in a and a != "..."]


def overrides_of(command: DocumentedCommand) -> list[list[str]]:
    """The overrides of each job ``command`` starts: one list, or one per element of a ``-m`` sweep."""
    arguments = [a for a in script_arguments(command) if not a.startswith("-")]  # flags are no overrides
    parsed = OverridesParser.create().parse_overrides(arguments)
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
        for o in parsed
    ]
    return [list(job) for job in itertools.product(*choices)]


@pytest.mark.parametrize("command", [c for c in UNIQUE if kind(c) in ("run", "composed") and c.script in TRAINED],
                         ids=lambda c: c.source)
def test_recipe_commands_pass_the_checks_made_before_any_process_starts(command, tmp_path, monkeypatch):
    if "strategy.fault_tolerance=" in command.text:
        pytest.importorskip("torchft")
        # What the docs' `export` lines give each replica group's launcher.
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
        monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    register_configs()
    habits = argparse_habits(command.script, script_arguments(command))  # `--devices=2`: refused before any job
    for mistakes in [habits] if habits else (command_line_mistakes(command.script, o) for o in overrides_of(command)):
        if mistakes:
            refusal = "\n".join(f"error: {mistake}" for mistake in mistakes)  # what the recipe exits with
            assert command.expects_failure, f"{command.source}: {command.text}: {refusal}"
            for line in command.expected:
                assert re.search(expected_pattern(line), refusal), (command.source, line, refusal)
        else:
            assert not command.expects_failure, f"{command.source}: {command.text} did not fail as the docs show"


GPU_COMMANDS = [c for c in UNIQUE if c.needs_gpu]
# What on_device may change in a GPU command's config (helpers/documented.py): sizes,
# device and compiler. Everything else (precision, optimizer, clipping, compilation, strategy:
# sharding, hooks, LocalSGD) must come out as the docs typed it.
TRANSLATED = (
    "trainer.devices",
    "trainer.accelerator",
    "compile_backend",
    "data.train_shards",
    "data.val_shards",
    *SIZES,
    *(override.split("=", 1)[0] for override in SHRINK["gpt"] + SHRINK["digits"]),
)


def test_the_docs_gpu_commands_run_on_cpu_unless_a_stated_reason_keeps_them_to_composing():
    assert GPU_COMMANDS, "no documented GPU command found: the rule in helpers/documented.py reads none"
    run = [c for c in GPU_COMMANDS if kind(c) == "run"]
    assert len(run) >= 5, [c.source for c in run]  # GPT-2 small, its byte twin, digits on GPUs, under torchrun
    assert run == gpu_commands(), "scripts/gpu_checks.py would run other GPU commands than this suite"
    for command in GPU_COMMANDS:
        assert kind(command) == "run" or command.not_run_reason(), command.source


def flat(node, prefix: str = "") -> dict[str, object]:
    """A config's keys, dotted, with interpolations as written (``${callbacks.throughput.warmup}``)."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=False)
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {key: value for name in node for key, value in flat(node[name], f"{prefix}{name}.").items()}


@pytest.mark.parametrize("command", [c for c in GPU_COMMANDS if kind(c) == "run"], ids=lambda c: c.source)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_gpu_command_shortened_keeps_its_settings_but_size_device_and_compiler(command, device, tmp_path):
    register_configs()
    translated = DocumentedCommand(command.source, tuple(on_device(command, device)), command.env)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        typed, shortened = (
            compose(command.script, overrides=[f"paths.output_dir={tmp_path}", *overrides_of(c)[0]])
            for c in (command, translated)
        )
    build_strategy(shortened.strategy)
    validate_trainer(shortened)
    assert shortened.trainer.accelerator == {"cpu": "cpu", "cuda": "gpu"}[device]
    assert shortened.trainer.devices == (2 if device == "cpu" else 1)
    assert shortened.compile_backend == ("aot_eager" if device == "cpu" else typed.compile_backend)
    before, after = flat(typed), flat(shortened)
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    assert all(key.startswith(TRANSLATED) for key in changed), changed


@pytest.mark.parametrize("command", [c for c in UNIQUE if kind(c) == "composed" and c.module], ids=lambda c: c.source)
def test_benchmark_commands_compose_with_their_overrides(command, tmp_path):
    name = command.module.split(".", 1)[1]
    if not (BENCHMARK_CONF / f"{name}.yaml").is_file():
        return  # not a Hydra script (benchmarks.restarts takes argparse options)
    register_configs()
    for overrides in overrides_of(command):
        with initialize_config_dir(config_dir=str(BENCHMARK_CONF), version_base="1.3"):
            compose(name, overrides=[f"hydra.run.dir={tmp_path}", *overrides])


@pytest.mark.parametrize("command", [c for c in UNIQUE if c.argv[0] == "torchft_lighthouse"], ids=lambda c: c.source)
def test_lighthouse_commands_use_flags_the_lighthouse_has(command):
    pytest.importorskip("torchft")
    usage = subprocess.run(["torchft_lighthouse", "--help"], capture_output=True, text=True, timeout=60).stdout
    flags = [a.split("=", 1)[0] for a in command.argv[1:] if a.startswith("--")]
    assert flags, f"{command.source}: {command.text}: no flag to check"
    unknown = [flag for flag in flags if not re.search(rf"{re.escape(flag)}\b", usage)]
    assert not unknown, f"{command.source}: {command.text}: torchft_lighthouse has no {unknown}:\n{usage}"


def runs_of(document: str) -> list[DocumentedCommand]:
    """The commands of ``document`` the slow test runs: each that runs, less those an earlier document ran."""
    seen, runs = set(), []
    for command in COMMANDS:
        if kind(command) != "run":
            continue
        if command.document == document and (command.expected or "<run>" in command.text or command.text not in seen):
            runs.append(command)
        seen.add(command.text)
    return runs


DOCUMENTS = sorted({c.document for c in COMMANDS if kind(c) == "run"}, key=lambda d: (d != "README.md", d))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("document", [d for d in DOCUMENTS if runs_of(d)])
def test_documented_commands_run_from_a_fresh_working_directory(document, tmp_path):
    cwd = fresh_working_directory(tmp_path / "clone")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    commands = runs_of(document)
    batches = [list(group) for _, group in itertools.groupby(commands, key=lambda c: c.argv[0] == "python")]
    failures = []
    for batch in batches:
        argvs = [shrunk(c, one_rank=c is not commands[0] and c.argv[0] == "python") for c in batch]
        for command, argv in zip(batch, argvs):
            if command.needs_gpu:  # the shards it names are the user's own (helpers/documented.py, on_device)
                provide_shards(argv, cwd)
        if batch[0].argv[0] == "python":
            plan = [{"argv": argv, "env": dict(c.env)} for c, argv in zip(batch, argvs)]
            (tmp_path / "plan.json").write_text(json.dumps(plan))
            result = subprocess.run([sys.executable, "-m", "tests.helpers.documented", str(tmp_path / "plan.json")],
                                    cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    timeout=800)
            (tmp_path / "output.txt").write_text(result.stdout)  # for whoever reads a failure
            outputs = split_output(result.stdout, len(batch))
        else:
            outputs = []
            for command, argv in zip(batch, argvs):
                run = subprocess.run(argv, cwd=cwd, env={**env, **dict(command.env)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, timeout=600)
                outputs.append((run.returncode, run.stdout))
        for command, (status, output) in zip(batch, outputs):
            failures += check(command, status, output)
    assert not failures, "\n\n".join(failures)


def check(command: DocumentedCommand, status: int | None, output: str) -> list[str]:
    """What is wrong with ``command``'s run, as messages naming its place in the docs."""
    where = f"{command.source}: {command.text}"
    if status is None:
        return [f"{where}: never finished:\n{output[-3000:]}"]
    if (status != 0) != command.expects_failure:
        return [f"{where}: exit status {status}:\n{output[-3000:]}"]
    missing = [line for line in command.expected if not re.search(expected_pattern(line), output)]
    return [f"{where}: the docs show {missing}, the run printed:\n{output[-3000:]}"] if missing else []
