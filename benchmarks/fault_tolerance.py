"""Live fault tolerance on torchft under chaos: a random replica group killed every few seconds.

    python -m benchmarks.fault_tolerance                  # 3 replica groups on CPU, the recipe's small GPT
    python -m benchmarks.fault_tolerance chaos_seconds=60 steps=500 compare=false

Runs of ``recipes/gpt.py`` with ``strategy.fault_tolerance=torchft``, each replica group under
its own ``torchrun --standalone --nproc-per-node=1 --max-restarts=...`` around one lighthouse
(the commands of docs/fault_tolerance.md): fault-free with ``seeds[0]`` and ``seeds[1]``, then
with ``seeds[0]`` under chaos: every ``kill_every`` seconds for ``chaos_seconds``, the worker of
a random replica group that is training gets SIGKILL (among the groups killed least so far, so
that each, group 0 included, is killed at least ``kills_per_group`` times), every
``pair_every``-th time a second group ``pair_gap`` seconds later; its torchrun starts it again.
Kills stop ``tail_seconds`` before the job's end (at its pace), for the last victim to be back. Each worker logs
every step (``StepLog``): wall time, pid, torchft's committed steps, the groups present, a
hash of the parameters' bytes, and at the end of the fit the final hash.

The report, per failure (issue 34's measures):

- **stall**: the time in which no group commits a step around the kill (from the job's last
  commit before it to its first after it; one step's time is part of it), and around the
  victim's return (its first quorum, recovery and step);
- **discarded**: the steps some group discarded from the kill to the victim's first commit;
- **recovery**: from the kill to the victim's first committed step (torchrun's restart, the
  import of torch, Lightning and the recipe, the quorum, the state received), and the state's
  transfer alone (``ft/recovery_s``);
- **bitwise**: the victim's parameters at its first committed step equal its peers' there.

And for the run: whether a group was ever wedged (a live worker that went ``wedged_after``
seconds without a step), whether every launcher exited 0 by itself, whether the final
parameters are bitwise equal across groups, and the validation loss against the two
fault-free seeds (inside ``[min - d, max + d]``, ``d`` the seeds' difference).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from benchmarks.common import LIGHTHOUSE_FLAGS, benchmark_main, start_lighthouse

ROOT = Path(__file__).resolve().parents[1]
FINAL = re.compile(r"^\[lit_dp\] final .*?val_loss=([-\d.]+)", re.MULTILINE)


@dataclass
class FaultToleranceBenchmarkConfig:
    """What to run (benchmarks/conf/fault_tolerance.yaml)."""

    replicas: int = 3
    # The lighthouse's and strategy.ft.min_replicas: 1, so a lone survivor of two failures goes on.
    min_replicas: int = 1
    steps: int = 1500  # trainer.max_steps of each run
    chaos_seconds: float = 240.0  # how long failures go on
    kill_every: float = 12.0  # seconds between failures
    pair_every: int = 3  # every pair_every-th failure takes a second group pair_gap seconds after the first
    pair_gap: float = 2.0
    kills_per_group: int = 2  # the least each group is killed (reported if the chaos was too short for it)
    tail_seconds: float = 60.0  # no kill this close to the job's end (a victim's restart takes 5 to 20 s)
    chaos_seed: int = 0
    seeds: tuple[int, ...] = (7, 8)  # the run with failures uses the first
    compare: bool = True  # also the fault-free runs, one per seed (validation loss)
    recipe: tuple[str, ...] = ()  # overrides of recipes/gpt.py (none: its small CPU GPT, 2 layers x 128)
    max_restarts: int = 100  # each torchrun's --max-restarts: one restart per failure of its group
    lighthouse: tuple[str, ...] = LIGHTHOUSE_FLAGS
    stall_bar: float = 2.0  # issue 34's bars: the stall of each failure, steps discarded per failure
    discard_bar: int = 1
    wedged_after: float = 20.0  # a live worker this long without a step is wedged
    timeout: float = 2400.0  # seconds a run may take
    output_dir: str = "."


class StepLog(pl.Callback):
    """One JSON line per training step to ``path``: wall time, pid, torchft's committed steps, whether the
    step committed, the replica groups present, this replica's samples, the last recovery's seconds, a hash of
    the parameters' bytes; and at the end of the fit the final hash (``final``)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        ft = trainer.strategy.fault_tolerance
        line = {
            "time": time.time(),
            "pid": os.getpid(),
            "committed_steps": ft.committed_steps,
            "committed": ft.last_committed,
            "replicas": ft.manager.num_participants(),
            "samples": len(batch[0]),
            "recovery_s": ft.recovery_seconds,
            "hash": parameters_hash(pl_module),
        }
        self._write(line)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write({"time": time.time(), "pid": os.getpid(), "final": parameters_hash(pl_module)})

    def _write(self, line: dict) -> None:
        with self.path.open("a") as log:
            log.write(json.dumps(line) + "\n")


def parameters_hash(module: Any) -> str:
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Run:
    """One run's replica groups: their torchrun processes, step logs and outputs."""

    name: str
    folder: Path
    started: float = 0.0
    launchers: list[subprocess.Popen] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)  # {"group", "time", "pid", "paired"}

    def records(self, group: int) -> list[dict]:
        path = self.folder / f"replica{group}.jsonl"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return rows

    def steps(self, group: int) -> list[dict]:
        return [row for row in self.records(group) if "committed_steps" in row]

    def final(self, group: int) -> str | None:
        finals = [row["final"] for row in self.records(group) if "final" in row]
        return finals[-1] if finals else None

    def output(self, group: int) -> str:
        return (self.folder / f"replica{group}.log").read_text(errors="replace")


def launch(config: FaultToleranceBenchmarkConfig, run: Run, seed: int, address: str) -> None:
    """One torchrun per replica group: a killed worker is restarted by its own launcher only."""
    for group in range(config.replicas):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            f"--max-restarts={config.max_restarts}",
            str(ROOT / "recipes" / "gpt.py"),
            "strategy.fault_tolerance=torchft",
            f"strategy.ft.min_replicas={config.min_replicas}",
            "trainer.devices=1",
            f"trainer.max_steps={config.steps}",
            f"trainer.val_check_interval={config.steps}",
            "trainer.limit_val_batches=null",
            "trainer.enable_progress_bar=false",
            f"seed={seed}",
            f"hydra.run.dir={run.folder / f'replica{group}'}",
            "+callbacks.steplog._target_=benchmarks.fault_tolerance.StepLog",
            f"+callbacks.steplog.path={run.folder / f'replica{group}.jsonl'}",
            *config.recipe,
        ]
        environ = {
            # RUST_LOG: torchft's Rust side logs every quorum at INFO otherwise.
            **os.environ,
            "TORCHFT_LIGHTHOUSE": address,
            "REPLICA_GROUP_ID": str(group),
            "OMP_NUM_THREADS": "1",
            "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        with (run.folder / f"replica{group}.log").open("w") as log:
            run.launchers.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )


def training_worker(run: Run, group: int) -> int | None:
    """The pid of ``group``'s worker if it is training: it committed a step in the last 3 s and is alive."""
    steps = run.steps(group)
    if not steps or time.time() - steps[-1]["time"] > 3.0:
        return None
    pid = steps[-1]["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def kill(run: Run, group: int, paired: bool) -> bool:
    pid = training_worker(run, group)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    run.kills.append({"group": group, "time": time.time(), "pid": pid, "paired": paired})
    print(
        f"[benchmark] {run.name}: killed replica group {group} (pid {pid}){' with the one before' * paired}", flush=True
    )
    return True


def seconds_left(config: FaultToleranceBenchmarkConfig, run: Run) -> float:
    """The job's time to its last step at its recent pace (infinite before it has one)."""
    commits = job_commits(run, config.replicas)
    if len(commits) < 10:
        return float("inf")
    recent = commits[-20:]
    return (config.steps - len(commits)) * (recent[-1] - recent[0]) / (len(recent) - 1)


def chaos(config: FaultToleranceBenchmarkConfig, run: Run) -> None:
    """Every ``kill_every`` seconds until ``chaos_seconds``: SIGKILL a random training group among the
    least killed; every ``pair_every``-th time a second one ``pair_gap`` seconds later. No kill within
    ``tail_seconds`` of the job's end: the last victim must be back before the others finish (a group
    back after the end would find no one; with ``min_replicas`` 1 it would train alone)."""
    rng = random.Random(config.chaos_seed)
    killed = {group: 0 for group in range(config.replicas)}
    failures, next_at = 0, run.started + config.kill_every
    while any(launcher.poll() is None for launcher in run.launchers):
        now = time.time()
        if now - run.started > config.chaos_seconds or seconds_left(config, run) < config.tail_seconds:
            return
        up = [group for group in killed if training_worker(run, group) is not None]
        if now >= next_at and len(up) == config.replicas:
            fewest = min(killed[group] for group in up)
            victim = rng.choice([group for group in up if killed[group] == fewest])
            if kill(run, victim, paired=False):
                killed[victim] += 1
                failures += 1
                if config.pair_every and failures % config.pair_every == 0:
                    time.sleep(config.pair_gap)
                    others = [group for group in killed if group != victim and training_worker(run, group) is not None]
                    second = rng.choice(others) if others else None
                    if second is not None and kill(run, second, paired=True):
                        killed[second] += 1
                next_at = time.time() + config.kill_every
        time.sleep(0.1)


def execute(config: FaultToleranceBenchmarkConfig, name: str, seed: int, failures: bool) -> Run:
    run = Run(name, Path(config.output_dir).resolve() / name)
    run.folder.mkdir(parents=True, exist_ok=True)
    beacon, address = start_lighthouse(run.folder, config.min_replicas, config.lighthouse)
    try:
        run.started = time.time()
        launch(config, run, seed, address)
        if failures:
            chaos(config, run)
            (run.folder / "kills.json").write_text(json.dumps(run.kills))  # for a later look at the logs
        deadline = time.monotonic() + config.timeout
        for group, launcher in enumerate(run.launchers):
            try:
                launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"{name}: replica group {group}'s torchrun did not end within {config.timeout:.0f} s:\n"
                    + run.output(group)[-3000:]
                ) from None
            if launcher.returncode != 0:
                raise RuntimeError(
                    f"{name}: replica group {group}'s torchrun exited {launcher.returncode}:\n"
                    + run.output(group)[-3000:]
                )
    finally:
        for launcher in run.launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)  # torchrun and its worker
                launcher.wait()
        beacon.send_signal(signal.SIGTERM)
        beacon.wait()
    return run


def job_commits(run: Run, replicas: int) -> list[float]:
    """When the job committed each step: the first group's record of it, in time order."""
    first: dict[int, float] = {}
    for group in range(replicas):
        for step in run.steps(group):
            if step["committed"]:
                first[step["committed_steps"]] = min(step["time"], first.get(step["committed_steps"], step["time"]))
    return sorted(first.values())


def gap_around(commits: list[float], moment: float) -> float:
    """The time in which no group committed a step, around ``moment``."""
    before = max((t for t in commits if t <= moment), default=None)
    after = min((t for t in commits if t > moment), default=None)
    return after - before if before is not None and after is not None else float("nan")


def val_loss(run: Run, replicas: int) -> float:
    for group in range(replicas):
        found = FINAL.findall(run.output(group))
        if found:
            return float(found[-1])
    raise RuntimeError(f"{run.name}: no final val_loss in any replica group's output")


def analyse(config: FaultToleranceBenchmarkConfig, free: list[Run], chaotic: Run) -> dict[str, Any]:
    commits = job_commits(chaotic, config.replicas)
    failures = []
    for index, kill in enumerate(chaotic.kills):
        group, at = kill["group"], kill["time"]
        back = [s for s in chaotic.steps(group) if s["time"] > at and s["committed"] and s["pid"] != kill["pid"]]
        first = back[0] if back else None
        until = first["time"] if first else float("inf")
        # A pair's second failure counts its own discards.
        next_kill = chaotic.kills[index + 1]["time"] if index + 1 < len(chaotic.kills) else float("inf")
        discarded = {
            s["committed_steps"]
            for g in range(config.replicas)
            for s in chaotic.steps(g)
            if not s["committed"] and at <= s["time"] <= min(until, next_kill)
        }
        peers = {
            s["committed_steps"]: s["hash"]
            for g in range(config.replicas)
            if g != group
            for s in chaotic.steps(g)
            if s["committed"]
        }
        failures.append(
            {
                "group": group,
                "at": at - chaotic.started,
                "paired": kill["paired"],
                "stall": gap_around(commits, at),
                "rejoin_stall": gap_around(commits, until - 1e-6) if first else float("nan"),
                "discarded": len(discarded),
                "down": until - at if first else float("nan"),
                "transfer": first["recovery_s"] if first else None,
                "bitwise": bool(first) and first["hash"] == peers.get(first["committed_steps"]),
            }
        )
    wedged = []
    for group in range(config.replicas):
        steps = chaotic.steps(group)
        for previous, step in zip(steps, steps[1:]):
            if step["pid"] == previous["pid"] and step["time"] - previous["time"] > config.wedged_after:
                wedged.append((group, previous["committed_steps"], step["time"] - previous["time"]))
    finals = {group: chaotic.final(group) for group in range(config.replicas)}
    result: dict[str, Any] = {
        "failures": failures,
        "kills": {group: sum(1 for f in failures if f["group"] == group) for group in range(config.replicas)},
        "wedged": wedged,
        "finals_equal": None not in finals.values() and len(set(finals.values())) == 1,
        "finals": finals,
        "loss": val_loss(chaotic, config.replicas),
        "committed": max(s["committed_steps"] for g in range(config.replicas) for s in chaotic.steps(g)),
    }
    if free:
        result["free_losses"] = [val_loss(run, config.replicas) for run in free]
        timed = job_commits(free[0], config.replicas)
        result["free_step"] = (timed[-1] - timed[len(timed) // 10]) / max(1, len(timed) - 1 - len(timed) // 10)
    return result


def report(config: FaultToleranceBenchmarkConfig, result: dict[str, Any]) -> str:
    failures = result["failures"]
    lines = [
        f"{config.replicas} replica groups (at least {config.min_replicas} a step), one torchrun each (CPU, gloo), "
        f"recipes/gpt.py {' '.join(config.recipe)}, trainer.max_steps={config.steps}; a failure every "
        f"{config.kill_every:.0f} s for {config.chaos_seconds:.0f} s, one in {config.pair_every} taking a second group "
        f"{config.pair_gap:.0f} s later",
        "",
    ]
    if "free_step" in result:
        lines += [f"fault-free: {result['free_step']:.3f} s a step (the job's, after the first tenth)", ""]
    lines += [
        "| failure | group | at (s) | stall (s) | stall at its return (s) | discarded | back after (s) | state transfer (s) | bitwise at first commit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for index, f in enumerate(failures):
        transfer = f"{f['transfer']:.2f}" if f["transfer"] is not None else "-"
        lines.append(
            f"| {index + 1}{' (pair)' * f['paired']} | {f['group']} | {f['at']:.0f} | {f['stall']:.2f} | "
            f"{f['rejoin_stall']:.2f} | {f['discarded']} | {f['down']:.1f} | {transfer} | {'yes' if f['bitwise'] else 'NO'} |"
        )
    stalls = [f["stall"] for f in failures] + [f["rejoin_stall"] for f in failures]
    worst_stall = max(stalls, default=float("nan"))
    worst_discards = max((f["discarded"] for f in failures), default=0)
    few = [group for group, count in result["kills"].items() if count < config.kills_per_group]
    losses = result.get("free_losses")
    lines += [
        "",
        f"failures per group: {', '.join(f'{g}: {n}' for g, n in result['kills'].items())}"
        + (f" (FEWER than {config.kills_per_group} for {few}: lengthen chaos_seconds)" if few else ""),
        f"worst stall: {worst_stall:.2f} s ({'within' if worst_stall <= config.stall_bar else 'OVER'} "
        f"{config.stall_bar:.0f} s); most steps discarded by one failure: {worst_discards} "
        f"({'within' if worst_discards <= config.discard_bar else 'OVER'} {config.discard_bar})",
        f"recovered bitwise at the first commit: {sum(f['bitwise'] for f in failures)} of {len(failures)}",
        "wedged: "
        + (
            "never"
            if not result["wedged"]
            else ", ".join(f"group {g} at step {s} for {t:.0f} s" for g, s, t in result["wedged"])
        ),
        "the job ended by itself: yes (every torchrun exited 0)",
        f"final parameters bitwise equal across groups: {'yes' if result['finals_equal'] else 'NO'}",
    ]
    if losses:
        low, high = min(losses), max(losses)
        spread = high - low
        inside = low - spread <= result["loss"] <= high + spread
        lines.append(
            f"validation loss: fault-free seeds {', '.join(f'{loss:.4f}' for loss in losses)}; with failures "
            f"{result['loss']:.4f} ({result['committed']} committed steps): "
            f"{'inside' if inside else 'OUTSIDE'} [{low - spread:.4f}, {high + spread:.4f}]"
        )
    else:
        lines.append(f"validation loss with failures: {result['loss']:.4f} ({result['committed']} committed steps)")
    return "\n".join(lines)


def run_and_report(config: FaultToleranceBenchmarkConfig) -> str:
    if config.replicas < 2:
        raise ValueError(f"replicas={config.replicas} is invalid: expected at least 2 (one is killed).")
    free = (
        [execute(config, f"fault_free_seed{seed}", seed, failures=False) for seed in config.seeds]
        if config.compare
        else []
    )
    chaotic = execute(config, f"chaos_seed{config.seeds[0]}", config.seeds[0], failures=True)
    if not chaotic.kills:
        raise RuntimeError(
            f"no replica group was killed: steps={config.steps} is too few for kill_every={config.kill_every}"
        )
    return report(config, analyse(config, free, chaotic))


main = benchmark_main("fault_tolerance", FaultToleranceBenchmarkConfig, run_and_report)

if __name__ == "__main__":
    main()
