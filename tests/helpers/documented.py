"""The commands the README and docs/ show, read from their Markdown, and how the tests run them.

A command is a line of a fenced code block (not a ``python`` block) that starts with one of
``PROGRAMS`` (after ``$ `` and ``VAR=value`` assignments), with its
``\\`` continuations joined and its ``#`` comment dropped; ``a && b`` is two commands. In a
``$ ``-transcript the lines after a command are what it prints: an error line (``ValueError:
...``, or a recipe's ``error: ...``) means the command must fail with it. Reading the
commands from the docs, rather than from a list in a test, keeps the test right whatever the
docs say: a renamed option fails here.

Every command is run, from a fresh working directory per document (the repository's
``recipes/``, ``conf/`` and ``benchmarks/`` linked in, an empty ``docs/``, a folder of text as
``my_texts/``), in the document's order: a later command may use what an earlier one wrote (the
shards ``prepare_shards`` made, the ``<run>`` folder a resume names). It runs as typed, with
``SHRINK``'s overrides appended (a few steps, tiny models and data). To keep the cost bounded
the Python commands of a document run one after the other in one process (``run_all``: each
through ``runpy``, as ``python`` runs a script or a module), so that its imports are paid once;
the first command of a document runs as typed, on the ranks it asks for (Lightning starts them
as real processes), and the others with ``trainer.devices=1`` appended unless they set it.
A command whose config asks for a GPU (``trainer=gpu``, an experiment that selects it,
``trainer.accelerator=gpu``) runs too, translated by one rule (``on_device``): on CPU in the
suite, on CUDA in ``scripts/gpu_checks.py``; so a GPU command added to the docs is run without a
GPU. The exceptions: ``python -m benchmarks.*`` is composed against its benchmark's config, not
run (a benchmark takes minutes; most have a shrunk end-to-end test of their own in
tests/benchmarks), and ``NOT_RUN`` lists the commands that cannot run here, each with its reason;
those of them that start a recipe or a benchmark are still composed, with the recipe's checks
made before any process starts, so that a key the docs misspell fails. Lines that start with
another program are not commands: the shell's own (``export``, ``for``, ``wait``) and what a
transcript prints.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch.distributed as dist
import yaml

from lit_dp_recipes.shards import write_llmc_shard

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("python", "torchrun", "srun", "pip", "torchft_lighthouse")

# Commands that cannot run on this machine or in this suite, each with its reason. A pattern
# that matches no documented command fails a test, so the list cannot outlive the docs.
NOT_RUN: list[tuple[str, str]] = [
    (r"\bpip install", "installs packages: the suite runs in the environment they were installed in"),
    (r"^torchft_lighthouse\b", "torchft's lighthouse, a server that runs until stopped: tests/helpers/torchft.py "
     "starts one for the fault-tolerance tests, and the documented flags are checked against its --help"),
    (r"-m pytest", "the test suite itself"),
    (r"^srun\b|--nnodes=2", "needs SLURM or several machines"),
    (r"(^|\s)\.\.\.$", "an abbreviation: the command is elided ('...')"),
    (r"recipes/gpt\.py compile=true$", "inductor compiles C++ for minutes on a CPU; the next command "
     "(compile=true compile_backend=aot_eager) runs the same path"),
    (r"PADDLE_TRAINER_ID=", "two shells by hand on fixed ports 6170-6171; PaddleEnvironment's launch is "
     "tested in tests/job and tests/strategies"),
    (r"strategy\.fault_tolerance=torchft", "replica groups around a torchft lighthouse, each killed in turn: "
     "tests/test_fault_tolerance_launch.py and tests/test_fault_tolerance_groups_launch.py (groups of two ranks, "
     "per-step and DiLoCo) run the launches of docs/fault_tolerance.md as written"),
]

# Appended to a recipe's command to make it small, unless the command sets the key itself.
SHRINK = {
    "digits": ["trainer.max_epochs=1", "trainer.limit_train_batches=8", "trainer.limit_val_batches=1"],
    "gpt": [
        "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "data.max_bytes=30000",
        "data.block_size=32", "data.batch_size=4", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
        "model.warmup_steps=1", "callbacks.throughput.warmup=1",
    ],
    "prepare_shards": [],
}
SHRINK["charlm"] = SHRINK["gpt"]
TRAINED = ("digits", "gpt", "charlm")  # the recipes with a trainer.devices
ONE_RANK = "trainer.devices=1"
RUN_PLACEHOLDER = "<run>"  # the newest run folder of the task, as a user would copy it


@dataclass(frozen=True)
class DocumentedCommand:
    """One command as a document shows it."""

    source: str  # "docs/gpt.md:12"
    argv: tuple[str, ...]  # without the leading VAR=value assignments
    env: tuple[tuple[str, str], ...] = ()
    expected: tuple[str, ...] = field(default=(), compare=False)  # what a $-transcript shows it printing

    @property
    def text(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env), *self.argv])

    @property
    def document(self) -> str:
        return self.source.rsplit(":", 1)[0]

    @property
    def script(self) -> str | None:
        """The recipe it runs (``digits`` for ``recipes/digits.py`` or ``-m lit_dp_recipes.run.digits``, the
        installed package's form), directly or under torchrun."""
        match = next((a for a in self.argv if re.fullmatch(r"recipes/\w+\.py", a)), None)
        if match:
            return Path(match).stem
        module = re.fullmatch(r"lit_dp_recipes\.run\.(\w+)", self.module or "")
        return module.group(1) if module else None

    @property
    def module(self) -> str | None:
        """The module of ``python -m MODULE``."""
        if self.argv[:2] == ("python", "-m") and len(self.argv) > 2:
            return self.argv[2]
        return None

    @property
    def expects_failure(self) -> bool:
        """The transcript shows an error: ``SomeError: ...``, or a recipe's refusal of its command line (``error: ...``)."""
        return any(re.match(r"(\w+Error|Traceback)\b|error: ", line) for line in self.expected)

    @property
    def needs_gpu(self) -> bool:
        """A recipe whose config asks for a GPU accelerator (``trainer=gpu``, ``experiment=gpt2_small``, ...)."""
        return self.script in TRAINED and str(trainer_settings(self).get("accelerator")) in ("gpu", "cuda")

    def not_run_reason(self) -> str | None:
        listed = next((reason for pattern, reason in NOT_RUN if re.search(pattern, self.text)), None)
        if listed or self.script not in TRAINED:
            return listed
        if int(trainer_settings(self).get("num_nodes", 1)) > 1:
            return "needs several machines (trainer.num_nodes > 1)"
        return None


def documented_commands(documents: list[Path] = DOCUMENTS) -> list[DocumentedCommand]:
    """Every command of ``documents``' code blocks, in order."""
    return [command for document in documents for command in _commands_of(document)]


def gpu_commands(documents: list[Path] = DOCUMENTS) -> list[DocumentedCommand]:
    """The documented commands that need a GPU and can run on one machine, each once, in the docs' order."""
    unique = {command.text: command for command in reversed(documented_commands(documents))}
    return [command for command in reversed(unique.values()) if command.needs_gpu and not command.not_run_reason()]


def _commands_of(document: Path) -> list[DocumentedCommand]:
    name = str(document.relative_to(ROOT))
    commands: list[DocumentedCommand] = []
    lines = document.read_text().splitlines()
    in_block, language, transcript, index = False, "", None, 0
    while index < len(lines):
        line, number = lines[index], index + 1
        index += 1
        fence = re.match(r"\s*```(\w*)", line)
        if fence:
            in_block, language = not in_block, fence.group(1)
            transcript = None
            continue
        if not in_block or language == "python":
            continue
        while line.rstrip().endswith("\\") and index < len(lines):
            line = line.rstrip()[:-1] + " " + lines[index].strip()
            index += 1
        stripped = line.strip()
        prompt = stripped.startswith("$ ")
        if prompt:
            stripped = stripped[2:]
        found = _parse(stripped, f"{name}:{number}")
        if found:
            commands += found
            transcript = len(commands) - 1 if prompt else None
        elif transcript is not None and stripped:
            last = commands[transcript]
            commands[transcript] = DocumentedCommand(last.source, last.argv, last.env, (*last.expected, stripped))
    return commands


def _parse(line: str, source: str) -> list[DocumentedCommand]:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    commands, current = [], []
    for token in [*tokens, "&&"]:
        if token in ("&&", "&"):
            env = []
            while current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", current[0]):
                env.append(tuple(current.pop(0).split("=", 1)))
            if current and current[0] in PROGRAMS:
                commands.append(DocumentedCommand(source, tuple(current), tuple(env)))
            current = []
        else:
            current.append(token)
    return commands


def shrunk(command: DocumentedCommand, one_rank: bool = False) -> list[str]:
    """``command``'s argv as a test runs it: ``SHRINK``'s overrides for its recipe (and ``trainer.devices=1``
    if ``one_rank``) appended where the command does not set the key; a GPU command ``on_device("cpu")``."""
    if command.needs_gpu:
        return on_device(command, "cpu", one_rank)
    given = {argument.split("=", 1)[0].lstrip("+~") for argument in command.argv if "=" in argument}
    extra = SHRINK.get(command.script or "", []) + ([ONE_RANK] if one_rank and command.script in TRAINED else [])
    return list(command.argv) + [o for o in extra if o.split("=", 1)[0] not in given]


# --- Commands that need a GPU, run where CI runs -------------------------------------------------

CONF = ROOT / "conf"
SIZES = ("trainer.max_steps", "trainer.max_epochs", "trainer.val_check_interval", "trainer.limit_val_batches")
ACCELERATOR = {"cpu": "cpu", "cuda": "gpu"}


def on_device(command: DocumentedCommand, device: str, one_rank: bool = False) -> list[str]:
    """``command`` (one that ``needs_gpu``) shortened for ``device`` ("cpu" or "cuda"): the rule, each change
    with its reason. What the command sets otherwise stays: precision, optimizer, compilation, sharding,
    communication hooks, LocalSGD, clipping.

    - size: ``SHRINK``'s tiny model and few steps replace the command's own sizes and lengths;
    - devices: every local GPU (``devices=auto``, ``--nproc-per-node=N``) becomes 2 CPU processes (1
      with ``one_rank``: after a document's first command, as for every command), or the one GPU a
      lent machine has;
    - accelerator: ``trainer.accelerator=cpu`` on CPU, the rest of the GPU trainer's settings kept;
    - compilation: on CPU ``compile_backend=aot_eager`` unless the command names a backend, since
      inductor compiles C++ for over a minute per graph on 2 cores; aot_eager takes the same path
      through dynamo (graph capture, the reducer's bucket-split graphs, AOT autograd). On CUDA the
      command's own backend (inductor);
    - elided values (``key=...``) are left out: the config's default applies.

    Token shards the command names but the machine lacks are ``provide_shards``' to write.
    """
    ranks = 1 if one_rank or device == "cuda" else 2
    shrink = SHRINK[command.script or ""]
    replaced = {o.split("=", 1)[0] for o in shrink} | {"trainer.devices", "trainer.accelerator"}
    argv = []
    for argument in command.argv:
        key = argument.split("=", 1)[0]
        if argument.endswith("=...") or key in replaced or key in SIZES:
            continue
        argv.append(re.sub(r"^--nproc[-_]per[-_]node=\d+$", f"--nproc-per-node={ranks}", argument))
    extra = [*shrink, f"trainer.devices={ranks}", f"trainer.accelerator={ACCELERATOR[device]}"]
    if device == "cpu" and not any(a.startswith("compile_backend=") for a in command.argv):
        extra.append("compile_backend=aot_eager")
    return argv + extra


def provide_shards(argv: list[str], working_dir: Path, tokens: int = 40_000) -> list[Path]:
    """Write a small random-token shard (llm.c's format; ids below 256, which every vocabulary of the
    recipes holds) for each shard glob in ``argv`` that matches no file under ``working_dir``: the data
    a GPU command says the user already has."""
    written = []
    for argument in argv:
        key, _, pattern = argument.partition("=")
        if key in ("data.train_shards", "data.val_shards") and not list(working_dir.glob(pattern)):
            path = working_dir / pattern.replace("**/", "").replace("*", "000000")
            path.parent.mkdir(parents=True, exist_ok=True)
            write_llmc_shard(path, np.random.default_rng(len(written)).integers(256, size=tokens, dtype=np.uint16))
            written.append(path)
    return written


def trainer_settings(command: DocumentedCommand) -> dict:
    """The ``trainer`` node ``command``'s recipe config ends with, read from conf/ without composing (Hydra
    takes seconds for the docs' commands): the trainer its config, experiment or ``trainer=`` chooses, then
    its ``trainer.*`` overrides."""
    values = dict(a.lstrip("+").split("=", 1) for a in command.argv if "=" in a and not a.startswith("-"))
    choice = (
        values.get("trainer")
        or _choice(CONF / "experiment" / f"{values.get('experiment')}.yaml", "trainer")
        or _choice(CONF / f"{command.script}.yaml", "trainer")
    )
    settings = _trainer_yaml(choice) if choice else {}
    settings.update({key.split(".", 1)[1]: value for key, value in values.items() if key.startswith("trainer.")})
    return settings


def _choice(config: Path, group: str) -> str | None:
    """The option of ``group`` a config's defaults list chooses (``trainer: cpu``, ``override /trainer: gpu``),
    following the configs of its folder that it extends; the last choice wins, as in Hydra."""
    if not config.is_file():
        return None
    choice = None
    for entry in (yaml.safe_load(config.read_text()) or {}).get("defaults", []):
        if isinstance(entry, str):
            choice = _choice(config.parent / f"{entry}.yaml", group) or choice
        elif isinstance(entry, dict):
            choice = next((v for k, v in entry.items() if k.removeprefix("override ").strip("/") == group), choice)
    return choice


def _trainer_yaml(name: str) -> dict:
    """conf/trainer/<name>.yaml's keys, over those of the trainer configs it extends."""
    data = yaml.safe_load((CONF / "trainer" / f"{name}.yaml").read_text()) or {}
    settings: dict = {}
    for entry in data.get("defaults", []):
        if isinstance(entry, str) and (CONF / "trainer" / f"{entry}.yaml").is_file():
            settings.update(_trainer_yaml(entry))
    settings.update({key: value for key, value in data.items() if key != "defaults"})
    return settings


def fresh_working_directory(root: Path) -> Path:
    """What a user has after cloning, for commands to read (linked), and nothing they would write."""
    root.mkdir()
    for name in ("recipes", "conf", "benchmarks"):
        (root / name).symlink_to(ROOT / name)
    (root / "docs").mkdir()  # commands may draw pictures into docs/
    texts = root / "my_texts"
    texts.mkdir()
    for index, path in enumerate(sorted((ROOT / "lit_dp_recipes").glob("*.py"))[:4]):
        (texts / f"text{index}.txt").write_bytes(path.read_bytes())  # a few KB of text each
    return root


MARK = "=== documented command"


def run_all(commands: list[dict]) -> None:
    """Run ``commands`` (``{"argv": [...], "env": {...}}``, argv starting with ``python``) one after the
    other in this process, from the current folder; prints ``MARK`` lines around each with its exit status."""
    for number, command in enumerate(commands):
        argv = [_fill(argument, Path.cwd()) for argument in command["argv"][1:]]
        print(f"{MARK} {number} start: {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        saved_argv, saved_env = sys.argv, dict(os.environ)
        os.environ.update(command["env"])
        status = 0
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr, flush=True)
        except BaseException:  # noqa: BLE001 - reported as the command's failure, like python would
            traceback.print_exc()
            status = 1
        finally:
            sys.argv = saved_argv
            os.environ.clear()
            os.environ.update(saved_env)
            from hydra.core.global_hydra import GlobalHydra

            GlobalHydra.instance().clear()
            # As in a fresh process: the strategies leave the process group alive after a fit (as "ddp" does).
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"{MARK} {number} exit {status} after {time.perf_counter() - started:.1f} s", flush=True)


def split_output(output: str, count: int) -> list[tuple[int | None, str]]:
    """``run_all``'s output cut per command: (exit status, or None if it never ended; what it printed)."""
    results: list[tuple[int | None, str]] = []
    for number in range(count):
        start = output.find(f"{MARK} {number} start:")
        end = re.search(rf"^{re.escape(MARK)} {number} exit (-?\d+) after", output, re.MULTILINE)
        text = output[start : end.start() if end else len(output)] if start >= 0 else ""
        results.append((int(end.group(1)) if end else None, text))
    return results


def _fill(argument: str, working_dir: Path) -> str:
    if RUN_PLACEHOLDER not in argument:
        return argument
    task = argument.split("outputs/", 1)[1].split("/", 1)[0]
    runs = sorted((working_dir / "outputs" / task).iterdir(), key=lambda p: p.stat().st_mtime)
    assert runs, f"{argument}: no run of {task} in {working_dir / 'outputs'} to fill {RUN_PLACEHOLDER} with"
    return argument.replace(RUN_PLACEHOLDER, runs[-1].name)


def expected_pattern(line: str) -> str:
    """A transcript line as a pattern: its numbers and ``...`` stand for whatever the run prints there."""
    pattern = re.escape(line)
    pattern = pattern.replace(re.escape("..."), ".*")
    return re.sub(r"\d+", r"\\d+", pattern)


if __name__ == "__main__":
    run_all(json.loads(Path(sys.argv[1]).read_text()))
