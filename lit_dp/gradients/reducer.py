"""The bucketed gradient reducer: all-reduce gradients while backward still runs.

One synchronised iteration:

1. ``prepare_for_backward`` (called by the wrapper after a syncing forward) arms the reducer;
   with ``find_unused_parameters`` it also walks the autograd graph from the outputs to find the
   parameters this backward will not reach.
2. A post-accumulate-grad hook per parameter (it fires once per backward, also for a tied
   parameter used twice) marks the parameter ready. Buckets are launched strictly in their
   fixed order, each as soon as it and every bucket before it are complete, so all ranks issue
   the same collectives in the same sequence whatever order their gradients arrive in.
3. A bucket launch divides its gradients by the world size and starts asynchronous all-reduces
   on its ring: small gradients are copied into the bucket's flat buffer (or found there
   already, as views) and travel in one collective; each large one (``in_place_min_bytes``) is
   all-reduced where autograd left it, which saves two copies and the buffer's memory.
4. A callback queued on the autograd engine runs when backward ends: it launches whatever
   is left (parameters that got no gradient contribute zeros), waits for every bucket, writes
   the averages back into ``.grad`` and, on the first iteration, rebuilds the buckets in the
   observed gradient-ready order (rank 0's order, broadcast, so all ranks agree).

Every dense bucket carries one flag per parameter after its gradients, all-reduced with them:
with ``find_unused_parameters`` it marks "used here" (a sum of 0 means no rank used it, so its
``.grad`` is left untouched); without, it marks "missing here" (a non-zero sum means some rank
got no gradient, and every rank raises the same error). The flags cost no extra collective and
compare only against zero, which is exact in every dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from lit_dp.gradients.events import BucketLaunch, ReducerObserver
from lit_dp.gradients.hooks import CommHook
from lit_dp.gradients.layout import build_buckets, launch_order
from lit_dp.gradients.unused import PendingFlags, missing_gradients_message, reached_parameters, unused_members
from lit_dp.gradients.waiting import Waiter


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
        find_unused_parameters: tolerate parameters without a gradient (see module docstring).
        gradient_as_bucket_view: make the ``.grad`` of flat (not in-place) members views into
            the bucket buffers, so they are not stored twice.
        unused_parameters_message: opens the missing-gradient error in place of the generic
            hint (the Lightning and Fabric strategies give Lightning's own sentence): the error
            may surface in a forward (on CUDA, where flags are read a step late) or in
            backward, and reads the same.
        owners: sharding stage 2: the owning rank (in ``rings[0]``) of each parameter; dense
            buckets then reduce each gradient to its owner only (``lit_dp.gradients.scatter``).
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
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        unused_parameters_message: str | None = None,
        owners: Sequence[int] | None = None,
        rebuild_buckets: bool = True,
    ) -> None:
        if not params:
            raise ValueError("Reducer needs at least one trainable parameter.")
        self._params = list(params)
        self._names = list(names)
        self._rings = list(rings)
        self._sparse = list(sparse)
        self._limits = [last_bucket_bytes, bucket_bytes]
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        self._world_size = dist.get_world_size(self._rings[0])
        self.divisor = self._world_size  # what gradients are divided by (lit_dp.join: the ranks still in)
        count = len(self._params)
        self._used = bytearray(count)  # a gradient was accumulated since the last synchronisation
        self._nothing_used = bytearray(count)  # what a shadow step hands the buckets
        self._ready = bytearray(count)  # marked ready in the armed backward
        self._unreached: list[int] = []
        self._partial: set[int] = set()  # buckets holding parameters this backward cannot reach
        self._order: list[int] = []
        self._agreed_order: list[int] | None = None
        self._rebuilt = False
        self._rebuild_buckets = rebuild_buckets
        self._armed = False
        self._started = False
        self._next_bucket = 0
        self._pending: list[int] = []
        self._pending_flags: list[PendingFlags] = []
        self._comm_hook: CommHook | None = None
        self._unused_parameters_message = unused_parameters_message
        self._observers: list[ReducerObserver] = []
        self._step = -1  # the synchronised step armed last
        self._requested_limits: list[int] | None = None
        self._owners = None if owners is None else list(owners)
        self.waiter = Waiter()  # every wait of this reducer's collectives (the hang watchdog sets a deadline)
        self._shadowing = self._shadow_takes_step = False  # in shadow_step
        self._build_buckets(list(range(count)))
        handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)]
        weakref.finalize(self, _remove_hooks, handles)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch (backward) order."""
        return [list(bucket.indices) for bucket in self._buckets]

    @property
    def bucket_bytes(self) -> list[int]:
        return [bucket.nbytes for bucket in self._buckets]

    @property
    def launched_buckets(self) -> int:
        """How many buckets of the current (or last) synchronised backward have started their all-reduce."""
        return self._next_bucket

    @property
    def step(self) -> int:
        """The synchronised step armed last, counted from 0 (-1 before the first)."""
        return self._step

    @property
    def group(self) -> dist.ProcessGroup:
        """The ranks whose gradients are averaged (the first ring)."""
        return self._rings[0]

    def add_observer(self, observer: ReducerObserver) -> None:
        """Tell ``observer`` of every step's moments from now on (see ``lit_dp.gradients.events``)."""
        self._observers.append(observer)

    def request_bucket_limits(self, bucket_bytes: int, last_bucket_bytes: int) -> None:
        """Rebuild the buckets with these limits at the start of the next step, before it is armed.

        Every rank must ask at the same step with the same limits, or the ranks' buckets stop
        pairing up (the autotuner guarantees both). Asked from ``step_started``, the change
        applies to the step starting.
        """
        self._requested_limits = [last_bucket_bytes, bucket_bytes]

    def partition(self, bucket_bytes: int, last_bucket_bytes: int) -> list[list[int]]:
        """The parameter indices per bucket, in launch order, that these limits would give now."""
        return launch_order(self._params, self._sparse, self._forward_order(), [last_bucket_bytes, bucket_bytes])

    def register_comm_hook(self, comm_hook: CommHook) -> None:
        """Reduce dense buckets through ``comm_hook`` (see ``lit_dp.gradients.hooks``); once, before the first backward."""
        if self._comm_hook is not None:
            raise RuntimeError(
                f"lit_dp: a communication hook ({self._comm_hook.name}) is already registered; "
                "register_comm_hook can only be called once."
            )
        if self._rebuilt or self._started:
            raise RuntimeError(
                f"lit_dp: register_comm_hook({comm_hook.name}) must be called before the first synchronised backward."
            )
        if self._owners is not None:
            raise ValueError(
                f"lit_dp: register_comm_hook({comm_hook.name}) with sharding_stage=2 is invalid: a hook returns the "
                "whole bucket's average, stage 2 reduces each gradient to its owner only."
            )
        self._comm_hook = comm_hook
        comm_hook.waiter = self.waiter
        # The buckets were built without the hook (flags in the buffer, large gradients in place).
        self._rebuild(list(range(len(self._params))))

    def prepare_for_backward(self, outputs: object) -> None:
        """Arm the reducer for the next backward; called after each forward that will synchronise."""
        self._check_pending_flags()
        self._step += 1
        for observer in self._observers:
            observer.step_started(self._step)
        if self._requested_limits is not None:
            self._limits, self._requested_limits = self._requested_limits, None
            self._rebuild(self._forward_order())
            self._agreed_order = None
        elif self._agreed_order is not None:
            self._rebuild(self._agreed_order)
            self._agreed_order = None
        self._pending = [len(bucket.indices) for bucket in self._buckets]
        self._ready = bytearray(len(self._params))
        self._next_bucket = 0
        self._started = False
        self._armed = True
        if not self._rebuilt:
            self._order = []
        if self._find_unused:
            reached = reached_parameters(outputs)
            self._unreached = [i for i, p in enumerate(self._params) if id(p) not in reached]
            self._partial = {self._bucket_of[i] for i in self._unreached}

    def shadow_step(self, takes_step: bool = False) -> None:
        """The collectives of one synchronised step, without a backward of this rank's (``lit_dp.join``).

        Counted and announced like a real step; the flags never count this rank as missing a
        gradient. ``takes_step=False`` (torch's Join): zeros, ``.grad`` left alone, as in DDP.
        ``True`` (the Trainer's rank without a batch): what it accumulated since the last
        synchronisation counts, and the averages land in ``.grad`` for its optimizer.
        """
        self.prepare_for_backward(None)
        self._shadowing, self._shadow_takes_step = True, takes_step
        try:
            self._started = True
            for observer in self._observers:
                observer.backward_started(self._step)
            self._finalize_backward()
        finally:
            self._shadowing = self._shadow_takes_step = False

    def _make_hook(self, index: int):
        # A weak reference: the parameters outlive the reducer (the model is unwrapped after
        # training), and a strong one would keep every old reducer alive through its hooks.
        reducer_ref = weakref.ref(self)

        def hook(_param: torch.Tensor) -> None:
            reducer = reducer_ref()
            if reducer is not None:
                reducer._on_gradient_ready(index)

        return hook

    def _on_gradient_ready(self, index: int) -> None:
        # Runs once per parameter and backward: kept to index arithmetic (docs/architecture.md).
        self._used[index] = 1
        if self._as_view:
            self._adopt_gradient(index)
        if not self._armed:
            return
        ready = self._ready
        if ready[index]:
            raise RuntimeError(
                f"lit_dp reducer: parameter {self._names[index]!r} received its gradient twice in one backward. "
                "Run one forward per backward (reentrant checkpointing and repeated forwards before one "
                "backward are not supported)."
            )
        if not self._started:
            self._started = True
            Variable._execution_engine.queue_callback(self._finalize_backward)
            for observer in self._observers:
                observer.backward_started(self._step)
            for unreached in self._unreached:
                ready[unreached] = 1
                self._mark_ready(unreached)
        ready[index] = 1
        if not self._rebuilt:
            self._order.append(index)
        bucket = self._bucket_of[index]
        pending = self._pending
        pending[bucket] -= 1
        if pending[bucket] == 0 and bucket == self._next_bucket:
            self._launch_complete_buckets()

    def _adopt_gradient(self, index: int) -> None:
        """Move a fresh gradient into its bucket view at once, so it is not held twice."""
        view = self._view_of[index]
        param = self._params[index]
        if view is not None and param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

    def _mark_ready(self, index: int) -> None:
        bucket = self._bucket_of[index]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0 and bucket == self._next_bucket:
            self._launch_complete_buckets()

    def _launch_complete_buckets(self) -> None:
        buckets, pending, partial = self._buckets, self._pending, self._partial
        used, flag_used = self._used, self._find_unused
        if self._shadowing:  # flags: "used here" where it is, never "missing here" (None)
            used = self._used if self._shadow_takes_step else self._nothing_used
            flag_used = True if self._find_unused else None
        while self._next_bucket < len(buckets) and pending[self._next_bucket] == 0:
            position = self._next_bucket
            complete = self._armed and position not in partial
            if self._comm_hook is not None:
                self._comm_hook.settle()
            bucket = buckets[position]
            bucket.start(used, flag_used, self.divisor, complete)
            if self._observers:
                launch = BucketLaunch(self._step, position, bucket.indices, bucket.sent_bytes(), bucket.futures())
                for observer in self._observers:
                    observer.bucket_launched(launch)
            self._next_bucket += 1

    def _finalize_backward(self) -> None:
        for observer in self._observers:
            observer.backward_ended(self._step)
        self._armed = False
        # Buckets still incomplete hold parameters without a gradient in this backward; they are
        # launched anyway (zeros) so every rank issues the same collectives and none hangs.
        for pos in range(self._next_bucket, len(self._buckets)):
            self._pending[pos] = 0
        self._launch_complete_buckets()
        buckets = self._buckets
        for bucket in buckets:
            bucket.wait()
        used, self._used = self._used, bytearray(len(self._params))
        if self._shadowing:
            used = bytearray(b"\x01") * len(used)  # this rank is not among those missing a gradient
        if self._find_unused:
            # Which parameters no rank used decides which .grad stay untouched: a host decision,
            # so the flags are read here (on CUDA the one synchronisation of such a step).
            skipped = unused_members(self._buckets, self._flag_totals())
        else:
            skipped = [()] * len(buckets)
            self._pending_flags.append(PendingFlags(buckets, used))
            self._check_pending_flags()  # at once where the flags are already on the host
        if self._shadowing and not self._shadow_takes_step:
            skipped = [range(len(bucket.indices)) for bucket in buckets]  # releases the buckets' results only
        for bucket, members in zip(buckets, skipped):
            bucket.write_back(self._as_view, members)
        if not self._rebuilt:
            self._agree_on_ready_order()
        for observer in self._observers:
            observer.step_ended(self._step)

    def _flag_totals(self) -> list[float]:
        return torch.cat([bucket.flags for bucket in self._buckets]).tolist()

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
                raise RuntimeError(
                    missing_gradients_message(
                        self._names, self._world_size, missing, flags.used, self._unused_parameters_message
                    )
                )

    def _agree_on_ready_order(self) -> None:
        """Adopt rank 0's observed ready order for the buckets (Paddle and DDP do the same).

        The buckets are rebuilt at the next synchronised forward, as in DDP: by then
        ``zero_grad`` has usually dropped the gradients, so with gradient views the old and new
        buffers are not alive together.
        """
        if not self._rebuild_buckets:
            self._rebuilt = True  # the registration order stays (rebuild_buckets=False)
            return
        seen = set(self._order)
        # Parameters not seen (all, on a rank that joined before its first step) keep their place.
        order = self._order + [i for i in reversed(self._forward_order()) if i not in seen]
        agreed = torch.tensor(order, dtype=torch.long, device=self._params[0].device)
        ring = self._rings[0]
        work = dist.broadcast(agreed, src=dist.get_global_rank(ring, 0), group=ring, async_op=True)
        self.waiter.wait(work, "the broadcast of the agreed bucket order")
        self._agreed_order = list(reversed(agreed.tolist()))
        self._rebuilt = True

    def _forward_order(self) -> list[int]:
        """The parameter order buckets are cut from: rank 0's ready order once agreed, else the current buckets'."""
        if self._agreed_order is not None:
            return list(self._agreed_order)
        # Buckets are in launch (reverse forward) order, members in forward order.
        return [index for bucket in reversed(self._buckets) for index in bucket.indices]

    def _rebuild(self, forward_order: list[int]) -> None:
        self._build_buckets(forward_order)
        if self._as_view:
            for index, param in enumerate(self._params):
                if param.grad is not None:
                    self._adopt_gradient(index)

    def _build_buckets(self, forward_order: list[int]) -> None:
        self._buckets = []  # drop the old buffers before allocating new ones
        self._buckets, self._bucket_of, self._view_of = build_buckets(
            self._params, self._sparse, self._owners, forward_order, self._limits, self._rings, self._comm_hook,
            self._as_view, self.waiter,
        )  # fmt: skip


def _remove_hooks(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


