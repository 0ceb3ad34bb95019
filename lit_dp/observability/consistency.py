"""Whether the replicas still hold the same weights: the replica-consistency check (``consistency.*``).

torch DDP checks the parameters' shapes once, at construction, and trusts every rank from then
on; a non-deterministic kernel, a rank that loaded another checkpoint, a buffer updated on one
rank only or a flipped bit leave the replicas different while training goes on. Every
``consistency.every_n_steps`` synchronised steps each rank fingerprints, on the tensors' own
device and without copying them:

- every parameter kept in sync (``synced_parameters``: the trainable ones and the frozen ones,
  not those torch DDP is told to ignore), in the step's reducer ``step_started``: after the
  forward, which changes no parameter, so every rank holds what the last optimizer step left;
- with ``broadcast_buffers``, every buffer, right after the forward's broadcast of rank 0's
  buffers (``buffers_synced``), before the module's forward updates them from this rank's own
  batch (BatchNorm's running statistics); a check step whose forward broadcast nothing (it
  follows a ``no_sync`` micro-batch) compares no buffer;
- with ``consistency.optimizer_state``, each parameter's optimizer state (``exp_avg``, ...),
  in every optimizer seen stepping it.

A fingerprint (``checksum``) is the sum of a tensor's bytes read as integers, wrapping: any
change of one element, a single flipped bit included, changes it, and integer sums do not
depend on the order of the reduction, so every rank and device computes it alike. The ranks
compare them in one all-gather of 8 bytes per tensor (``lit_dp.observability.exchange``),
started in the step start and read when the step's buckets are done (on CUDA when the copy to
the host arrived, within a few steps). Every rank reaches the same verdict from the same
numbers: the reference is the copy most ranks hold (with two ranks, or a tie, the one the
group's lowest rank holds) and the error names the ranks whose copy differs, the first
differing tensor in the module's order, and the step.

With ``consistency.action="error"`` (the default) every rank raises ``ReplicaDivergenceError``
at that step and, as when the hang watchdog ends a job, a process still alive a grace later
(its error swallowed, its teardown stuck) writes its stacks and exits with status 1
(``lit_dp.observability.hang_exit.exit_after``); ``"warn"`` prints the message on the group's
first rank (when the difference appears or changes, not at every check while it lasts) and goes on.

What is compared when (docs/observability.md, "Have the replicas diverged?"): a rank that
shadows the others' steps under torch's ``Join`` (it ran out of inputs, its parameters wait for
the final broadcast) takes part in the exchange without being compared; sharding's parameters
are compared once their owners' updates landed (``settle``: with ``sharding.overlap`` the gather
still in flight is waited for first), never its optimizer state; LocalSGD's local phase has no
synchronised step, so nothing is compared between averages: instead ``lit_dp.LocalSGD`` calls
``check_after_average`` right after its averages, when the replicas must be equal again, every
``ceil(every_n_steps / K)``-th average from the first (K its initial period; parameters and
buffers; optimizer state is per rank under LocalSGD and left out); under torchft the check is off.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from lit_dp.gradients.events import ReducerObserver
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.waiting import Waiter
from lit_dp.observability.exchange import Exchange
from lit_dp.observability.hang_exit import exit_after

log = logging.getLogger(__name__)

# How long a rank that raised ReplicaDivergenceError may take to end before it exits hard.
EXIT_GRACE_SECONDS = 60.0
_WIDTHS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


class _AfterAverage(int):
    """The tag of a check after a LocalSGD average: its optimizer step, told apart from a synchronised step's."""


class ReplicaDivergenceError(RuntimeError):
    """The replicas hold different weights; the message names the ranks, the first differing tensor and the step."""


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s bytes read as the widest integers that tile them, wrapping, as a 0-d
    int64 on its device. Changing any one element changes it: the difference is a nonzero integer
    smaller than the modulus."""
    raw = raw_integers(tensor)
    return _sum(raw if raw is not None else raw_integers(tensor.detach().contiguous()))


def raw_integers(tensor: torch.Tensor) -> torch.Tensor | None:
    """A view of ``tensor``'s bytes as the widest integers that tile them; None when that needs a
    copy (a tensor not contiguous). Parameters are contiguous: the view is kept between checks."""
    flat = tensor.detach()
    if not flat.is_contiguous():
        return None
    flat = flat.view(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    raw = flat.view(torch.uint8)
    for dtype, width in _WIDTHS:
        if raw.numel() % width == 0 and raw.storage_offset() % width == 0:
            return raw.view(dtype)
    return raw


def _sum(raw: torch.Tensor) -> torch.Tensor:
    """Integers summed in their own width (wrapping), as an int64; bytes in an int64."""
    if raw.dtype == torch.uint8:
        return raw.sum(dtype=torch.int64)
    total = raw.sum(dtype=raw.dtype)
    return total if raw.dtype == torch.int64 else total.to(torch.int64)


def fingerprints(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``checksum`` of each tensor, as one int64 tensor on ``device``."""
    if not tensors:
        return _zeros(0, device)
    return torch.stack([checksum(tensor).to(device) for tensor in tensors])


class RawViews:
    """The integer views of fixed tensors (the parameters), kept between checks: a check then costs
    one sum per tensor. A view is made again when its tensor's storage changed (``param.data = ...``)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._views: list[tuple[int, torch.Tensor | None]] = [(-1, None)] * len(self._tensors)

    def fingerprints(self, device: torch.device) -> torch.Tensor:
        sums = []
        for position, tensor in enumerate(self._tensors):
            address, view = self._views[position]
            if address != tensor.data_ptr() or view is None:
                view = raw_integers(tensor)
                self._views[position] = (tensor.data_ptr(), view)
            total = _sum(view) if view is not None else checksum(tensor)
            sums.append(total if total.device == device else total.to(device))
        return torch.stack(sums) if sums else _zeros(0, device)


class ReplicaConsistency(ReducerObserver):
    """Compares the replicas every ``every_n_steps`` synchronised steps (see the module docstring).

    Args:
        named_parameters: the parameters kept in sync, with their names in the module.
        named_buffers: reads the buffers kept in sync (``broadcast_buffers``) afresh, with their names.
        group, waiter, device: where the exchange runs and how it is waited for.
        every_n_steps, action, optimizer_state: the ``consistency.*`` options.
        optimizers: the optimizers that step the module's parameters (the step clock sees them).
        settle: waits for parameter updates still in flight (sharding's overlapped gather).
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, nn.Parameter]],
        named_buffers: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        group: dist.ProcessGroup,
        waiter: Waiter,
        device: torch.device,
        every_n_steps: int,
        action: str,
        optimizers: Callable[[], list[torch.optim.Optimizer]] | None,
        settle: Callable[[], None],
    ) -> None:
        self._named_parameters = list(named_parameters)
        self._parameters = RawViews([param for _, param in self._named_parameters])
        self._named_buffers = named_buffers
        self._buffer_names = [name for name, _ in named_buffers()]
        self._group = group
        self._device = device
        self._every = every_n_steps
        self._action = action
        self._optimizers = optimizers
        self._settle = settle
        self._ranks = tuple(dist.get_process_group_ranks(group))
        self._rank = dist.get_rank()
        self._first_rank = group.rank() == 0
        self._exchange = Exchange(group, waiter, "the replica-consistency exchange", self._checked)
        self._buffers: tuple[int, torch.Tensor] | None = None  # (step, fingerprints) taken after a broadcast
        self.checks = 0  # checks read so far
        self.average_checks = 0  # of which after LocalSGD averages
        self._averages_seen = 0  # LocalSGD's averages, every rank counting alike (check_after_average)
        self.agreed_at: int | None = None  # the last step at which the replicas agreed
        self.differences: list[str] = []  # with action "warn", every message so far

    @property
    def every_n_steps(self) -> int:
        return self._every

    def due(self, step: int) -> bool:
        return step % self._every == 0

    def buffers_synced(self, step: int) -> None:
        """The forward of ``step`` just broadcast the buffers: fingerprint them if that step is checked."""
        if self.due(step) and self._buffer_names:
            current = dict(self._named_buffers())
            tensors = [current.get(name, _MISSING) for name in self._buffer_names]
            self._buffers = (step, fingerprints(tensors, self._device))

    @override
    def step_started(self, step: int, plan: StepPlan) -> None:
        self._exchange.poll()
        if step % self._every:
            return
        compared = plan.participation is not Participation.SHADOW
        if compared:
            self._settle()
        params = self._parameters.fingerprints(self._device)
        with_buffers = self._buffers is not None and self._buffers[0] == step
        buffers = self._buffers[1] if with_buffers else _zeros(len(self._buffer_names), self._device)
        self._buffers = None
        states = self._optimizer_states() if self._optimizers is not None else params[:0]
        flags = torch.tensor([int(compared), int(with_buffers)], dtype=torch.int64, device=self._device)
        self._exchange.start(torch.cat([flags, params, buffers, states]), step)

    @override
    def step_ended(self, step: int) -> None:
        self._exchange.poll()

    def check_after_average(self, step: int, shadow: bool = False, every_averages: int = 1) -> None:
        """``lit_dp.LocalSGD``'s hook after its average at optimizer step ``step``, on every rank: compare
        parameters and buffers at every ``every_averages``-th average from the first; a rank that
        shadows the others under Join (``shadow``) takes part without being compared. Read at once
        (one small all-gather per period at most): no synchronised step follows to read it."""
        self._averages_seen += 1
        if (self._averages_seen - 1) % every_averages:
            return
        params = self._parameters.fingerprints(self._device)
        current = dict(self._named_buffers())
        buffers = fingerprints([current.get(name, _MISSING) for name in self._buffer_names], self._device)
        states = _zeros(len(self._named_parameters) if self._optimizers is not None else 0, self._device)
        flags = torch.tensor([int(not shadow), int(bool(self._buffer_names))], dtype=torch.int64, device=self._device)
        self._exchange.start(torch.cat([flags, params, buffers, states]), _AfterAverage(step))
        self._exchange.poll(wait=True)

    def _checked(self, step: Any, rows: torch.Tensor) -> None:
        self.checks += 1
        self.average_checks += isinstance(step, _AfterAverage)
        message = self._difference(step, rows.tolist())
        if message is None:
            self.agreed_at = int(step)
            log.debug("lit_dp replica consistency: the replicas agree at step %d", step)
            return
        if self._action == "warn":
            # Printed when the difference appears or changes, not again at every check while it lasts.
            if self._first_rank and (not self.differences or _what(self.differences[-1]) != _what(message)):
                print(f"[lit_dp] {message}", flush=True)
            self.differences.append(message)
            return
        exit_after(EXIT_GRACE_SECONDS, self._rank, "the replicas diverged")
        raise ReplicaDivergenceError(f"lit_dp {message}")

    def summary(self) -> str:
        """One line over the checks so far (the Trainer prints it when training ends)."""
        head = f"{self.checks} check{'s' * (self.checks != 1)} every {self._every} synchronised steps"
        if self.average_checks:
            head += f" ({self.average_checks} after LocalSGD averages)"
        if self.differences:
            return f"{head}; the replicas differed at {len(self.differences)} (consistency.action='warn')"
        return f"{head}; the replicas agreed at each" if self.checks else head

    def _difference(self, step: Any, rows: list[list[int]]) -> str | None:
        names = [f"parameter {name!r}" for name, _ in self._named_parameters]
        names += [f"buffer {name!r}" for name in self._buffer_names]
        if self._optimizers is not None:
            names += [f"optimizer state of parameter {name!r}" for name, _ in self._named_parameters]
        buffers = range(len(self._named_parameters), len(self._named_parameters) + len(self._buffer_names))
        found = compare(self._ranks, rows, names, set(buffers))
        if found is None:
            return None
        agreed = "this is the first check" if self.agreed_at is None else f"they last agreed at step {self.agreed_at}"
        averaged = isinstance(step, _AfterAverage)
        where = f"after the LocalSGD average at optimizer step {step}" if averaged else f"at synchronised step {step}"
        return (
            f"replica consistency: {where} the replicas differ: {found}; {agreed} "
            f"(consistency.every_n_steps={self._every})."
        )

    def _optimizer_states(self) -> torch.Tensor:
        """Per parameter, one fingerprint of its state in every optimizer that steps it."""
        optimizers = self._optimizers() if self._optimizers is not None else []
        combined = []
        for _, param in self._named_parameters:
            total = torch.zeros((), dtype=torch.int64, device=self._device)
            for optimizer in optimizers:
                state = optimizer.state.get(param, {})
                for position, key in enumerate(sorted(state, key=str)):
                    total = total + (2 * position + 1) * _value_checksum(state[key], self._device)
            combined.append(total)
        return torch.stack(combined) if combined else _zeros(0, self._device)


def compare(ranks: Sequence[int], rows: Sequence[Sequence[int]], names: Sequence[str], buffers: set[int]) -> str | None:
    """What differs between the ranks' fingerprints, or None when the compared ranks agree.

    ``rows``: one per rank of ``ranks``: [compared, with buffers, fingerprint per tensor of
    ``names``]; the tensors at ``buffers`` count only when every compared rank fingerprinted them.
    The reference is the copy most ranks hold (on a tie, the lowest rank's); the answer names the
    ranks holding another, and the first tensor, in ``names``' order, where the first of them differs.
    """
    compared = [(rank, row) for rank, row in zip(ranks, rows) if row[0]]
    if len(compared) < 2:
        return None
    with_buffers = all(row[1] for _, row in compared)
    kept = [i for i in range(len(names)) if with_buffers or i not in buffers]
    copies = {rank: tuple(row[2 + i] for i in kept) for rank, row in compared}
    counts = Counter(copies.values())
    if len(counts) == 1:
        return None
    reference = max(counts, key=lambda copy: (counts[copy], -min(r for r, c in copies.items() if c == copy)))
    holders = [rank for rank, copy in copies.items() if copy == reference]
    differing = [rank for rank, copy in copies.items() if copy != reference]
    first_rank = differing[0]
    positions = [k for k, (a, b) in enumerate(zip(copies[first_rank], reference)) if a != b]
    if len(holders) > len(compared) / 2:
        majority = f"rank{'s' * (len(holders) > 1)} {_listed(holders)}, the reference"
    else:
        majority = f"rank {holders[0]}, taken as the reference (no majority among {len(compared)} ranks)"
    return (
        f"rank{'s' * (len(differing) > 1)} {_listed(differing)} hold{'s' * (len(differing) == 1)} other weights "
        f"than {majority}. First differing: {names[kept[positions[0]]]} ({len(positions)} of {len(kept)} tensors "
        f"differ on rank {first_rank})"
    )


_MISSING = torch.zeros(0)  # a buffer the module no longer has: fingerprint 0


def _zeros(count: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(count, dtype=torch.int64, device=device)


def _value_checksum(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return checksum(value).to(device)
    if isinstance(value, (int, float, bool)):
        (bits,) = struct.unpack("<q", struct.pack("<d", float(value)))
        return torch.tensor(bits, dtype=torch.int64, device=device)
    return torch.zeros((), dtype=torch.int64, device=device)


def _what(message: str) -> str:
    """What differs, without the step it was found at."""
    return message.split(" the replicas differ: ", 1)[-1]


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:-1])) + (" and " if len(ranks) > 1 else "") + str(ranks[-1])
