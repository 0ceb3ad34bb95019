"""Live fault tolerance on torchft: one replica group killed every N steps, the job going on.

    python -m benchmarks.fault_tolerance                  # 3 replica groups on CPU, gloo, the recipe's small GPT
    python -m benchmarks.fault_tolerance steps=300 kill_every=100 "recipe=['experiment=gpt_tiny']"

Three runs of ``recipes/gpt.py`` with ``strategy.fault_tolerance=torchft``, each replica group
launched by its own ``torchrun --standalone --nproc-per-node=1 --max-restarts=...`` around one
lighthouse (the commands of docs/fault_tolerance.md): fault-free with ``seeds[0]``, fault-free
with ``seeds[1]``, and with failures with ``seeds[0]``, where every ``kill_every`` committed
steps (counted once every group is back) the worker of one replica group, in turn, gets SIGKILL
and its torchrun starts it again. Each worker logs every step (``StepLog``): wall time, pid,
torchft's committed steps, the groups present, a hash of the parameters' bytes. The report:

- **never restarted as a whole**: every torchrun exits 0, and only the killed groups' workers
  ever changed (the others kept one pid from start to end);
- **throughput while a group is down**: samples committed by the survivors from each kill to the
  group's return (the discarded step, the new quorum and the restart included), per second,
  against the fault-free run's samples per second (after ``warmup`` steps); the bar is
  ``(replicas - 1) / replicas``;
- **recovered bitwise**: at its first committed step after each restart, the killed group's
  parameter hash equals its peers';
- **validation loss**: the run with failures against the two fault-free seeds; it passes inside
  ``[min - d, max + d]`` where ``d`` is the seeds' difference.

A discarded step counts as a step (as one a gradient scaler skips), so the run with failures
commits about one step fewer per kill than ``steps``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from benchmarks.common import benchmark_main

ROOT = Path(__file__).resolve().parents[1]
FINAL = re.compile(r"^\[lit_dp\] final .*?val_loss=([-\d.]+)", re.MULTILINE)


@dataclass
class FaultToleranceBenchmarkConfig:
    """What to run (benchmarks/conf/fault_tolerance.yaml)."""

    replicas: int = 3
    min_replicas: int = 2  # the lighthouse's and strategy.ft.min_replicas: replica groups a step needs
    steps: int = 600  # trainer.max_steps of each run
    kill_every: int = 150  # committed steps between kills, counted once every group is back
    seeds: tuple[int, ...] = (7, 8)  # the run with failures uses the first
    compare: bool = True  # also the fault-free runs, one per seed (throughput and validation loss)
    recipe: tuple[str, ...] = ()  # overrides of recipes/gpt.py (none: its small CPU GPT, 2 layers x 128)
    warmup: int = 20  # steps of the fault-free run left out of its throughput
    max_restarts: int = 20  # each torchrun's --max-restarts
    lighthouse: tuple[str, ...] = ("--quorum_tick_ms", "10", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000")
    timeout: float = 1200.0  # seconds a run may take
    output_dir: str = "."


class StepLog(pl.Callback):
    """One JSON line per training step to ``path``: wall time, pid, torchft's committed steps, whether the
    step committed, the replica groups present, this replica's samples, a hash of the parameters' bytes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        ft = trainer.strategy.fault_tolerance
        digest = hashlib.sha256()
        for tensor in pl_module.state_dict().values():
            digest.update(tensor.detach().cpu().numpy().tobytes())
        line = {
            "time": time.time(), "pid": os.getpid(), "committed_steps": ft.committed_steps,
            "committed": ft.last_committed, "replicas": ft.manager.num_participants(), "samples": len(batch[0]),
            "hash": digest.hexdigest(),
        }  # fmt: skip
        with self.path.open("a") as log:
            log.write(json.dumps(line) + "\n")


@dataclass
class Run:
    """One run's replica groups: their torchrun processes, step logs and outputs."""

    name: str
    folder: Path
    launchers: list[subprocess.Popen] = field(default_factory=list)
    kills: list[tuple[int, float]] = field(default_factory=list)  # (group, wall time)

    def steps(self, group: int) -> list[dict]:
        path = self.folder / f"replica{group}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def output(self, group: int) -> str:
        return (self.folder / f"replica{group}.log").read_text(errors="replace")


def lighthouse(config: FaultToleranceBenchmarkConfig, folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = ["torchft_lighthouse", "--min_replicas", str(config.min_replicas), *config.lighthouse, "--bind", f"[::]:{port}"]
    with (folder / "lighthouse.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://{socket.gethostname()}:{port}"


def launch(config: FaultToleranceBenchmarkConfig, run: Run, seed: int, address: str) -> None:
    """One torchrun per replica group: a killed worker is restarted by its own launcher only."""
    for group in range(config.replicas):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            f"--max-restarts={config.max_restarts}", str(ROOT / "recipes" / "gpt.py"),
            "strategy.fault_tolerance=torchft", f"strategy.ft.min_replicas={config.min_replicas}",
            "trainer.devices=1", f"trainer.max_steps={config.steps}",
            f"trainer.val_check_interval={config.steps}", "trainer.limit_val_batches=null",
            "trainer.enable_progress_bar=false", f"seed={seed}", f"hydra.run.dir={run.folder / f'replica{group}'}",
            "+callbacks.steplog._target_=benchmarks.fault_tolerance.StepLog",
            f"+callbacks.steplog.path={run.folder / f'replica{group}.jsonl'}", *config.recipe,
        ]  # fmt: skip
        environ = {
            # RUST_LOG: torchft's Rust side logs every quorum at INFO otherwise.
            **os.environ, "TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(group), "OMP_NUM_THREADS": "1",
            "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }  # fmt: skip
        with (run.folder / f"replica{group}.log").open("w") as log:
            run.launchers.append(subprocess.Popen(command, cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT))


def kill_in_turn(config: FaultToleranceBenchmarkConfig, run: Run) -> None:
    """Every ``kill_every`` committed steps, once every group is back, SIGKILL one group's worker."""
    next_kill, victim = config.kill_every, 1 % config.replicas
    while any(launcher.poll() is None for launcher in run.launchers):
        survivor = run.steps((victim + 1) % config.replicas)
        if survivor and survivor[-1]["replicas"] == config.replicas and survivor[-1]["committed_steps"] >= next_kill:
            victim_steps = run.steps(victim)
            if victim_steps and survivor[-1]["committed_steps"] < config.steps - config.kill_every // 2:
                os.kill(victim_steps[-1]["pid"], signal.SIGKILL)
                run.kills.append((victim, time.time()))
                print(f"[benchmark] {run.name}: killed replica group {victim} at committed step "
                      f"{survivor[-1]['committed_steps']}", flush=True)  # fmt: skip
                next_kill = survivor[-1]["committed_steps"] + config.kill_every
                victim = (victim + 1) % config.replicas
        time.sleep(0.2)


def execute(config: FaultToleranceBenchmarkConfig, name: str, seed: int, kill: bool) -> Run:
    run = Run(name, Path(config.output_dir).resolve() / name)
    run.folder.mkdir(parents=True, exist_ok=True)
    beacon, address = lighthouse(config, run.folder)
    try:
        launch(config, run, seed, address)
        if kill:
            kill_in_turn(config, run)
            (run.folder / "kills.json").write_text(json.dumps(run.kills))  # for a later look at the logs
        deadline = time.monotonic() + config.timeout
        for group, launcher in enumerate(run.launchers):
            launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
            if launcher.returncode != 0:
                raise RuntimeError(f"{name}: replica group {group}'s torchrun exited {launcher.returncode}:\n"
                                   + run.output(group)[-3000:])  # fmt: skip
    finally:
        for launcher in run.launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        beacon.send_signal(signal.SIGTERM)
        beacon.wait()
    return run


def seconds_per_step(steps: list[dict], start: float, end: float) -> float:
    """The mean time between the committed steps logged between ``start`` and ``end``."""
    times = [s["time"] for s in steps if start < s["time"] <= end]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


def samples_per_second(steps: list[dict], start: float, end: float) -> float:
    """Samples committed between ``start`` and ``end`` (wall time), per second (``steps``: the job's, ``job_steps``)."""
    committed = [s for s in steps if s["committed"] and start < s["time"] <= end]
    return sum(s["replicas"] * s["samples"] for s in committed) / (end - start)


def val_loss(run: Run, group: int = 0) -> float:
    found = FINAL.findall(run.output(group))
    if not found:
        raise RuntimeError(f"{run.name}: no final val_loss in replica group {group}'s output")
    return float(found[-1])


def job_steps(run: Run, replicas: int) -> list[dict]:
    """The job's committed steps, each once, when its first replica group logged it, in time order."""
    first: dict[int, dict] = {}
    for group in range(replicas):
        for step in run.steps(group):
            if step["committed"] and (step["committed_steps"] not in first or step["time"] < first[step["committed_steps"]]["time"]):
                first[step["committed_steps"]] = step
    return sorted(first.values(), key=lambda step: step["time"])


def analyse(config: FaultToleranceBenchmarkConfig, free: list[Run], failing: Run) -> dict[str, Any]:
    windows, recovered = [], []
    committed = job_steps(failing, config.replicas)
    for group, killed_at in failing.kills:
        # Down from the kill until the killed group's first committed step after it.
        restarted = [s for s in failing.steps(group) if s["time"] > killed_at and s["committed"]]
        back = restarted[0]["time"] if restarted else committed[-1]["time"]
        rate, step = samples_per_second(committed, killed_at, back), seconds_per_step(committed, killed_at, back)
        windows.append((group, back - killed_at, rate, step, bool(restarted)))
        peers = {
            s["committed_steps"]: s["hash"]
            for other in range(config.replicas)
            if other != group
            for s in failing.steps(other)
            if s["committed"]
        }
        recovered.append(bool(restarted) and restarted[0]["hash"] == peers.get(restarted[0]["committed_steps"]))
    pids = {group: {s["pid"] for s in failing.steps(group)} for group in range(config.replicas)}
    killed = {group: sum(1 for g, _ in failing.kills if g == group) for group in range(config.replicas)}
    result: dict[str, Any] = {
        "windows": windows,
        "recovered": recovered,
        "one_pid_each": all(len(pids[g]) == killed[g] + 1 for g in pids),
        "failing_loss": val_loss(failing),
        "committed": committed[-1]["committed_steps"],
    }
    if free:
        timed = job_steps(free[0], config.replicas)[config.warmup :]
        result["free_rate"] = samples_per_second(timed, timed[0]["time"], timed[-1]["time"])
        result["free_step"] = seconds_per_step(timed, timed[0]["time"] - 1, timed[-1]["time"])
        result["free_losses"] = [val_loss(run) for run in free]
    return result


def report(config: FaultToleranceBenchmarkConfig, result: dict[str, Any]) -> str:
    bar = (config.replicas - 1) / config.replicas
    free_rate = result.get("free_rate")
    lines = [
        f"{config.replicas} replica groups (at least {config.min_replicas} a step), one torchrun each (CPU, gloo), "
        f"recipes/gpt.py {' '.join(config.recipe)}, trainer.max_steps={config.steps}, "
        f"a kill every {config.kill_every} committed steps",
        "",
    ]
    if free_rate is not None:
        lines += [
            f"fault-free throughput: {free_rate:.1f} samples/s, {result['free_step']:.3f} s a step "
            f"(after {config.warmup} steps)",
            "",
        ]
    lines += [
        "| kill | group | down (s) | survivors' samples/s | / fault-free | bar | s a step while down | recovered bitwise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, ((group, down, rate, step, back), same) in enumerate(zip(result["windows"], result["recovered"])):
        ratio = f"{rate / free_rate:.2f}" if free_rate else "-"
        came_back = "" if back else " (not back by the end)"
        lines.append(
            f"| {index + 1} | {group} | {down:.1f}{came_back} | {rate:.1f} | {ratio} | {bar:.2f} | {step:.3f} | "
            f"{'yes' if same else 'NO'} |"
        )
    lines += [
        "",
        f"job restarted as a whole: {'no' if result['one_pid_each'] else 'YES'} (only killed groups' workers changed pid; "
        "every torchrun exited 0)",
    ]
    losses = result.get("free_losses")
    if losses:
        low, high = min(losses), max(losses)
        spread = high - low
        inside = low - spread <= result["failing_loss"] <= high + spread
        lines.append(
            f"validation loss: fault-free seeds {', '.join(f'{loss:.4f}' for loss in losses)}; with failures "
            f"{result['failing_loss']:.4f} ({result['committed']} committed steps): "
            f"{'inside' if inside else 'OUTSIDE'} [{low - spread:.4f}, {high + spread:.4f}]"
        )
    else:
        lines.append(f"validation loss with failures: {result['failing_loss']:.4f} ({result['committed']} committed steps)")
    return "\n".join(lines)


def run_and_report(config: FaultToleranceBenchmarkConfig) -> str:
    if config.replicas < 2:
        raise ValueError(f"replicas={config.replicas} is invalid: expected at least 2 (one is killed).")
    free = [execute(config, f"fault_free_seed{seed}", seed, kill=False) for seed in config.seeds] if config.compare else []
    failing = execute(config, f"failures_seed{config.seeds[0]}", config.seeds[0], kill=True)
    if not failing.kills:
        raise RuntimeError(f"no replica group was killed: steps={config.steps} is too few for kill_every={config.kill_every}")
    return report(config, analyse(config, free, failing))


main = benchmark_main("fault_tolerance", FaultToleranceBenchmarkConfig, run_and_report)

if __name__ == "__main__":
    main()
