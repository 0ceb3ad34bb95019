"""The bucketed gradient reducer: all-reduce gradients while backward still runs.

One synchronised step:

1. ``DataParallel`` decides how this rank takes part and hands the reducer one ``StepPlan``
   (``lit_dp.gradients.plan``): ``prepare_for_backward(plan, outputs)`` arms it for a backward
   (with ``find_unused_parameters`` it also walks the autograd graph from the outputs to find the
   parameters this backward will not reach); ``synchronise_without_backward(plan)`` issues the
   step's collectives on a rank that has no batch (Join's shadow, the Trainer's replay).
2. A post-accumulate-grad hook per parameter (it fires once per backward, also for a tied
   parameter used twice) marks the parameter ready. Buckets are launched strictly in their
   fixed order, each as soon as it and every bucket before it are complete, so all ranks issue
   the same collectives in the same sequence whatever order their gradients arrive in.
3. A bucket launch divides its gradients by the plan's divisor and starts asynchronous
   all-reduces on its ring: small gradients are copied into the bucket's flat buffer (or found
   there already, as views) and travel in one collective; each large one
   (``in_place_min_bytes``) is all-reduced where autograd left it, which saves two copies and
   the buffer's memory.
4. A callback queued on the autograd engine runs when backward ends: it launches whatever
   is left (parameters that got no gradient contribute zeros), waits for every bucket, writes
   the averages back into ``.grad`` and, on the first step, rebuilds the buckets in the
   observed gradient-ready order (rank 0's order, broadcast, so all ranks agree).

Every bucket carries one flag per parameter, all-reduced with its gradients
(``lit_dp.gradients.flags``): with ``find_unused_parameters`` it marks "used here" (a sum of 0
means no rank used it, so its ``.grad`` is left untouched); without, "missing here" (a non-zero
sum means some rank got no gradient, and every rank raises the same ``UnusedParametersError``).
The flags cost no extra collective and compare only against zero, which is exact in every dtype.

State: eight fields change after construction. The layout (rebuilt as a whole, between steps)
and the layout waiting to be applied at the next step's start; what accumulated since the last
synchronisation; the armed step's progress (one ``_ArmedStep``, None between steps, which also
counts ``static_graph``'s hooks in its backward); the ready order while it is being learnt; the
step counter; the communication hook (registered once, before the first backward); and
``static_graph``'s ``_StaticGraph`` (set before the first step, it learns in the first
backward how many gradients each parameter gets). Besides them, a queue of earlier steps' flags
not read yet (CUDA). Only the reducer's own methods set them: observers are told
(``lit_dp.gradients.events``) and ask for bucket limits through ``request_bucket_limits``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

import lit_dp.gradients.group as groups
from lit_dp.gradients.events import BucketLaunch, ReducerObserver
from lit_dp.gradients.hooks import CommHook
from lit_dp.gradients.layout import Bucket, BucketFactory, BucketLayout, launch_order
from lit_dp.gradients.plan import FlagMeaning, StepPlan
from lit_dp.gradients.unused import PendingFlags, UnusedParametersError, reached_parameters, tensors_in, unused_members
from lit_dp.gradients.waiting import Waiter
from lit_dp.options.warning import LitDPWarning


class _ArmedStep:
    """The progress of the step being synchronised: created when it is armed, dropped when it ends."""

    __slots__ = (
        "plan",
        "step",
        "ready",
        "pending",
        "next_bucket",
        "started",
        "in_backward",
        "queued",
        "unreached",
        "partial",
        "hook_counts",
        "host_work_s",
        "ready_s",
    )

    def __init__(self, plan: StepPlan, step: int, layout: BucketLayout, count: int) -> None:
        self.plan = plan
        self.step = step
        self.ready = bytearray(count)  # marked ready in this backward
        self.pending = [len(bucket.indices) for bucket in layout.buckets]  # gradients still awaited per bucket
        self.next_bucket = 0  # the next bucket to launch
        self.started = False  # the first gradient arrived (or there is no backward)
        self.in_backward = False  # launches happen while backward still runs (every member present)
        self.queued = False  # the end-of-backward callback is queued on the autograd engine
        self.unreached: list[int] = []  # parameters this backward cannot reach (find_unused_parameters)
        self.partial: set[int] = set()  # buckets holding such parameters
        self.hook_counts: list[int] = []  # static_graph: hooks fired per parameter in this backward
        self.host_work_s = 0.0  # with ``times_host_work``: arming it and its hooks, launches left out
        self.ready_s: list[float] = []  # with ``times_host_work``: each parameter's last hook, 0 if none


class _StaticGraph:
    """What ``static_graph`` learns in its first synchronised backward and holds from then on."""

    __slots__ = ("expected_hooks",)

    def __init__(self) -> None:
        self.expected_hooks: list[int] | None = None  # hooks per parameter and backward, from the first


class Reducer:
    """Averages the gradients of ``params`` over the ranks of ``rings[0]`` in buckets.

    Args:
        params: trainable parameters, deduplicated, in forward (registration) order.
        names: one name per parameter, for error messages.
        rings: communicators; bucket ``k`` is reduced on ``rings[k % len(rings)]``. All rings
            must span the same ranks.
        bucket_bytes / last_bucket_bytes: bucket size limits; the last bucket reduced (the
            first in forward order) uses ``last_bucket_bytes``.
        sparse: one flag per parameter: its gradient is sparse.
        gradient_as_bucket_view: make the ``.grad`` of flat (not in-place) members views into
            the bucket buffers, so they are not stored twice.
        owners: sharding stage 2: the owning rank (in ``rings[0]``) of each parameter; dense
            buckets then reduce each gradient to its owner only (``lit_dp.gradients.scatter``).
        static_graph: every backward fires the same hooks as the first (torch DDP's static graph):
            a parameter's hook may fire several times per backward (reentrant checkpointing), and
            the parameters without a gradient are known from the first step (``_count_static_hook``).
        waiter: how every wait of this reducer's collectives is made (its owner's policy: a
            deadline under the hang watchdog).
        rebuild_buckets: rebuild the buckets in rank 0's gradient-ready order after the first
            step (below); False keeps the registration order, which every replica derives alone
            (torchft's replicas join later and could not learn rank 0's order).

    Observers (``add_observer``, ``lit_dp.gradients.events``) are told of each step's moments.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        rings: Sequence[dist.ProcessGroup],
        *,
        bucket_bytes: int,
        last_bucket_bytes: int,
        sparse: Sequence[bool],
        gradient_as_bucket_view: bool = False,
        owners: Sequence[int] | None = None,
        static_graph: bool = False,
        waiter: Waiter,
        rebuild_buckets: bool = True,
    ) -> None:
        if not params:
            raise ValueError("Reducer needs at least one trainable parameter.")
        self._params = list(params)
        self._names = list(names)
        self._group = rings[0]
        self._world_size = self._group.size()
        self._factory = BucketFactory(
            params=self._params,
            sparse=list(sparse),
            owners=None if owners is None else list(owners),
            rings=list(rings),
            as_view=gradient_as_bucket_view,
            waiter=waiter,
        )
        self._nothing_used = bytearray(len(self._params))  # what a SHADOW step sends: zeros
        self._comm_hook: CommHook | None = None
        self._observers: list[ReducerObserver] = []
        # Set by the communication profile: its forecast takes this work out of a LocalSGD local step.
        self.times_host_work = False
        # -- mutable state ------------------------------------------------------------------
        self._layout = self._factory.build(list(range(len(self._params))), (last_bucket_bytes, bucket_bytes), None)
        self._used = bytearray(len(self._params))  # a gradient was accumulated since the last synchronisation
        self._armed: _ArmedStep | None = None
        self._order: list[int] | None = []  # the ready order being learnt; None once agreed
        self._rebuild_buckets = rebuild_buckets
        self._next_layout: tuple[list[int], tuple[int, int]] | None = None  # applied at the next step's start
        self._step = -1  # the synchronised step armed last
        self._pending_flags: list[PendingFlags] = []  # flags of earlier steps not read yet (CUDA)
        self._static = _StaticGraph() if static_graph else None
        self._last_end_s = 0.0  # with ``times_host_work``: the host work of the last step's end (host_work_ms)
        self._end_of_backward_hook = self._make_output_hook()
        handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)]
        weakref.finalize(self, _remove_hooks, handles)

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters it averages, in registration order (its indices)."""
        return list(self._params)

    @property
    def buckets(self) -> list[Bucket]:
        """The bucket objects of the current layout, in launch order."""
        return list(self._layout.buckets)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch (backward) order."""
        return [list(bucket.indices) for bucket in self._layout.buckets]

    @property
    def bucket_bytes(self) -> list[int]:
        return [bucket.nbytes for bucket in self._layout.buckets]

    @property
    def launched_buckets(self) -> int:
        """How many buckets of the step being synchronised (or of the last one) have started their collectives."""
        if self._armed is not None:
            return self._armed.next_bucket
        return len(self._layout.buckets) if self._step >= 0 else 0

    @property
    def step(self) -> int:
        """The synchronised step armed last, counted from 0 (-1 before the first)."""
        return self._step

    @property
    def group(self) -> dist.ProcessGroup:
        """The ranks whose gradients are averaged (the first ring)."""
        return self._group

    @property
    def waiter(self) -> Waiter:
        """The wait policy this reducer was given (read by observers reporting what it waits for)."""
        return self._factory.waiter

    def host_work_ms(self) -> float:
        """The main thread's time in the reducer's own work for one synchronised step, less its bucket
        launches (which the communication profile times on their own), its waits and its write-back:
        arming the step being synchronised and its gradients' hooks so far, with their observers'
        ``step_started`` and ``bucket_ready``, and the end of the synchronised step before it, after
        the write-back (the ready order, the observers' ``step_ended``), which runs after anything
        could read it. A step that keeps its gradients local (LocalSGD's local phase) does none of it.
        0 outside a step, or unless ``times_host_work`` was set."""
        armed = self._armed
        return 0.0 if armed is None else (armed.host_work_s + self._last_end_s) * 1e3

    def gradients_ready_ms(self) -> tuple[float | None, ...] | None:
        """For the step being synchronised, each parameter's gradient's ready moment (its last hook, in
        registration order) in ms after the first, None for one without a gradient yet; None outside a
        step, or unless ``times_host_work`` was set before the step."""
        armed = self._armed
        if armed is None or not armed.ready_s:
            return None
        moments = [moment for moment in armed.ready_s if moment > 0.0]
        if not moments:
            return None
        first = min(moments)
        return tuple((moment - first) * 1e3 if moment > 0.0 else None for moment in armed.ready_s)

    def add_observer(self, observer: ReducerObserver) -> None:
        """Tell ``observer`` of every step's moments from now on (see ``lit_dp.gradients.events``)."""
        self._observers.append(observer)

    def request_bucket_limits(self, bucket_bytes: int, last_bucket_bytes: int) -> None:
        """Rebuild the buckets with these limits at the start of the next step, before it is armed.

        Every rank must ask at the same step with the same limits, or the ranks' buckets stop
        pairing up (the autotuner guarantees both). Asked from ``step_started``, the change
        applies to the step starting.
        """
        self._next_layout = (self._forward_order(), (last_bucket_bytes, bucket_bytes))

    def reduce_on(self, rings: Sequence[dist.ProcessGroup]) -> None:
        """Average over the ranks of ``rings`` from the next step on: the buckets are cut again, alike, for
        them at its start (as after ``request_bucket_limits``). Every rank of the new rings switches at the
        same step: a model under torchft reduces inside its replica group in LocalSGD's local phase and
        across the groups otherwise (``DataParallel.keep_gradients_local``)."""
        if list(rings) == list(self._factory.rings):
            return
        self._factory = dataclasses.replace(self._factory, rings=list(rings))
        self._group = rings[0]
        self._world_size = self._group.size()
        if self._next_layout is None:
            self._next_layout = (self._forward_order(), self._layout.limits)

    def partition(self, bucket_bytes: int, last_bucket_bytes: int) -> list[list[int]]:
        """The parameter indices per bucket, in launch order, that these limits would give now."""
        factory = self._factory
        return launch_order(factory.params, factory.sparse, self._forward_order(), (last_bucket_bytes, bucket_bytes))

    def set_static_graph(self) -> None:
        """Turn ``static_graph`` on, before the first synchronised step (torch DDP's ``_set_static_graph``)."""
        if self._step >= 0:
            raise RuntimeError("lit_dp reducer: static_graph should be set before training loop starts.")
        if self._static is None:
            self._static = _StaticGraph()

    def register_comm_hook(self, comm_hook: CommHook) -> None:
        """Reduce dense buckets through ``comm_hook`` (see ``lit_dp.gradients.hooks``); once, before the first backward."""
        if self._comm_hook is not None:
            raise RuntimeError(
                f"lit_dp: a communication hook ({self._comm_hook.name}) is already registered; "
                "register_comm_hook can only be called once."
            )
        if self._order is None or (self._armed is not None and self._armed.started):
            raise RuntimeError(
                f"lit_dp: register_comm_hook({comm_hook.name}) must be called before the first synchronised backward."
            )
        if self._factory.owners is not None:
            raise ValueError(
                f"lit_dp: register_comm_hook({comm_hook.name}) with sharding_stage=2 is invalid: a hook returns the "
                "whole bucket's average, stage 2 reduces each gradient to its owner only."
            )
        self._comm_hook = comm_hook
        # The buckets were built without the hook (flags in the buffer, large gradients in place).
        self._rebuild(list(range(len(self._params))), self._layout.limits)

    def prepare_for_backward(self, plan: StepPlan, outputs: object) -> None:
        """Arm the reducer for the next backward (a ``SYNC`` plan); called after the forward that decided it.

        The end of that backward is the end of the backward through ``outputs``: a hook on each
        output tensor queues the end-of-backward callback from there, on that backward's own
        graph task. A parameter's first gradient could arrive inside a nested backward (reentrant
        activation checkpointing runs one per checkpointed segment), whose end is not the step's.
        """
        started = time.perf_counter() if self.times_host_work else None
        armed = self._arm(plan)
        if started is not None:
            armed.ready_s = [0.0] * len(self._params)
        for tensor in tensors_in(outputs):
            if tensor.requires_grad:
                tensor.register_hook(self._end_of_backward_hook)
        if self._static is not None:
            expected = self._static.expected_hooks
            if expected is not None:  # no graph walk: the first step found them
                armed.unreached = [i for i, count in enumerate(expected) if count == 0]
                armed.partial = {self._layout.bucket_of[i] for i in armed.unreached}
        elif plan.flags is FlagMeaning.USED:
            reached = reached_parameters(outputs)
            armed.unreached = [i for i, p in enumerate(self._params) if id(p) not in reached]
            armed.partial = {self._layout.bucket_of[i] for i in armed.unreached}
        if started is not None:
            armed.host_work_s += time.perf_counter() - started

    def synchronise_without_backward(self, plan: StepPlan) -> None:
        """The collectives of one synchronised step, without a backward of this rank's (``REPLAY``, ``SHADOW``).

        Counted and announced like a real step; what the plan says decides what is sent (what
        this rank accumulated, or zeros) and whether the averages land in ``.grad``.
        """
        armed = self._arm(plan)
        armed.started = True
        for observer in self._observers:
            observer.backward_started(armed.step)
        self._finalize_backward()

    def _arm(self, plan: StepPlan) -> _ArmedStep:
        self._check_pending_flags()
        self._step += 1
        for observer in self._observers:
            observer.step_started(self._step, plan)
        if self._next_layout is not None:
            (order, limits), self._next_layout = self._next_layout, None
            self._rebuild(order, limits)
        if self._order is not None:
            self._order.clear()
        self._armed = _ArmedStep(plan, self._step, self._layout, len(self._params))
        if self._static is not None:
            self._armed.hook_counts = [0] * len(self._params)
        return self._armed

    def _make_hook(self, index: int):
        # A weak reference: the parameters outlive the reducer (the model is unwrapped after
        # training), and a strong one would keep every old reducer alive through its hooks.
        reducer_ref = weakref.ref(self)

        def hook(_param: torch.Tensor) -> None:
            reducer = reducer_ref()
            if reducer is None:
                return
            # Also the moment this gradient is ready (the profile's gradient_ready_ms).
            started = time.perf_counter() if reducer.times_host_work else None
            reducer._on_gradient_ready(index)
            armed = reducer._armed
            if started is not None and armed is not None:
                armed.host_work_s += time.perf_counter() - started
                if armed.ready_s:
                    armed.ready_s[index] = started

        return hook

    def _on_gradient_ready(self, index: int) -> None:
        # Runs once per parameter and backward: kept to index arithmetic (docs/architecture.md).
        self._used[index] = 1
        if self._factory.as_view:
            self._adopt_gradient(index)
        armed = self._armed
        if armed is None or (self._static is not None and not self._count_static_hook(armed, index)):
            return
        ready = armed.ready
        if ready[index]:
            raise RuntimeError(
                f"lit_dp reducer: parameter {self._names[index]!r} received its gradient twice in one backward "
                "(torch DDP: Expected to mark a variable ready only once.), as when a parameter is used in two "
                "segments of reentrant activation checkpointing: use checkpoint(..., use_reentrant=False), or "
                "static_graph=True as on torch DDP."
            )
        if not armed.started:
            armed.started = armed.in_backward = True
            self._queue_end_of_backward()  # without output hooks (outputs in another structure): here
            if self._params[index].grad.requires_grad:
                _warn_create_graph()
            for observer in self._observers:
                observer.backward_started(armed.step)
            for unreached in armed.unreached:
                ready[unreached] = 1
                self._mark_ready(armed, unreached)
        ready[index] = 1
        if self._order is not None:
            self._order.append(index)
        self._mark_ready(armed, index)

    def _count_static_hook(self, armed: _ArmedStep, index: int) -> bool:
        """``static_graph``: count the hook; whether ``index`` is now ready. The first synchronised
        step learns how many times each parameter's hook fires per backward (reentrant checkpointing
        fires it once per segment) and launches its buckets at the end of backward; later steps take
        a parameter as ready at its last expected gradient, as torch DDP's static graph does."""
        counts = armed.hook_counts
        counts[index] += 1
        expected_hooks = self._static.expected_hooks
        if expected_hooks is None:
            if not armed.started:
                armed.started = True
                self._queue_end_of_backward()
                for observer in self._observers:
                    observer.backward_started(armed.step)
            if counts[index] == 1 and self._order is not None:
                self._order.append(index)
            return False
        expected = expected_hooks[index]
        if counts[index] > expected:
            raise RuntimeError(
                f"lit_dp reducer (static_graph=True): parameter {self._names[index]!r} received {counts[index]} "
                f"gradients in one backward, {expected} in the first: the graph is not static. Construct without "
                "static_graph (with find_unused_parameters=True if parameters go unused)."
            )
        return counts[index] == expected

    def _make_output_hook(self):
        reducer_ref = weakref.ref(self)  # weak, as the parameters' hooks (_make_hook)

        def end_of_backward_through_outputs(_grad: torch.Tensor) -> None:
            reducer = reducer_ref()
            if reducer is not None:
                reducer._queue_end_of_backward()

        return end_of_backward_through_outputs

    def _queue_end_of_backward(self) -> None:
        armed = self._armed
        if armed is not None and not armed.queued:
            armed.queued = True
            Variable._execution_engine.queue_callback(self._finalize_backward)

    @torch.no_grad()
    def _adopt_gradient(self, index: int) -> None:
        """Move a fresh gradient into its bucket view at once, so it is not held twice."""
        view = self._layout.view_of[index]
        param = self._params[index]
        if view is not None and param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

    def _mark_ready(self, armed: _ArmedStep, index: int) -> None:
        bucket = self._layout.bucket_of[index]
        armed.pending[bucket] -= 1
        if armed.pending[bucket] == 0:
            for observer in self._observers:
                observer.bucket_ready(armed.step, bucket)
            if bucket == armed.next_bucket:
                self._launch_complete_buckets(armed)

    # Without grad mode: under `backward(create_graph=True)` gradients require grad themselves, and
    # copying them into the buckets must not record a graph (as in torch DDP, see _warn_create_graph).
    @torch.no_grad()
    def _launch_complete_buckets(self, armed: _ArmedStep) -> None:
        buckets, pending = self._layout.buckets, armed.pending
        used = self._used if armed.plan.sends_accumulated else self._nothing_used
        # Inside a gradient's hook, whose time is host work: the launches are not part of it.
        started = time.perf_counter() if self.times_host_work and armed.in_backward else None
        while armed.next_bucket < len(buckets) and pending[armed.next_bucket] == 0:
            position = armed.next_bucket
            if self._comm_hook is not None:
                self._comm_hook.settle()
            bucket = buckets[position]
            bucket.start(armed.plan, used, complete=armed.in_backward and position not in armed.partial)
            if self._observers:
                launch = BucketLaunch(armed.step, position, bucket.indices, bucket.sent_bytes(), bucket.futures())
                for observer in self._observers:
                    observer.bucket_launched(launch)
            armed.next_bucket += 1
        if started is not None:
            armed.host_work_s -= time.perf_counter() - started

    @torch.no_grad()
    def _finalize_backward(self) -> None:
        armed = self._armed
        assert armed is not None, "the end of a backward the reducer was not armed for"
        if not armed.started:
            if len(armed.unreached) < len(self._params):
                # A backward through the outputs that reached no parameter although they depend on
                # some (``torch.autograd.grad`` with respect to the inputs, a gradient penalty's):
                # not the step's backward, which follows.
                armed.queued = False
                return
            # Outputs that depend on no parameter here (find_unused_parameters): this rank's step.
            armed.started = True
            for observer in self._observers:
                observer.backward_started(armed.step)
        for observer in self._observers:
            observer.backward_ended(armed.step)
        armed.in_backward = False
        # Buckets still incomplete hold parameters without a gradient in this backward; they are
        # launched anyway (zeros) so every rank issues the same collectives and none hangs.
        armed.pending = [0] * len(armed.pending)
        self._launch_complete_buckets(armed)
        buckets = self._layout.buckets
        for position, bucket in enumerate(buckets):
            bucket.wait()
            for observer in self._observers:
                observer.bucket_waited(armed.step, position)
        used, self._used = self._used, bytearray(len(self._params))
        plan = armed.plan
        if not plan.has_backward:
            used = bytearray(b"\x01") * len(used)  # a rank without a backward misses no gradient
        if self._layout.alone:
            # One rank: the flags would say what `used` says, so it is read instead, on the host:
            # no device work, nothing to wait for (the buckets set no flags).
            skipped = self._check_alone(plan, used)
        elif plan.flags is FlagMeaning.USED:
            # Which parameters no rank used decides which .grad stay untouched: a host decision,
            # so the flags are read here (on CUDA the one synchronisation of such a step).
            skipped = unused_members(buckets, torch.cat([bucket.flags for bucket in buckets]).tolist())
        else:
            skipped = [()] * len(buckets)
            self._pending_flags.append(PendingFlags(buckets, used))
            self._check_pending_flags()  # at once where the flags are already on the host
        if not plan.writes_back:
            skipped = [range(len(bucket.indices)) for bucket in buckets]  # releases the buckets' results only
        for bucket, members in zip(buckets, skipped):
            bucket.write_back(self._factory.as_view, members)
        end_started = time.perf_counter() if self.times_host_work else None
        if self._order is not None:
            self._agree_on_ready_order(self._order)
        static = self._static
        if static is not None and static.expected_hooks is None and plan.has_backward:
            static.expected_hooks = armed.hook_counts
        self._armed = None
        for observer in self._observers:
            observer.step_ended(armed.step)
        if end_started is not None:
            self._last_end_s = time.perf_counter() - end_started

    def _check_alone(self, plan: StepPlan, used: bytearray) -> list[set[int]]:
        """The flags' verdict where they never leave this rank (``BucketLayout.alone``): per bucket, the
        members without a gradient, which keep their ``.grad`` (``find_unused_parameters``), or else
        ``UnusedParametersError`` at once if any is missing."""
        params = self._params
        absent = [i for i in range(len(params)) if not used[i] or params[i].grad is None] if 0 in used else []
        if plan.flags is FlagMeaning.MISSING and absent:
            raise UnusedParametersError(self._names, self._world_size, [(i, 1.0) for i in absent], used)
        bucket_of, skipped = self._layout.bucket_of, [set() for _ in self._layout.buckets]
        for index in absent:
            skipped[bucket_of[index]].add(self._layout.buckets[bucket_of[index]].indices.index(index))
        return skipped

    def _check_pending_flags(self) -> None:
        """Raise, on every rank, if some rank got no gradient for a parameter in an earlier backward.

        Without ``find_unused_parameters`` the flags only confirm what is expected, so on CUDA
        they are copied to pinned host memory without blocking and read at the next synchronised
        forward whose copy has finished: the next one, or, when the GPU runs more than a step
        behind the host, the one after, which waits for it (the GPU is then busy with work
        already queued, so waiting costs it nothing).
        """
        pending = self._pending_flags
        while pending and (pending[0].arrived() or len(pending) > 1):
            flags = pending.pop(0)
            missing = flags.missing()
            if missing:
                pending.clear()
                raise UnusedParametersError(self._names, self._world_size, missing, flags.used)

    def _agree_on_ready_order(self, observed: list[int]) -> None:
        """Adopt rank 0's observed ready order for the buckets (Paddle and DDP do the same).

        The buckets are rebuilt at the next synchronised forward, as in DDP: by then
        ``zero_grad`` has usually dropped the gradients, so with gradient views the old and new
        buffers are not alive together.
        """
        if not self._rebuild_buckets:
            self._order = None  # the registration order stays: nothing to agree on
            return
        seen = set(observed)
        # Parameters not seen (all, on a rank that joined before its first step) keep their place.
        order = observed + [i for i in reversed(self._forward_order()) if i not in seen]
        agreed = torch.tensor(order, dtype=torch.long, device=self._params[0].device)
        group = self._group
        work = dist.broadcast(agreed, group=group, group_src=0, async_op=True)
        groups.wait(self.waiter, work, group, "the broadcast of the agreed bucket order")
        limits = self._next_layout[1] if self._next_layout is not None else self._layout.limits
        self._next_layout = (list(reversed(agreed.tolist())), limits)
        self._order = None

    def _forward_order(self) -> list[int]:
        """The parameter order buckets are cut from: the one waiting to be applied, else the current layout's."""
        return list(self._next_layout[0]) if self._next_layout is not None else self._layout.forward_order()

    def _rebuild(self, forward_order: list[int], limits: tuple[int, int]) -> None:
        self._layout = BucketLayout([], [], [], limits)  # drop the old buffers before allocating new ones
        self._layout = self._factory.build(forward_order, limits, self._comm_hook)
        if self._factory.as_view:
            for index, param in enumerate(self._params):
                if param.grad is not None:
                    self._adopt_gradient(index)


def _warn_create_graph() -> None:
    warnings.warn(
        "lit_dp.DataParallel with backward(create_graph=True): the gradients are averaged as usual, but, as in "
        "torch DDP, the average is not differentiable: a second-order term computed from .grad sees no "
        "communication (backpropagation does not run through the all-reduce). Gradient penalties taken with "
        "torch.autograd.grad(..., create_graph=True) on inputs are unaffected.",
        LitDPWarning,
        stacklevel=2,
    )


def _remove_hooks(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
