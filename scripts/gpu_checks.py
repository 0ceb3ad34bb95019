"""Everything GPU-only, in one call, on a machine with one CUDA GPU: ``bash scripts/gpu_checks.sh``.

Within a time budget (8 minutes on one H100, start included) it runs:

1. every documented command that needs a GPU, shortened for one GPU by the rule the test suite uses
   to run them on CPU (``tests/helpers/documented.py``: ``gpu_commands``, ``on_device``), from a
   fresh working directory, all at once (tiny models: their throughput is not a measurement);
2. ``pytest -m cuda``, alongside them;
3. then, alone on the device, the GPU benchmarks, shortened: ``benchmarks/gpt_gpu.py`` (its eager
   rows and the 2 Gloo ranks sharing the GPU; no compiled rows, which take minutes) and
   ``benchmarks/gpt_recipe.py experiment=gpt2_small``, every variant of its A/B, clipping on (the
   recipe's default) where the variant does not turn it off.

It ends with one table: each check, its exit status, tokens/s and the ratio of its throughput to
its peer's (torch DDP for the reducer, nanoGPT's bare loop for the recipe). Each check's output is
in ``<out>/<check>.log``.

    python scripts/gpu_checks.py --dry-run        # the checks, as they would run
    python scripts/gpu_checks.py --device cpu     # the same checks on CPU, shrunk: that they run at all
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers, when run as a script

from tests.helpers.documented import (  # noqa: E402 - after the path
    fresh_working_directory,
    gpu_commands,
    on_device,
    provide_shards,
)

BUDGET_S = 460.0  # 8 minutes less the wrapper's start (wheels, device query)


@dataclass(frozen=True)
class Figure:
    """One line of the final table: what a check measured."""

    label: str
    tokens_per_sec: float | None = None
    ratio: float | None = None  # this run's throughput over its peer's
    peer: str = ""


@dataclass(frozen=True)
class Check:
    """A command the script runs, and how its figures are read from its output."""

    name: str
    argv: list[str]
    cwd: Path
    timeout: float
    figures: Callable[[str], list[Figure]]
    alone: bool = False  # a benchmark: nothing else runs on the device meanwhile


@dataclass
class Result:
    check: Check
    status: str  # the exit status, "timeout", or "not run" (the budget was spent)
    seconds: float = 0.0
    figures: list[Figure] = field(default_factory=list)


# --- reading the figures ------------------------------------------------------------------------


def recipe_figures(output: str) -> list[Figure]:
    """A recipe's ``[lit_dp] final ... tokens_per_sec=...`` line."""
    found = re.search(r"^\[lit_dp\] final .*\btokens_per_sec=([\d.]+)", output, re.MULTILINE)
    return [Figure("", float(found.group(1)))] if found else []


def pytest_figures(output: str) -> list[Figure]:
    """pytest's summary line (``11 passed, 6 skipped in 80.1s``), as the label."""
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?) in [\d.]+s", output, re.MULTILINE)
    return [Figure(found[-1])] if found else []


def gpt_gpu_figures(output: str) -> list[Figure]:
    """benchmarks/gpt_gpu.py's rows: lit_dp's tokens/s and DDP's step time over lit_dp's (throughput ratio)."""
    figures, part = [], ""
    for line in output.splitlines():
        if line.startswith("Part "):
            part = "2 Gloo ranks sharing the device, per rank" if line.startswith("Part 2") else "one-rank group"
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        shape = re.fullmatch(r"(\d+) x (\d+)", cells[1]) if line.startswith("| ") and len(cells) >= 6 else None
        if shape:
            batch, length = (int(value) for value in shape.groups())
            ddp_ms, ours_ms = float(cells[3]), float(cells[4])
            label = f"{cells[0]} {cells[1]}, {part}"
            figures.append(Figure(label, batch * length * 1000 / ours_ms, ddp_ms / ours_ms, "torch DDP"))
    return figures


def gpt_recipe_figures(output: str) -> list[Figure]:
    """benchmarks/gpt_recipe.py's rows after the bare loop's: each variant's tokens/s and its ratio to the bare loop."""
    figures = []
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 4 and cells[0] not in ("variant", "bare") and not cells[0].startswith("-"):
            figures.append(Figure(cells[0], float(cells[3].replace(",", "")), float(cells[4]), "nanoGPT's bare loop"))
    return figures


# --- the checks ---------------------------------------------------------------------------------

# The benchmarks, shortened to fit the budget; on CPU, tiny (their own tests' sizes).
TINY_GPT = "n_layer=1 n_head=2 n_embd=32 block_size=32 vocab_size=64".split()
GPT_GPU = {
    "cuda": ["compile_shapes=[]", "rounds=4", "shared_rounds=3"],
    "cpu": [
        "device=cpu",
        *TINY_GPT,
        *(f"shared_{setting}" for setting in TINY_GPT[:3]),
        "shapes=[[4,32]]",
        "shared_shape=[4,32]",
        "compile_shapes=[]",
        "warmup=1",
        "steps=2",
        "rounds=2",
        "shared_rounds=2",
    ],
}
# GPT-2 small with the recipe's defaults (bf16-mixed, compiled, fused AdamW, clipping at 1.0), every
# variant of the A/B (the bare loop, the recipe, without clipping, unwatched, on many ranks' path with
# and without graph breaks), fewer steps: 70 timed after the warm-up's 10, of which 10 are profiled
# (compilation takes most of the time, about 3 minutes on an H100 in all; on CPU, 30 steps).
GPT_RECIPE = {
    "cuda": ["experiment=gpt2_small", "trainer.max_steps=80", "trainer.val_check_interval=40", "trainer.limit_val_batches=2"],
    "cpu": [
        "experiment=gpt2_small",
        "trainer.max_steps=40", "trainer.val_check_interval=20", "trainer.limit_val_batches=2",
        "trainer.accelerator=cpu",
        "compile_backend=aot_eager",
        *"model.n_layer=1 model.n_embd=32 model.n_head=2 data.block_size=16 data.batch_size=4".split(),
        "data.num_workers=0",
        "callbacks.throughput.warmup=2",
    ],
}
PARTS = ("docs", "tests", "bench")


def plan(device: str, work: Path, parts: tuple[str, ...] = PARTS) -> list[Check]:
    """The checks for ``device`` ("cuda", or "cpu" to try them here), working under ``work``."""
    python = sys.executable
    checks = []
    if "docs" in parts:
        clone = fresh_working_directory(work / "clone")
        for command in gpu_commands():
            argv = on_device(command, device, one_rank=True)
            provide_shards(argv, clone)
            start = [python, "-m", "torch.distributed.run"] if argv[0] == "torchrun" else [python]
            checks.append(Check(command.source, start + argv[1:], clone, 240, recipe_figures))
    if "tests" in parts:
        pytest = [python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-o", "addopts="]
        checks.append(Check("pytest -m cuda", pytest, ROOT, 300, pytest_figures))
    if "bench" in parts:
        for name, settings, timeout, figures in (
            ("gpt_gpu", GPT_GPU[device], 180, gpt_gpu_figures),
            ("gpt_recipe", GPT_RECIPE[device], 300, gpt_recipe_figures),
        ):
            argv = [python, "-m", f"benchmarks.{name}", *settings, f"hydra.run.dir={work / 'benchmarks'}"]
            label = f"benchmarks.{name}" + (" experiment=gpt2_small" if "experiment=gpt2_small" in settings else "")
            checks.append(Check(label, argv, ROOT, timeout, figures, alone=True))
    return checks


# --- running them -------------------------------------------------------------------------------


def run_check(check: Check, deadline: float, out: Path) -> Result:
    """Run ``check`` until it ends, its timeout, or ``deadline`` (``time.monotonic()``); its output in ``out``."""
    timeout = min(check.timeout, deadline - time.monotonic())
    if timeout <= 0:
        return Result(check, "not run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    try:
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        done = subprocess.run(check.argv, cwd=check.cwd, env=env, timeout=timeout, **pipes)
        output, status = done.stdout, str(done.returncode)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode(errors="replace")
        status = "timeout"
    (out / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', check.name)}.log").write_text(f"$ {' '.join(check.argv)}\n{output}")
    return Result(check, status, time.monotonic() - started, check.figures(output))


def run_all(checks: list[Check], budget: float, out: Path) -> list[Result]:
    """The checks that share the device at once, then each benchmark alone, all within ``budget`` seconds."""
    deadline = time.monotonic() + budget
    together = [check for check in checks if not check.alone]
    with ThreadPoolExecutor(max_workers=max(1, len(together))) as pool:
        results = list(pool.map(lambda check: run_check(check, deadline, out), together))
    return results + [run_check(check, deadline, out) for check in checks if check.alone]


def table(results: list[Result]) -> str:
    """One line per figure (or per check without any): check, exit status, seconds, tokens/s, ratio, peer."""
    lines = ["| check | exit | seconds | tokens/s | / peer | peer, or what ran |", "|---|---|---|---|---|---|"]
    for result in results:
        for figure in result.figures or [Figure("")]:
            name = f"{result.check.name}: {figure.label}" if figure.label and figure.peer else result.check.name
            rate = f"{figure.tokens_per_sec:,.0f}" if figure.tokens_per_sec is not None else "n/a"
            ratio = f"{figure.ratio:.3f}" if figure.ratio is not None else "n/a"
            note = figure.peer or figure.label
            lines.append(f"| {name} | {result.status} | {result.seconds:.0f} | {rate} | {ratio} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to run")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all checks (default %(default)s)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-logs")), help="the logs' folder")
    parser.add_argument("--dry-run", action="store_true", help="print the checks and run none")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget={args.budget:g} is invalid: expected a positive number of seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_checks_") as work:
        checks = plan(args.device, Path(work), tuple(args.only))
        if args.dry_run:
            print("\n".join(f"{check.name}: {' '.join(check.argv)}" for check in checks))
            return 0
        results = run_all(checks, args.budget, args.out)
    print(table(results), flush=True)
    return 0 if all(result.status == "0" for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
