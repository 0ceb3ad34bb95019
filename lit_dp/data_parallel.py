"""``lit_dp.DataParallel``: Paddle's dynamic-graph DataParallel for torch modules, with torch DDP's constructor."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable
from torch.utils._pytree import tree_map

import lit_dp.gradients.group as groups
from lit_dp.buffers import BufferBroadcasts
from lit_dp.ddp_arguments import (
    checked_devices,
    chosen_group,
    options_from,
    refuse_a_launched_job_without_a_group,
    refuse_what_cannot_work,
)
from lit_dp.ddp_surface import DDPSurface, default_group
from lit_dp.fault_tolerance.commit import CrossGroupCommit
from lit_dp.fault_tolerance.replica_group import (
    refuse_an_asynchronous_quorum,
    replica_group,
)
from lit_dp.gradients.broadcast import (
    ddp_ignored,
    synced_buffers,
    synced_parameters,
    trainable_parameters,
)
from lit_dp.gradients.buckets import MB, megabytes_to_bytes, shard_owners
from lit_dp.gradients.compile import bucket_graph_breaks
from lit_dp.gradients.gather import ParameterGatherer
from lit_dp.gradients.hooks import CommHook
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.reducer import Reducer
from lit_dp.gradients.sparse import sparse_gradient_parameters
from lit_dp.gradients.waiting import Waiter
from lit_dp.job.process_group import get_rings
from lit_dp.join import JoinMethods, JoinState, notify
from lit_dp.observability.observers import ModelObservers, ObservedModel
from lit_dp.options import AUTO, DEFAULT_BUCKET_MB, MODULE, Options, resolve_comm_hook
from lit_dp.options.comm_hooks import declared_stateless
from lit_dp.options.docs import options_doc
from lit_dp.options.fault_tolerance import UNDER_MANAGER, refuse_what_replicas_cannot_follow
from lit_dp.options.signature import takes_options
from lit_dp.options.warning import LitDPFutureWarning, LitDPWarning

log = logging.getLogger(__name__)

class DataParallel(BufferBroadcasts, DDPSurface, ObservedModel, JoinMethods, nn.Module, Joinable):
    """Run ``module`` data-parallel: the first rank's state is broadcast, gradients are averaged.

    The constructor is torch DDP's (``torch.nn.parallel.DistributedDataParallel``), so that
    ``DDP(...)`` becomes ``lit_dp.DataParallel(...)`` by renaming, positional arguments included;
    docs/reducer.md has the table of what each argument and attribute does here. In short:

    Args:
        module: the module to train (``self.module``; Paddle's name ``_layers`` also works).
        device_ids: None, or the one CUDA device of a single-device CUDA module, as on DDP:
            inputs are moved there before the forward. A process group passed here (lit_dp's
            old second positional argument) is refused: pass it as ``process_group=``.
        output_device: kept as an attribute, as on DDP (neither moves outputs).
        dim: kept as an attribute, as on DDP (neither scatters inputs).
        broadcast_buffers: as on DDP: before each forward that follows a synchronising one, the
            buffers (BatchNorm's running statistics) of the group's first rank are broadcast; with
            False they are neither broadcast then nor at construction (also a lit_dp option).
        init_sync: broadcast the first rank's parameters (and buffers) at construction.
        process_group: the ranks to average over (lit_dp's ``group=`` is the same argument); by
            default the rings of ``init_parallel_env`` (the default group when there is one ring).
            Any group works: a subgroup without global rank 0, or one written in Python.
        bucket_cap_mb: DDP's name for ``comm_buffer_size``; given, it bounds every bucket, the
            last reduced too, as on DDP (lit_dp's own default keeps that one at 1 MB).
        find_unused_parameters, gradient_as_bucket_view: as on DDP (also lit_dp options).
        check_reduction: deprecated in torch, without effect there or here.
        static_graph: as on DDP: the same graph every iteration. The first synchronised step
            counts each parameter's gradients (reentrant checkpointing may give one several), later
            steps wait for that many and know the unused parameters without a graph walk;
            ``_set_static_graph()`` is refused after training started, as on DDP.
        delay_all_reduce_named_params, param_to_hook_all_reduce: given together, as on DDP; those
            parameters are averaged in the buckets like the others (DDP only delays them).
        mixed_precision: refused: use ``torch.autocast`` and ``comm_dtype``.
        device_mesh: a one-dimensional mesh, whose group is used, as on DDP.
        skip_all_reduce_unused_params: accepted; unused parameters already keep their ``.grad``.
        bucket_cap_mb_list: refused: use ``comm_buffer_size`` and ``last_comm_buffer_size``.
        batched_grad_copy: no effect (a bucket's gradients are copied in one batched call already).
        forward_sync_buffers: torch 2.13's name for the forward half of ``broadcast_buffers``.
        group: lit_dp's name for ``process_group``.
        options: options already validated by a front door (the strategies pass theirs);
            otherwise the keyword arguments below are validated here.
        manager: a ``torchft.Manager``: gradients are averaged over the replica groups of its
            quorum, step by step, instead of over a process group (``lit_dp.fault_tolerance``,
            docs/fault_tolerance.md). Nothing is broadcast then, neither at construction (the
            Manager's own ``init_sync`` gives every replica the first one's state) nor before
            forwards (each replica group keeps its buffers, as under torchft's DDP). The strategies
            pass the commit protocol around their Manager
            (``lit_dp.fault_tolerance.commit.CrossGroupCommit``) instead, which LocalSGD shares.

    Options (``lit_dp.options``), as keyword arguments:
{options}

    Whether a backward synchronises is decided at its forward, once, as a ``StepPlan``
    (``lit_dp.gradients.plan``): ``no_sync()`` and ``require_backward_grad_sync = False`` (torch
    DDP's attribute, which scripts written for DDP set to accumulate gradients) keep gradients
    local, as does the local phase of a ``lit_dp.LocalSGD`` driving this model.
    ``state_dict()`` has DDP's ``module.`` prefix; ``load_state_dict`` takes that form or the
    plain module's. ``register_comm_hook`` takes torch DDP's communication hooks. With
    ``sharding_stage`` each parameter gets an owner (``owner_of``), whose
    ``lit_dp.ShardedOptimizer`` alone steps it (docs/sharding.md). Without a process group the
    module runs unchanged in a single process, and is refused where a launcher's variables
    describe several (each rank would train alone; DDP raises too); a group of one rank (what the Lightning strategies create for one
    device) gets a reducer like any other, so an unused parameter raises on one device as it
    would on many. ``copy.deepcopy`` and pickling work as on DDP (with the default group): the
    copy synchronises its own gradients, without observers or a hook registered by hand.

    A ``Joinable`` (``torch.distributed.algorithms.join``): ``with model.join():`` or
    ``with Join([model]):`` trains on uneven inputs (``lit_dp.join``). With ``hang_timeout``, a
    collective waiting longer is diagnosed and the whole job ends (``lit_dp.observability.watchdog``):
    this wrapper owns the ``Waiter`` through which every wait of its collectives goes.
    """

    @takes_options(MODULE)
    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Iterable[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        options: Options | None = None,
        manager: Any = None,
        **option_values: Any,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        options = options_from(
            options,
            option_values,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=bucket_cap_mb,
        )
        refuse_what_cannot_work(
            mixed_precision, bucket_cap_mb_list, delay_all_reduce_named_params, param_to_hook_all_reduce
        )
        if check_reduction:
            warnings.warn(
                "DataParallel(check_reduction=True): deprecated in torch DDP and without effect there or here; "
                "lit_dp raises on every rank when a parameter got no gradient (see find_unused_parameters).",
                LitDPFutureWarning,
                stacklevel=2,
            )
        group = chosen_group(process_group, group, device_mesh)
        delayed = [param for _, param in delay_all_reduce_named_params or ()]
        self.module = module
        # torch DDP's attribute, read once at construction as DDP does: these stay local.
        self.parameters_to_ignore = ddp_ignored(module)
        self._options = options
        self.device_ids, self.output_device = checked_devices(module, device_ids, output_device, delayed, self.parameters_to_ignore)
        self.device = next(module.parameters()).device
        self.device_type = self.device.type
        self.is_multi_device_module = len({p.device for p in module.parameters()}) > 1
        self.dim = dim
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        # torch DDP's flags: False keeps the next forward's backward local (no_sync() sets it), and
        # the buffers are broadcast before a forward only when the one before synchronised.
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.forward_sync_buffers = options.broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
        # torch 2.13: broadcast_buffers=False also skips the buffers at construction; forward_sync_buffers does not.
        sync_buffers_at_start = options.broadcast_buffers or forward_sync_buffers is not None
        self._has_buffers = next(synced_buffers(module, self.parameters_to_ignore), None) is not None
        self._buffer_source = 0  # the group rank whose buffers forwards broadcast (buffers_from)
        self._observers = ModelObservers()  # its autotuner is read by comm_buffer_size; _build_runtime subscribes them
        bucket_bytes = megabytes_to_bytes("comm_buffer_size", self.comm_buffer_size)
        # Read by dynamo to split compiled graphs at bucket boundaries (lit_dp.gradients.compile);
        # its splitter requires at least its own first-piece size (1 MB).
        self.bucket_bytes_cap = max(bucket_bytes, dist._DEFAULT_FIRST_BUCKET_BYTES)
        self._arms_at_forward = True  # False under manual optimisation (arm_at_backward)
        self._trained = False  # a synchronised backward was prepared (static_graph must be set before)
        self._logged_error: str | None = None  # the last error of an API call (_get_ddp_logging_data)
        self._given_group = group  # None: the rings of init_parallel_env (the default group's)
        self.join_state = JoinState()
        self._owners: dict[int, int] = {}
        # torchft's Manager (the protocol's, when given one).
        self._manager = manager.manager if isinstance(manager, CrossGroupCommit) else manager
        # The ranks buffers are broadcast among: the process group, or under a Manager this replica group's own.
        self._buffer_group: dist.ProcessGroup | None = None
        if manager is not None:
            # torchft (lit_dp.fault_tolerance): the group is the replica groups of the Manager's quorum,
            # hierarchically when this replica group has several ranks of its own.
            refuse_what_replicas_cannot_follow(options, UNDER_MANAGER)
            within = group if group is not None else default_group()
            rings = [replica_group(manager, within, bool(sparse_gradient_parameters(module)))]
            if within is not None and within.size() > 1:
                # Inside its replica group a model is DDP's: one start, the buffers of the group's first rank.
                refuse_an_asynchronous_quorum(self._manager, within)
                self._buffer_group = within
                if init_sync:
                    self._broadcast_initial_state(within, sync_buffers_at_start)
            else:
                self.forward_sync_buffers = False  # each replica group keeps its buffers (see the docstring)
        else:
            rings = [group] if group is not None else get_rings()
            self._buffer_group = rings[0] if rings else None
        if not rings:
            refuse_a_launched_job_without_a_group()
            warnings.warn(
                "DataParallel: world size is 1 and no process group exists; "
                "the module runs unchanged without gradient synchronisation.",
                LitDPWarning,
                stacklevel=2,
            )
        elif init_sync and manager is None:
            self._broadcast_initial_state(rings[0], sync_buffers_at_start)
        self._build_runtime(rings)

    def _build_runtime(self, rings: list[dist.ProcessGroup], copy: bool = False) -> None:
        """The reducer over the trainable parameters, the observers the options ask for, the
        communication hook they name. ``copy``: for a deep copy or an unpickled model, which gets
        its reducer without the observers (threads, files, the store's bookkeeping)."""
        self._rings = rings
        self._observers = ModelObservers()
        self._waiter = Waiter()
        self._gradients_local = False  # LocalSGD's local phase (keep_gradients_local)
        self._comm_hook: CommHook | None = None
        # What may leave parameters in flight after an optimizer step (sharding_overlap's gathers).
        self._parameter_gathers: weakref.WeakSet[ParameterGatherer] = weakref.WeakSet()
        self._reducer: Reducer | None = None
        named = trainable_parameters(self.module, self.parameters_to_ignore) if rings else []
        if named:
            options = self._options
            if options.sharding.stage is not None and groups.written_in_python(rings[0]):
                raise ValueError(
                    f"sharding_stage={options.sharding.stage} with a process group written in Python "
                    f"({type(rings[0]).__name__}) is not supported: the sharded optimizer addresses ranks through "
                    "torch's registered groups; expected a group made by init_process_group or new_group."
                )
            device = named[0][1].device
            names = [name for name, _ in named]
            sparse_ids = sparse_gradient_parameters(self.module)
            owners = shard_owners(named, sparse_ids, options.sharding.stage, rings[0].size())
            self._owners = {id(param): owner for (_, param), owner in zip(named, owners or ())}
            self._reducer = Reducer(
                [param for _, param in named],
                names,
                rings,
                bucket_bytes=megabytes_to_bytes("comm_buffer_size", self.comm_buffer_size),
                last_bucket_bytes=megabytes_to_bytes("last_comm_buffer_size", options.last_comm_buffer_size),
                sparse=[id(param) in sparse_ids for _, param in named],
                gradient_as_bucket_view=options.gradient_as_bucket_view,
                owners=owners if options.sharding.stage == 2 else None,
                static_graph=self.static_graph,
                waiter=self._waiter,
                # A replica group that joins later could not learn the first step's ready order.
                rebuild_buckets=self._manager is None,
            )
            if not copy:
                # Under torchft its own timeouts fail a stuck transaction and its replica groups come and go
                # (docs/fault_tolerance.md): the observers compare the ranks of this replica group only.
                ranks = self._buffer_group if self._manager is not None else self._reducer.group
                self._observers = ModelObservers.subscribe(
                    self._reducer,
                    options,
                    device,
                    names,
                    self._waiter,
                    ranks=ranks,
                    parameters=list(synced_parameters(self.module, self.parameters_to_ignore)),
                    buffers=partial(synced_buffers, self.module, self.parameters_to_ignore),
                    wait_for_parameters=_weak_call(self.wait_for_parameters),
                )
            sizes = ", ".join(f"{nbytes / MB:.2f}" for nbytes in self._reducer.bucket_bytes)
            log.debug("lit_dp.DataParallel: %d parameters in buckets of [%s] MB", len(named), sizes)
        # Built here, in each process: PowerSGD's state belongs to the process group.
        registration = resolve_comm_hook(self._options)
        if registration is not None:
            self._register_comm_hook(*registration, declared_stateless=declared_stateless(self._options))


    @property
    def _layers(self) -> nn.Module:
        """Paddle's name for ``module``."""
        return self.module

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The ranks gradients are averaged over (torch DDP's attribute); None without a process group."""
        return self._rings[0] if self._rings else None

    @property
    def rings(self) -> list[dist.ProcessGroup]:
        """The communicators buckets are spread over, ``process_group`` first (all span the same ranks)."""
        return list(self._rings)


    @property
    def find_unused_parameters(self) -> bool:
        """torch DDP's attribute (the option of that name)."""
        return self._options.find_unused_parameters

    @property
    def gradient_as_bucket_view(self) -> bool:
        """torch DDP's attribute (the option of that name)."""
        return self._options.gradient_as_bucket_view


    @property
    def reducer(self) -> Reducer | None:
        """The gradient reducer; None when nothing is synchronised (no process group, no trainable parameters)."""
        return self._reducer

    @property
    def sharding_stage(self) -> int | None:
        """1 or 2 when the optimizer state (and with 2 the gradients) are sharded; None otherwise."""
        return self._options.sharding.stage

    def owner_of(self, param: nn.Parameter) -> int | None:
        """The rank (in ``reducer.group``) that steps ``param`` under sharding; None for a parameter
        this wrapper does not synchronise (frozen, outside the module) or without sharding."""
        return self._owners.get(id(param))

    @property
    def waiter(self) -> Waiter:
        """How every wait of this model's collectives is made (a deadline under the hang watchdog):
        the reducer's, a hook's, and those of the LocalSGD, Join and uneven inputs driving it."""
        return self._waiter

    def keep_gradients_local(self, local: bool) -> None:
        """Whether backwards keep their gradients local from now on, as inside ``no_sync`` but until
        told otherwise: ``lit_dp.LocalSGD`` says so as its schedule moves (local after its warm-up).
        Under a torchft Manager, local is this replica group: a group of several ranks still reduces
        its gradients, on its own process group (its reducer's rings from the next step on), only
        not across groups; the commit protocol takes no quorum for such steps."""
        within = self._buffer_group if self._manager is not None else None
        if self._reducer is not None and within is not None and not groups.trivially_alone(within):
            self._reducer.reduce_on([within] if local else self._rings)
            return
        self._gradients_local = local


    def arm_at_backward(self) -> None:
        """Let ``prepare_for_backward`` alone decide each step: forwards no longer do (the Trainer
        strategy's manual optimisation, where ``manual_backward`` arms the reducer, however many
        forwards a ``training_step`` runs)."""
        self._arms_at_forward = False


    def register_parameter_gather(self, gather: ParameterGatherer) -> None:
        """``gather`` (a ``lit_dp.ShardedOptimizer`` with ``sharding_overlap``) may leave updated
        parameters in flight after its step; ``wait_for_parameters`` waits for them. Held weakly."""
        self._parameter_gathers.add(gather)

    def wait_for_parameters(self) -> None:
        """Wait for parameter updates still in flight (``register_parameter_gather``), before every
        weight is read outside a forward (the replica-consistency check does)."""
        for gather in list(self._parameter_gathers):
            gather.wait_for_parameters()

    @property
    def options(self) -> Options:
        """The options in effect."""
        return self._options

    @property
    def comm_buffer_size(self) -> float:
        """The bucket size in effect, MB: the fixed size, or with ``"auto"`` the size chosen once
        tuning is over, and until then the default that the first steps run with."""
        if self._observers.tuner is not None and self._observers.tuner.chosen_mb is not None:
            return self._observers.tuner.chosen_mb
        size = self._options.comm_buffer_size
        return DEFAULT_BUCKET_MB if size == AUTO else size


    # Not traced by dynamo: under `torch.compile(DataParallel(model))` the module call below is
    # compiled as its own frame, inside `bucket_graph_breaks`, and the reducer runs eagerly.
    @torch.compiler.disable(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.device_ids:
            inputs, kwargs = tree_map(self._to_input_device, (inputs, kwargs))
        if self._reducer is None:
            return self.module(*inputs, **kwargs)
        if self._observers.clock is not None and torch.is_grad_enabled():
            self._observers.clock.forward_started()  # in a loop without batch hooks, the end of its wait for data
        # The forward decides whether the next backward synchronises (as in torch DDP and Paddle),
        # so `no_sync()` must wrap the forward, not only the backward. Decided before the module
        # runs: under Join the notification and the buffer broadcast come first, as on DDP.
        plan = self.step_plan(Participation.SYNC) if torch.is_grad_enabled() and self._arms_at_forward else None
        if plan is not None and self._manager is not None and self._buffer_group is not None:
            self._start_as_the_first_replica_group()
        self._forward_communication(plan)
        with bucket_graph_breaks(self) if self._communication_can_overlap() else nullcontext():
            outputs = self.module(*inputs, **kwargs)
        if plan is not None and plan.communicates:
            self._trained = True
            self._reducer.prepare_for_backward(plan, outputs)
        return outputs

    def _start_as_the_first_replica_group(self) -> None:
        """At step 0, every rank of every replica group takes the first group's rank 0's state.

        torchft's ``init_sync`` gives rank ``r`` of each group the state of rank ``r`` of the
        quorum's replica ``r % P`` (it spreads recoveries over the replicas), so ranks of one group
        built unequal would start from different replicas. Rank 0 of every group holds the first
        replica's: broadcast inside each group, it becomes every rank's. Each forward of step 0 does
        it (a step 0 discarded and tried again is healed again); the quorum is in by then.
        """
        self._manager.wait_quorum()
        if self._manager.current_step() == 0:
            self._broadcast_initial_state(self._buffer_group, with_buffers=True)

    def _communication_can_overlap(self) -> bool:
        """Whether a backward's communication can overlap it, which graph breaks at bucket boundaries
        buy under ``torch.compile``: not on one rank, nor in LocalSGD's local phase, where gradients
        stay local; there a compiled model is one graph, as without lit_dp. Dynamo decides when it
        first compiles and keeps that graph, as under torch DDP: a model compiled in LocalSGD's
        warm-up keeps its breaks in the local phase."""
        return not groups.trivially_alone(self._rings[0]) and not self._gradients_local

    def _to_input_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(torch.device(self.device_type, self.device_ids[0]), non_blocking=True)
        return value

    def prepare_for_backward(self, outputs: Any) -> None:
        """Decide the plan of the backward from ``outputs`` and, unless it stays local, arm the reducer.

        The Trainer strategy's ``manual_backward`` calls it under manual optimization
        (``arm_at_backward``); otherwise each forward decides.
        """
        if self._reducer is None:
            return
        plan = self.step_plan(Participation.SYNC)
        if plan.communicates:
            self._trained = True
            self._reducer.prepare_for_backward(plan, outputs)

    def replay_step(self) -> None:
        """Take this step's communication without a batch (the Trainer's ``uneven_inputs``): the buffer
        broadcast a forward would take, then the synchronisation, where gradients accumulated here
        since the last synchronisation count and the averages land in ``.grad`` (a ``REPLAY`` plan,
        ``lit_dp.gradients.plan``)."""
        if self._reducer is None:
            return
        self.replay_forward()
        plan = self.step_plan(Participation.REPLAY)
        if plan.communicates:
            self._reducer.synchronise_without_backward(plan)

    def replay_forward(self) -> None:
        """Take the communication of a forward without running it: the buffer broadcast, when one is
        due (a rank without a batch under the Trainer's ``uneven_inputs``, e.g. at a validation step)."""
        if self._reducer is not None:
            self._forward_communication(None)


    def _syncs_gradients(self) -> bool:
        """Whether a backward now synchronises: ``require_backward_grad_sync``, outside LocalSGD's local phase."""
        return self.require_backward_grad_sync and not self._gradients_local


    def step_plan(self, participation: Participation) -> StepPlan:
        """The step's plan: the one place every ``StepPlan`` is decided, for every way a rank takes part.

        ``LOCAL`` while gradients stay local, else ``participation``, divided by the group's
        size or, inside a Join context, by what it says (``lit_dp.join.notify``). Under a
        torchft Manager the size is the replica groups taking part in this step's quorum, read
        here, at the forward that follows it (``FaultTolerantGroup.size``). ``SHADOW`` is a
        joined rank's step (``lit_dp.join``), which follows the ranks still in whatever this
        rank's own ``no_sync`` or LocalSGD phase says.
        """
        # A static graph's unused parameters are those of its first step: flags say "used here", as with
        # find_unused_parameters, without the per-step graph walk (the reducer knows them).
        find_unused = self._options.find_unused_parameters or self.static_graph
        size = self.join_process_group.size()
        if participation is Participation.SHADOW:
            # A joined rank sends zeros, so the divisor matters only for the choice of collective, which
            # must be the others': an averaging one when they divide by the group's size, else a sum (they
            # divide by the ranks still in, fewer than the group now that this rank is out).
            divisor = size if self.join_state.divide_by_initial_world_size else max(1, size - 1)
        elif not self._syncs_gradients():
            return StepPlan.decide(Participation.LOCAL, find_unused, size)
        else:
            divisor = notify(self) if participation is Participation.SYNC else size
        plan = StepPlan.decide(participation, find_unused, divisor)
        log.debug("lit_dp.DataParallel: step %d plan %s", self._reducer.step + 1, plan)
        return plan


    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward inside accumulate gradients locally, without communication (as in torch DDP,
        by clearing ``require_backward_grad_sync`` for the duration)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load ``state_dict()``'s form (keys ``module.*``, as DDP's) or the plain module's (no key
        with that prefix: what ``self.module.state_dict()`` and most checkpoints hold)."""
        if not any(key.startswith("module.") for key in state_dict):
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` without keeping its object alive (an observer of the reducer would close a cycle)."""
    reference = weakref.WeakMethod(method)

    def call() -> None:
        bound = reference()
        if bound is not None:
            bound()

    return call


DataParallel.__doc__ = DataParallel.__doc__.format(options=options_doc(MODULE))
