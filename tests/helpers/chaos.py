"""Transient faults at torchft's process group, and every rank's final state, for the chaos tests.

A transient fault is the smallest failure across replica groups: one collective on torchft's
process group is issued and completes on every rank (the peers see nothing wrong), but reports a
failure on one side only, as a timeout or a connection reset seen by one end does (issue 50). The
replica groups are real ``torchrun`` jobs of ``recipes/gpt.py``; the faults reach their workers
without any change to lit_dp, as a Lightning callback of the recipe's config:

    +callbacks.faults._target_=tests.helpers.chaos.TransientFaults
    +callbacks.final._target_=tests.helpers.chaos.FinalWeights +callbacks.final.folder=/tmp/run/final

``TransientFaults`` reads its plan from ``LIT_DP_FAULTS`` (a JSON list of ``Fault``) and appends
one JSON line per fault it injected to ``LIT_DP_FAULTS_LOG``, which the test reads to assert that
the faults really fired. At ``on_fit_start`` (the Manager exists by then) it gives the Manager's
process group a subclass of its own class whose collectives go through ``_Injector``: each call
is counted by its kind, the faults planned for this replica group and rank are matched, and a
matching one returns a work that completes the real collective and then fails. The kinds:

- ``bucket``: a collective of a data-parallel step: a gradient bucket's all-reduce (with groups
  of several ranks, this rank's shard of it);
- ``sync-count``, ``sync-payload``: a collective while LocalSGD is in its local phase (its inner
  steps never cross groups): a LocalSGD or DiLoCo sync; its count of the ranks taking part is the
  one-element tensor, its payloads (the deltas, the buffers) the others;
- ``sync``: either of the two;
- ``heal``: the first cross-group collective after a heal: this rank sent its state to a
  recovering group or received a peer's (torchft's checkpoint transport, at a step above 0:
  step 0's ``init_sync`` is not one), or this worker is a restarted one (``TORCHELASTIC_RESTART_COUNT``
  above 0), whose group recovered a peer's state at its first quorum.

A fault fires at the first collective of its kind issued at ``trainer.global_step >= step`` (read
when the collective comes: a sync is counted at the step that makes it), after
``skip`` such collectives, and once: a restarted worker reads the log and never fires a fault
that already fired. Every collective across groups that fails, planned or not (a group aborted
after a fault, a peer that closed its connection), is logged as it happens (``read_failures``), and
every worker that ends its fit writes its collectives counted by kind (``read_collectives``): what a
fault cost, seen from below the library.

``FinalWeights`` writes every rank's model (parameters and buffers), its validation loss, its
global step and its worker's restart count at the end of the fit, for the bitwise comparison of
every rank of every group (Lightning's checkpoints hold only each group's rank 0).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

FAULTS_ENV = "LIT_DP_FAULTS"
FAULTS_LOG_ENV = "LIT_DP_FAULTS_LOG"
FAILURES = "failures.jsonl"  # every collective across groups that failed, next to the log (read_failures)
KINDS = ("bucket", "sync-count", "sync-payload", "sync", "heal")
# torchft's ProcessGroupWrapper collectives that can carry bytes across replica groups.
COLLECTIVES = (
    "allreduce",
    "allgather",
    "allgather_into_tensor_coalesced",
    "alltoall_base",
    "broadcast",
    "reduce_scatter",
)


@dataclass(frozen=True)
class Fault:
    """One planned transient fault: on rank ``rank`` of replica group ``group``, at the first collective of
    ``kind`` (see the module docstring) issued at ``trainer.global_step >= step``, after ``skip`` of them."""

    group: int
    rank: int
    kind: str
    step: int = 0
    skip: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Fault(kind={self.kind!r}) is invalid: expected one of {', '.join(KINDS)}.")
        if min(self.group, self.rank, self.step, self.skip) < 0:
            raise ValueError(f"{self} is invalid: expected group, rank, step and skip of at least 0.")


def faults_environment(faults: Iterable[Fault], log: Path) -> dict[str, str]:
    """The variables that hand ``faults`` to the workers of every replica group, and where they log them."""
    return {FAULTS_ENV: json.dumps([asdict(fault) for fault in faults]), FAULTS_LOG_ENV: str(log)}


def read_plan(environ: dict[str, str] | os._Environ = os.environ) -> list[Fault]:
    """The faults ``LIT_DP_FAULTS`` plans; a ``ValueError`` naming the variable when it is malformed."""
    text = environ.get(FAULTS_ENV, "[]")
    try:
        entries = json.loads(text)
        if not isinstance(entries, list):
            raise TypeError("not a list")
        return [Fault(**entry) for entry in entries]
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{FAULTS_ENV}={text!r} is invalid ({error}): expected a JSON list of objects with group, rank, kind "
            f"(one of {', '.join(KINDS)}) and optionally step and skip."
        ) from None


def random_faults(
    seed: int, count: int, groups: list[int], ranks: int, kinds: list[str], steps: tuple[int, int]
) -> list[Fault]:
    """``count`` faults on random ranks of ``groups``, at random steps in ``[steps[0], steps[1])``, of
    ``kinds`` in turn (so each kind listed is drawn once before any twice), reproducible from ``seed``.
    Two faults never share a step, so that each is a failure of its own."""
    chooser = random.Random(seed)
    chosen = sorted(chooser.sample(range(*steps), count))
    kinds_in_turn = [kinds[i % len(kinds)] for i in range(count)]
    chooser.shuffle(kinds_in_turn)
    return [
        Fault(group=chooser.choice(groups), rank=chooser.randrange(ranks), kind=kind, step=step)
        for kind, step in zip(kinds_in_turn, chosen)
    ]


def read_fault_log(path: Path) -> list[dict[str, Any]]:
    """The faults injected, one record each: ``fault`` (its index in the plan), ``group``, ``rank``, ``kind``,
    ``kinds`` (every kind the collective was: a heal's may also be a sync's count), ``step``, ``ordinal`` (the
    collective's number among this worker's of that kind), ``sync`` (the number of the sync it fell in, among
    this worker's), ``numel``, ``collective``, ``pid``."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_failures(folder: Path) -> list[dict[str, Any]]:
    """Every collective across groups that failed on some worker, planned or not, as it happened: ``group``,
    ``rank``, ``pid``, ``kind``, ``step``."""
    path = folder / FAILURES
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_trained(folder: Path, group: int) -> int:
    """The trainer's global step the ranks of replica group ``group`` reached last (-1 before any): what a test
    times a kill by, whatever torchft counts (per-step sync commits every step, DiLoCo only its syncs)."""
    steps = []
    for path in folder.glob(f"trained-group{group}-rank*"):
        try:
            steps.append(int(path.read_text()))
        except ValueError:  # being written
            continue
    return max(steps, default=-1)


def read_collectives(folder: Path) -> list[dict[str, Any]]:
    """Every worker's cross-group collectives that ended its fit: ``group``, ``rank``, ``restarts``, ``counts``
    (by kind) and ``failures`` (``[kind, step]`` of each that failed on that worker, planned or not)."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("collectives-group*-rank*-pid*.json"))]


class TransientFaults(pl.Callback):
    """Injects the faults of ``LIT_DP_FAULTS`` planned for this worker's replica group and rank (module docstring)."""

    def __init__(self) -> None:
        self.injector: _Injector | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fault_tolerance = getattr(trainer.strategy, "fault_tolerance", None)
        manager = getattr(fault_tolerance, "manager", None)
        if manager is None:
            raise ValueError(
                "tests.helpers.chaos.TransientFaults needs strategy.fault_tolerance=torchft: it injects faults at "
                "torchft's process group across replica groups."
            )
        group = int(os.environ.get("REPLICA_GROUP_ID") or fault_tolerance.settings.replica_group)
        plan = read_plan()
        log_path = Path(os.environ.get(FAULTS_LOG_ENV, "faults.jsonl"))
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        self.injector = _Injector(group, trainer.global_rank, plan, log_path, restarted, trainer)
        self.injector.install(manager)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.injector is not None:  # how far this rank trained, for a test that kills it at a step (read_trained)
            self.injector.note_trained(trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.injector is not None:
            self.injector.write_collectives(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


class _Injector:
    """One worker's faults: counts its cross-group collectives by kind and fails the planned ones. The step and
    the phase of a collective are read from ``trainer`` when it comes (``position``); without one, from ``step``
    and ``phase``, which the caller sets."""

    def __init__(
        self, group: int, rank: int, plan: list[Fault], log: Path, restarted: bool, trainer: pl.Trainer | None = None
    ) -> None:
        self.group, self.rank, self.log, self.trainer = group, rank, log, trainer
        self.mine = {index: fault for index, fault in enumerate(plan) if (fault.group, fault.rank) == (group, rank)}
        self.step = 0
        self.phase = "bucket"
        self.counts: dict[str, int] = {}  # collectives seen per kind, this worker
        self.matched: dict[int, int] = {}  # per planned fault: collectives of its kind seen since its step
        self.syncs: set[int] = set()  # the steps of this worker's syncs, for their ordinal
        self.healed = restarted  # the next collective is one during a heal
        self.failures: list[tuple[str, int]] = []  # (kind, step) of every collective that failed here
        self.hit_kinds: list[str] = []  # every kind of the collective a fault fell on last
        self._lock = threading.Lock()

    def install(self, manager: Any) -> None:
        """The Manager's process group fails the planned collectives; its checkpoint transport tells of heals."""
        pg = manager._pg
        overrides = {name: _failing(name) for name in COLLECTIVES if hasattr(type(pg), name)}
        pg.__class__ = type(f"Chaos{type(pg).__name__}", (type(pg),), overrides)
        pg._chaos = self
        transport = manager._checkpoint_transport
        for name in ("send_checkpoint", "recv_checkpoint"):
            setattr(transport, name, self._noting_heals(getattr(transport, name)))

    def _noting_heals(self, transfer: Any) -> Any:
        def transfer_and_note(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("step", 0) > 0:
                self.healed = True
            return transfer(*args, **kwargs)

        return transfer_and_note

    def position(self) -> None:
        """The trainer's step now, and the phase: LocalSGD's syncs while it is in its local phase (its inner steps
        never cross groups), else a data-parallel step's buckets. Read when the collective comes, not from the
        batch's hooks: a sync may come with the step's quorum, before the batch (a restarted group meeting its
        peers at a sync), where the hooks would still say the last step's."""
        if self.trainer is None:
            return
        local_sgd = getattr(self.trainer.strategy, "local_sgd", None)
        self.step = self.trainer.global_step
        self.phase = "sync" if local_sgd is not None and getattr(local_sgd, "in_local_phase", False) else "bucket"

    def classify(self, tensors: list[torch.Tensor]) -> list[str]:
        """The kinds a collective of ``tensors`` in the current phase is (the most specific first)."""
        self.position()
        if self.phase == "bucket":
            return ["bucket"]
        self.syncs.add(self.step)
        numel = sum(t.numel() for t in tensors)
        return ["sync-count" if numel == 1 else "sync-payload", "sync"]

    def collective(self, tensors: list[torch.Tensor]) -> tuple[str, int, tuple[int, Fault, str, int] | None]:
        """Count this collective: its kind, its step, and the planned fault it must fail if any
        (index, fault, kind, ordinal)."""
        with self._lock:
            kinds = self.classify(tensors)
            for kind in kinds:
                self.counts[kind] = self.counts.get(kind, 0) + 1
            healed, self.healed = self.healed, False
            if healed:
                kinds.append("heal")
                self.counts["heal"] = self.counts.get("heal", 0) + 1
            for index, fault in self.mine.items():
                if fault.kind not in kinds or self.step < fault.step:
                    continue
                seen = self.matched.get(index, 0)
                self.matched[index] = seen + 1
                if seen == fault.skip and not self._fired(index):
                    self.hit_kinds = kinds
                    return kinds[0], self.step, (index, fault, fault.kind, self.counts[fault.kind])
        return kinds[0], self.step, None

    def note_trained(self, step: int) -> None:
        (self.log.parent / f"trained-group{self.group}-rank{self.rank}").write_text(str(step))

    def note_failure(self, kind: str, step: int) -> None:
        """One line per failed collective to ``failures.jsonl`` next to the log, at once: a worker that
        wedges or crashes later has told of it all the same (``read_failures``)."""
        record = {"group": self.group, "rank": self.rank, "pid": os.getpid(), "kind": kind, "step": step}
        with self._lock:
            self.failures.append((kind, step))
            with (self.log.parent / FAILURES).open("a") as out:
                out.write(json.dumps(record) + "\n")

    def write_collectives(self, restarts: int) -> None:
        """This worker's cross-group collectives, counted by kind, and those that failed (kind, step), to a
        file next to the log (``read_collectives``)."""
        path = self.log.parent / f"collectives-group{self.group}-rank{self.rank}-pid{os.getpid()}.json"
        with self._lock:
            record = {"group": self.group, "rank": self.rank, "restarts": restarts, "counts": self.counts,
                      "failures": self.failures}  # fmt: skip
        path.write_text(json.dumps(record))

    def _fired(self, index: int) -> bool:
        return any(record["fault"] == index for record in read_fault_log(self.log))

    def record(self, index: int, kind: str, ordinal: int, numel: int, collective: str) -> str:
        record = {
            "fault": index, "group": self.group, "rank": self.rank, "kind": kind, "kinds": self.hit_kinds,
            "step": self.step, "ordinal": ordinal, "sync": len(self.syncs) if "sync" in self.hit_kinds else None,
            "numel": numel, "collective": collective, "pid": os.getpid(), "time": time.time(),
        }  # fmt: skip
        with self.log.open("a") as out:  # one short line per write: whole under O_APPEND
            out.write(json.dumps(record) + "\n")
        return (
            f"lit_dp chaos: a transient fault injected on replica group {self.group}, rank {self.rank}: its {kind} "
            f"collective number {ordinal} ({collective}, step {self.step}) completed on every rank but fails here"
        )


def _failing(name: str) -> Any:
    """The process group's collective ``name``, failing on this rank where the plan says so, and every failure
    of it (planned or not: a collective on a group that was aborted, a peer that closed its connection) noted."""

    def collective(self: Any, *args: Any) -> dist.Work:
        injector: _Injector = self._chaos
        tensors = _tensors(args)
        kind, step, hit = injector.collective(tensors)
        try:
            work = getattr(super(type(self), self), name)(*args)
        except Exception:
            injector.note_failure(kind, step)
            raise
        if hit is None:
            work.get_future().add_done_callback(lambda future: _note_if_failed(future, injector, kind, step))
            return work
        index, _, hit_kind, ordinal = hit
        injector.note_failure(kind, step)
        message = injector.record(index, hit_kind, ordinal, sum(t.numel() for t in tensors), name)
        return _FailedWork(work, RuntimeError(message))

    collective.__name__ = name
    return collective


def _note_if_failed(future: torch.futures.Future, injector: _Injector, kind: str, step: int) -> None:
    try:
        future.wait()
    except Exception:  # noqa: BLE001 - any failure of the collective is what is noted
        injector.note_failure(kind, step)


def _tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors a collective sends (its first tensor or list of tensors among ``args``)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return [arg]
        if isinstance(arg, list) and arg and all(isinstance(t, torch.Tensor) for t in arg):
            return arg
    return []


class _FailedWork(dist.Work):
    """A collective that completed, reported as failed: its wait and its future raise once it is done."""

    def __init__(self, work: dist.Work, error: Exception) -> None:
        super().__init__()
        self._work = work
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._work.wait()
        raise self._error

    def get_future(self) -> torch.futures.Future:
        error = self._error

        def fail(_: torch.futures.Future) -> None:
            raise error

        return self._work.get_future().then(fail)


class Pause(pl.Callback):
    """Every rank of the replica groups ``groups`` sleeps ``seconds`` once, in the step of ``trainer.global_step ==
    step`` (at its start): ``before_sync``, before its optimizer step (a LocalSGD sync comes inside it): a group
    late to that sync's quorum; ``after_step``, at the step's end, before lit_dp's own hooks (its quorum after the
    last step comes there): a group slow to finish (a checkpoint written, say)."""

    def __init__(self, groups: list[int], step: int, seconds: float, when: str = "before_sync") -> None:
        if when not in ("before_sync", "after_step"):
            raise ValueError(f"Pause(when={when!r}) is invalid: expected before_sync or after_step.")
        self.groups, self.step, self.seconds, self.when = set(groups), step, seconds, when
        self._paused = False

    def _pause(self, at: str, step: int) -> None:
        mine = int(os.environ.get("REPLICA_GROUP_ID", "0")) in self.groups
        if mine and not self._paused and at == self.when and step == self.step:
            self._paused = True
            time.sleep(self.seconds)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._pause("before_sync", trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._pause("after_step", trainer.global_step - 1)


class FinalWeights(pl.Callback):
    """At the fit's end, this rank's model state (parameters and buffers), its ``val_loss``, its global step
    and its worker's restart count, to ``folder/group<G>-rank<R>.pt``."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        val_loss = trainer.callback_metrics.get("val_loss")
        final = {
            "state": {name: tensor.detach().cpu().clone() for name, tensor in pl_module.state_dict().items()},
            "val_loss": float(val_loss) if val_loss is not None else None,
            "global_step": trainer.global_step,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "pid": os.getpid(),
        }
        group = os.environ.get("REPLICA_GROUP_ID", "0")
        path = self.folder / f"group{group}-rank{trainer.global_rank}.pt"
        torch.save(final, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)  # whole or absent: a rank killed while writing leaves no half file


def read_finals(folder: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """``FinalWeights``' records by (group, rank)."""
    finals = {}
    for path in sorted(folder.glob("group*-rank*.pt")):
        group, rank = path.stem.removeprefix("group").split("-rank")
        finals[int(group), int(rank)] = torch.load(path, map_location="cpu", weights_only=False)
    return finals


def unequal_ranks(finals: dict[tuple[int, int], dict[str, Any]]) -> list[str]:
    """Each (group, rank) whose final state differs bitwise from group 0's rank 0, with the tensors that
    differ and by how much (empty when every rank of every group is equal)."""
    reference_key = min(finals)
    reference = finals[reference_key]["state"]
    found = []
    for key, final in sorted(finals.items()):
        differ = [
            f"{name} (max |diff| {(tensor.double() - reference[name].double()).abs().max().item():.3g})"
            for name, tensor in final["state"].items()
            if not torch.equal(tensor, reference[name])
        ]
        if differ:
            shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
            found.append(
                f"group {key[0]} rank {key[1]} differs from group {reference_key[0]} rank {reference_key[1]}: {shown}"
            )
    return found
