"""Kill-and-restart trials: does a job whose rank dies mid-epoch finish after torchrun restarts it?

Each trial runs, as a user would,

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 recipes/digits.py strategy=<s> \\
        +callbacks.kill._target_=lit_dp_recipes.faults.KillRankOnce ...

where rank 1 ends abruptly after step ``--kill-step`` of the first attempt; torchrun restarts
both workers, and the recipe resumes from the run folder's newest checkpoint (``ckpt_path=auto``).
A trial is "finished" when the job exits 0 and resumed, "failed" when it exits otherwise within
``--timeout``, "hung" when it had to be killed. "exact" counts finished trials whose final
metrics equal those of one uninterrupted run of the same strategy.

    python -m benchmarks.restarts                        # 10 trials each of paddle_dp and ddp
    python -m benchmarks.restarts --trials 1 --strategies paddle_dp   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FINAL = re.compile(r"^\[lit_dp\] final (.*)$", re.MULTILINE)


@dataclass
class Outcome:
    """What one strategy's trials gave."""

    strategy: str
    reference: str | None = None  # the final metrics line of the uninterrupted run
    finished: int = 0
    exact: int = 0
    failed: int = 0
    hung: int = 0
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # the last line of each failure's log


def torchrun(strategy: str, run_dir: Path, args: argparse.Namespace, kill: bool) -> tuple[str, int | None, float]:
    """Run the recipe once under torchrun; its output, exit code (None: killed at the timeout), seconds."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--max-restarts={1 if kill else 0}",
        str(ROOT / "recipes" / "digits.py"),
        f"strategy={strategy}",
        f"trainer.max_epochs={args.max_epochs}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        f"checkpoint_every_n_steps={args.checkpoint_every}",
        f"hydra.run.dir={run_dir}",
    ]
    if kill:
        command += ["+callbacks.kill._target_=lit_dp_recipes.faults.KillRankOnce", f"+callbacks.kill.step={args.kill_step}"]
    started = time.monotonic()
    # PYTHONFAULTHANDLER: a hung worker, sent SIGABRT, prints where each of its threads is.
    environ = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen(command, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=args.timeout)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        _stop_hung(process.pid)
        output, _ = process.communicate()
        code = None
    return output, code, time.monotonic() - started


def _stop_hung(torchrun_pid: int) -> None:
    """Stack dumps from the workers, then SIGKILL to torchrun and every process under it.

    torchrun starts each worker in a session of its own, so killing torchrun's process group
    would leave them running (and holding the output pipe)."""
    workers = _descendants(torchrun_pid)
    _signal(workers, signal.SIGABRT)
    time.sleep(3)
    _signal([torchrun_pid, *workers], signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def final_line(output: str) -> str | None:
    """The model's final metrics (``val_*``, ``train_*``); timings (``comm/*``) differ from run to run."""
    found = FINAL.findall(output)
    if not found:
        return None
    return " ".join(pair for pair in found[-1].split() if pair.startswith(("val_", "train_")))


def run_trials(args: argparse.Namespace, workdir: Path) -> list[Outcome]:
    outcomes = []
    for strategy in args.strategies:
        outcome = Outcome(strategy)
        output, code, _ = torchrun(strategy, workdir / f"{strategy}-reference", args, kill=False)
        outcome.reference = final_line(output) if code == 0 else None
        for trial in range(args.trials):
            output, code, seconds = torchrun(strategy, workdir / f"{strategy}-{trial}", args, kill=True)
            resumed = "[lit_dp] resuming from" in output
            if code == 0 and resumed:
                outcome.finished += 1
                outcome.seconds.append(seconds)
                outcome.exact += final_line(output) == outcome.reference
            elif code is None:
                outcome.hung += 1
                outcome.failures.append("hung in " + _hung_in(output))
            else:
                outcome.failed += 1
                outcome.failures.append(_cause(output))
            print(f"{strategy} trial {trial + 1}/{args.trials}: exit {code}, resumed {resumed}, {seconds:.0f}s", flush=True)
        outcomes.append(outcome)
    return outcomes


def _hung_in(output: str) -> str:
    """The innermost frames of each worker's main thread, from its faulthandler dump."""
    stacks = []
    for dump in output.split("Current thread")[1:]:
        frames = re.findall(r'File "[^"]*/([^/"]+)", line \d+ in (\w+)', dump)
        stacks.append(" < ".join(f"{function} ({module})" for module, function in frames[:3]))
    return "; ".join(stacks) or "(no stack dump)"


def _cause(output: str) -> str:
    """The first exception a worker of the restarted attempt raised (``RuntimeError: Gloo connectFullMesh ...``)."""
    restarted = output.split("[lit_dp] resuming from")[-1]  # the first attempt's survivors fail too, as expected
    exceptions = re.findall(r"^\s*((?:[\w.]+\.)?\w*(?:Error|Exception): .*)$", restarted, re.MULTILINE)
    return exceptions[0].strip()[:200] if exceptions else output.strip().splitlines()[-1][:200]


def report(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    lines = [
        f"torchrun --standalone --nproc-per-node=2 --max-restarts=1, rank 1 killed after step {args.kill_step}, "
        f"trainer.max_epochs={args.max_epochs}, checkpoint_every_n_steps={args.checkpoint_every}, timeout {args.timeout}s",
        "",
        "| strategy | trials | restarted and finished | same final metrics as uninterrupted | failed | hung until killed | median s (finished) |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        median = f"{statistics.median(o.seconds):.0f}" if o.seconds else "-"
        lines.append(f"| {o.strategy} | {args.trials} | {o.finished} | {o.exact} | {o.failed} | {o.hung} | {median} |")
    for o in outcomes:
        lines.append(f"\n{o.strategy} uninterrupted: {o.reference or 'FAILED'}")
        lines += [f"  failure: {cause}" for cause in dict.fromkeys(o.failures)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--strategies", nargs="+", default=["paddle_dp", "ddp"])
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=30, help="mid-epoch 1 of the digits recipe (23 steps an epoch)")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a trial counts as hung")
    args = parser.parse_args(argv)
    for option in ("trials", "max_epochs", "kill_step", "checkpoint_every"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')}={getattr(args, option)} is invalid: expected an integer >= 1")
    with tempfile.TemporaryDirectory(prefix="lit_dp_restarts_") as workdir:
        print(report(run_trials(args, Path(workdir)), args), flush=True)


if __name__ == "__main__":
    main()
