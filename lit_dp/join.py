"""Uneven inputs: torch's ``Join`` contract for ``lit_dp.DataParallel``.

A rank that runs out of batches first would leave its peers waiting in an all-reduce forever.
With ``torch.distributed.algorithms.join.Join`` (or ``DataParallel.join()``, as on DDP)::

    model = lit_dp.DataParallel(net)
    with model.join():                      # or Join([model], divide_by_initial_world_size=False)
        for inputs, targets in my_shard:    # any length, even 0
            loss_fn(model(inputs), targets).backward()
            optimizer.step(); optimizer.zero_grad()
    # every rank gets here, with the same parameters and buffers

How it works. Each synchronising forward tells the context that this rank is still in
(``notify``: torch's all-reduce of ones, which a joined rank matches with zeros and so learns
how many are still in). A rank that left its loop runs ``DataParallelJoinHook.main_hook`` once
per step the others still take: a ``SHADOW`` step plan (``lit_dp.gradients.plan``) makes the
reducer issue exactly that step's collectives (same buckets, same order, through the
communication hook if one is registered, zeros for gradients, flags that count it as neither
using nor missing a parameter, the step counted for the observers: the bucket-size autotuner
and the hang watchdog follow the same schedule). When a ``lit_dp.LocalSGD`` drives the model,
a small all-reduce after the notification (the step's plan) says whether the step synchronises
gradients or runs LocalSGD's collectives, and which fragment it syncs, which the joined rank then
shadows too. Once all have joined,
``post_hook`` agrees on an authoritative rank (the highest of the last to join, as DDP does)
and broadcasts its parameters, buffers (unless ``broadcast_buffers=False``) and LocalSGD
schedule. With ``broadcast_buffers``, a synchronising forward of the ranks still in broadcasts
the buffers of the highest of them (as DDP chooses it); a joined rank matches that broadcast
(``DataParallel.shadow_buffer_broadcast``) before the step's gradient collectives.

Divisor: ``divide_by_initial_world_size=True`` (default) divides by the world size, so every
sample weighs the same; ``False`` divides by the ranks still in. As in torch DDP, a
communication hook divides by itself (torch's hooks by the group's size).

``throw_on_early_termination=True``: instead of shadowing, every rank raises at the first step
a rank misses. The ranks still in name the ranks that ran out and the step (they find out who
through the rendezvous store); a rank that ran out raises torch's own error, or, under
``DataParallel.join()``, one naming its step.

Limits, as in torch: collectives the join cannot see (``SyncBatchNorm``, the user's own
``all_reduce``) must not run after a rank has joined; use ``throw_on_early_termination``.
"""

from __future__ import annotations

import time
import weakref
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig

import lit_dp.gradients.group as groups
from lit_dp.fault_tolerance.replica_group import JOIN_REFUSED
from lit_dp.gradients.broadcast import synced_buffers, synced_parameters
from lit_dp.gradients.coalesced import broadcast_coalesced
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.reducer import Reducer
from lit_dp.gradients.waiting import Waiter
from lit_dp.job.store import group_store_prefix, rendezvous_store
from lit_dp.observability.watchdog import HangWatchdog

# The plan's slots: this step synchronises gradients / agrees LocalSGD's first loss / syncs LocalSGD
# fragment n - 1 (0: none). Reduced with MAX: the ranks still in send the same plan, joined ranks zeros.
_GRADIENTS, _AGREE_FIRST_LOSS, _SYNC_FRAGMENT = range(3)
_WHO_RAN_OUT_SECONDS = 30.0
_POLL_SECONDS = 0.02


class JoinState:
    """What one ``DataParallel`` knows of the Join context it is in, changed only by its own methods:
    the context's hook enters it, each notification and shadowed step counts one."""

    def __init__(self) -> None:
        self.divide_by_initial_world_size = True
        self.steps = 0  # notifications sent by this rank, i.e. steps it took inside the context
        self.shadowed = 0  # steps shadowed after joining
        self.context = 0  # which Join context of the job this is, the same on every rank (store keys)
        self._pending: Any = None  # the last LocalSGD step plan this rank sent
        self._local_sgd: weakref.ref[DrivingLocalSGD] | None = None  # driven_by

    def __getstate__(self) -> dict[str, Any]:
        # A pickled or copied model is in no context and driven by no LocalSGD (neither travels).
        return {**self.__dict__, "_pending": None, "_local_sgd": None}

    def driven_by(self, local_sgd: DrivingLocalSGD) -> None:
        """``local_sgd`` (a ``lit_dp.LocalSGD``) drives the model: under Join, a rank that ran out
        shadows its collectives too, and adopts its schedule at the end. Held weakly (it holds the model)."""
        self._local_sgd = weakref.ref(local_sgd)

    @property
    def local_sgd(self) -> DrivingLocalSGD | None:
        """The LocalSGD whose collectives the model's Join steps carry (``driven_by``), if any."""
        return self._local_sgd() if self._local_sgd is not None else None

    def enter(self, divide_by_initial_world_size: bool, context: int | None) -> None:
        """A new context begins: its divisor, and its number when the rendezvous store counts contexts."""
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.steps = self.shadowed = 0
        if context is not None:
            self.context = context

    def count_step(self, pending_plan: Any = None) -> None:
        """One step notified; ``pending_plan``: its LocalSGD plan's all-reduce, never read here (the
        joined ranks read it) but kept until the next step, as torch keeps its works."""
        self.steps += 1
        self._pending = pending_plan

    def count_shadowed(self) -> None:
        self.shadowed += 1


class DrivingLocalSGD(Protocol):
    """What Join asks of the ``lit_dp.LocalSGD`` that drives a model (``JoinState.driven_by``).
    Declared here, since ``lit_dp.local_sgd`` imports this module."""

    def shadow_step(self, agree_first: bool, fragment: int | None) -> None: ...
    def adopt_schedule_of(self, src: int) -> None: ...


class JoinableModel(Protocol):
    """What Join reads of the ``lit_dp.DataParallel`` it serves. Declared here, since that class
    imports this module: the model satisfies it, and these are all the ways Join reaches into it."""

    _join_config: _JoinConfig  # torch's Join sets it on each of its joinables
    module: nn.Module
    parameters_to_ignore: set[str]
    join_state: JoinState

    @property
    def reducer(self) -> Reducer | None: ...
    @property
    def sharding_stage(self) -> int | None: ...
    @property
    def broadcast_buffers(self) -> bool: ...
    @property
    def waiter(self) -> Waiter: ...
    @property
    def watchdog(self) -> HangWatchdog | None: ...
    @property
    def join_device(self) -> torch.device: ...
    @property
    def join_process_group(self) -> dist.ProcessGroup: ...
    def step_plan(self, participation: Participation) -> StepPlan: ...
    def shadow_buffer_broadcast(self) -> None: ...


def active(model: JoinableModel) -> bool:
    """Whether ``model`` is inside an enabled Join context, as the joinable that communicates."""
    config = model._join_config
    return config.enable and config.is_first_joinable


def notify(model: JoinableModel, local_sgd_plan: tuple[bool, int | None] | None = None) -> int:
    """Tell the Join context this rank is still in, before one step's collectives; returns the step's divisor.

    ``local_sgd_plan`` (agree on the first loss, the fragment synced or None): the step is LocalSGD's; otherwise it
    synchronises gradients. The divisor is the group's size, or with
    ``divide_by_initial_world_size=False`` the ranks still in. A no-op outside a Join context.
    torch's ``notify_join_context`` is reproduced (same two collectives) rather than called,
    because its early-termination check drops the count that names who ran out.
    """
    group = model.join_process_group
    config = model._join_config
    if not active(model):
        return group.size()
    state = model.join_state
    assert model.reducer is not None, "a DataParallel without a reducer is not joinable"
    device, waiter = model.join_device, model.waiter
    still_in = torch.ones(1, device=device)
    count_work = dist.all_reduce(still_in, group=group, async_op=True)
    if config.throw_on_early_termination:
        ran_out = torch.zeros(1, device=device)
        waiter.wait(dist.all_reduce(ran_out, group=group, async_op=True), "Join's early-termination check")
        if ran_out.item():
            waiter.wait(count_work, "Join's count of the ranks still in")
            raise RuntimeError(_early_termination_message(model, int(still_in.item())))
    pending_plan = None
    if state.local_sgd is not None:
        plan = torch.zeros(3, device=device)
        plan[_GRADIENTS] = float(local_sgd_plan is None)
        if local_sgd_plan is not None:
            agree_first, fragment = local_sgd_plan
            plan[_AGREE_FIRST_LOSS] = float(agree_first)
            plan[_SYNC_FRAGMENT] = 0.0 if fragment is None else fragment + 1.0
        pending_plan = dist.all_reduce(plan, op=dist.ReduceOp.MAX, group=group, async_op=True)
    state.count_step(pending_plan)
    if state.divide_by_initial_world_size:
        return dist.get_world_size(group)
    # The ranks still in, from the count just exchanged (torch DDP waits for it too).
    waiter.wait(count_work, "Join's count of the ranks still in")
    return int(still_in.item())


class DataParallelJoinHook(JoinHook):
    """``DataParallel``'s join hook: shadow the others' steps, then adopt the authoritative model."""

    def __init__(self, model: JoinableModel, divide_by_initial_world_size: bool = True) -> None:
        if model.reducer is None:
            raise ValueError(
                "Join needs a DataParallel that synchronises gradients: this one has no reducer "
                "(no process group, or no trainable parameters)."
            )
        if model.sharding_stage is not None:
            raise ValueError(
                f"Join with sharding_stage={model.sharding_stage} is invalid: after each step the sharded optimizer "
                "gathers the updated parameters from their owners, collectives a rank that left its loop does not "
                "issue. Under the Trainer, uneven_inputs=True works with sharding (every rank keeps stepping)."
            )
        self._model = model
        context = None
        store = rendezvous_store()
        if store is not None:
            # Every rank enters each Join context once: the n-th of the job gets the same number everywhere.
            group = model.join_process_group
            contexts = f"{group_store_prefix('join', group)}/contexts"
            context = (store.add(contexts, 1) - 1) // dist.get_world_size(group)
        model.join_state.enter(divide_by_initial_world_size, context)

    def main_hook(self) -> None:
        """Issue the collectives of one step of the ranks still in."""
        model = self._model
        reducer, local_sgd = model.reducer, model.join_state.local_sgd
        assert reducer is not None
        model.join_state.count_shadowed()
        watchdog = model.watchdog
        if watchdog is not None:
            watchdog.untimed_wait_ended()
        gradients, agree_first, fragment = True, False, None
        if local_sgd is not None:
            plan = torch.zeros(3, device=model.join_device)
            work = dist.all_reduce(plan, op=dist.ReduceOp.MAX, group=reducer.group, async_op=True)
            model.waiter.wait(work, "Join's step plan")
            gradients, agree_first = bool(plan[_GRADIENTS]), bool(plan[_AGREE_FIRST_LOSS])
            fragment = int(plan[_SYNC_FRAGMENT]) - 1 if plan[_SYNC_FRAGMENT] else None
        if gradients:
            model.shadow_buffer_broadcast()  # the forward's, when the ranks still in broadcast buffers
            reducer.synchronise_without_backward(model.step_plan(Participation.SHADOW))
        if local_sgd is not None and (agree_first or fragment is not None):
            local_sgd.shadow_step(agree_first, fragment)
        if watchdog is not None:
            # torch's Join now all-reduces the count of the ranks still in: a wait the
            # watchdog cannot put a deadline on, so its thread watches it.
            watchdog.untimed_wait_started("the next step of the ranks still in (torch's Join loop)")

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters, buffers and LocalSGD schedule of the authoritative rank."""
        model = self._model
        reducer = model.reducer
        assert reducer is not None
        if model.watchdog is not None:
            model.watchdog.untimed_wait_ended()
        group = reducer.group
        candidate = torch.tensor([group.rank() if is_last_joiner else -1], device=model.join_device)
        model.waiter.wait(
            dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=group, async_op=True), "Join's authoritative rank"
        )
        authoritative = int(candidate.item())
        # Parameters, and buffers unless broadcast_buffers=False keeps them local (as DDP's join does).
        ignore = model.parameters_to_ignore
        tensors = [p.data for _, p in synced_parameters(model.module, ignore)]
        if model.broadcast_buffers:
            tensors += [buffer for _, buffer in synced_buffers(model.module, ignore)]
        broadcast_coalesced(tensors, group, authoritative, model.waiter, "Join's final broadcast of the model")
        if model.join_state.local_sgd is not None:
            model.join_state.local_sgd.adopt_schedule_of(dist.get_global_rank(group, authoritative))


class DataParallelJoin(Join):
    """torch's ``Join`` for one ``DataParallel``, whose early-termination error on the rank that
    ran out names its step (torch's names the rank only)."""

    def __init__(self, model: JoinableModel, **kwargs: Any) -> None:
        super().__init__([model], **kwargs)
        self._model = model

    def __exit__(
        self, type: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        watchdog = self._model.watchdog
        if watchdog is not None and type is None and self._enable:
            # torch's loop starts with its count of the ranks still in: watched from the first wait on.
            watchdog.untimed_wait_started("the next step of the ranks still in (torch's Join loop)")
        try:
            super().__exit__(type, value, traceback)
        except RuntimeError as error:
            if type is not None or not self._throw_on_early_termination or "exhausted all inputs" not in str(error):
                raise
            steps = self._model.join_state.steps
            raise RuntimeError(
                f"lit_dp Join (throw_on_early_termination=True): rank {dist.get_rank()} ran out of inputs after "
                f"{steps} synchronised step(s) inside the context; the ranks still in raise at their step {steps} "
                "(counted from 0)."
            ) from error
        finally:
            if watchdog is not None:
                watchdog.untimed_wait_ended()


def _early_termination_message(model: JoinableModel, still_in: int) -> str:
    """Which ranks ran out, found through the rendezvous store: the ranks still in sign in and
    the missing ones are those that left (the count tells how many sign-ins to wait for)."""
    state = model.join_state
    group = model.join_process_group
    world = dist.get_world_size(group)
    step = state.steps
    ran_out = _ranks_that_ran_out(state.context, group, still_in)
    names = f"rank(s) {ran_out}" if ran_out is not None else f"{world - still_in} rank(s)"
    return (
        f"lit_dp Join (throw_on_early_termination=True): {names} ran out of inputs; the {still_in} rank(s) still "
        f"in raise at their synchronised step {step} inside the context (counted from 0)."
    )


def _ranks_that_ran_out(context: int, group: dist.ProcessGroup, still_in: int) -> list[int] | None:
    store = rendezvous_store()
    if store is None:
        return None
    prefix = f"{group_store_prefix('join', group)}/{context}/still_in"
    rank = dist.get_rank()
    store.set(f"{prefix}/in/{rank}", "1")
    store.add(f"{prefix}/count", 1)
    deadline = time.monotonic() + _WHO_RAN_OUT_SECONDS
    while store.add(f"{prefix}/count", 0) < still_in and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    ranks = dist.get_process_group_ranks(group)
    return [r for r in ranks if not store.check([f"{prefix}/in/{r}"])]


class JoinMethods:
    """``DataParallel``'s side of torch's ``Joinable`` (a mixin): ``join()``, ``join_hook``, the device
    and the group of the context's own collectives."""

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> DataParallelJoin:
        """Train on uneven inputs inside this context, as with torch DDP's ``join()`` (see ``lit_dp.join``).

        Ranks that run out of inputs shadow the others' synchronised steps with zeros until all
        have; then every rank holds the parameters and buffers of the last rank to join.
        Gradients are divided by the world size, or with ``divide_by_initial_world_size=False``
        by the ranks still in. ``throw_on_early_termination``: every rank raises instead, at
        the first step a rank misses, naming it.
        """
        return DataParallelJoin(
            self,
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> DataParallelJoinHook:
        """The hook ``torch.distributed.algorithms.join.Join`` runs on a rank that has run out of inputs."""
        if self._manager is not None:
            raise ValueError(JOIN_REFUSED)
        if self._reducer is not None and not groups.is_registered(self._reducer.group):
            # torch's Join reads this rank through dist.get_rank(group), as under DDP, whose join()
            # fails on such a group with "Group ... is not registered".
            raise ValueError(
                f"join() on a process group written in Python ({type(self._reducer.group).__name__}) is not "
                "supported: torch's Join finds the ranks through torch's group bookkeeping, as DDP's join() does; "
                "expected a group made by init_process_group or new_group."
            )
        return DataParallelJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Where the Join context's own all-reduces run: the parameters' device."""
        return self.device if self._reducer is not None else torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group whose ranks join: the reducer's."""
        return self._reducer.group if self._reducer is not None else dist.group.WORLD
