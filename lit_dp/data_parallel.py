"""``lit_dp.DataParallel``: Paddle's dynamic-graph DataParallel for torch modules."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from lit_dp.fault_tolerance import JOIN_REFUSED, UNDER_MANAGER, check_comm_hook, participants, replica_group
from lit_dp.gradients.broadcast import sync_params_buffers
from lit_dp.gradients.buckets import DEFAULT_BUCKET_MB, MB, assign_group_by_size, assign_owners, megabytes_to_bytes
from lit_dp.gradients.compile import bucket_graph_breaks
from lit_dp.gradients.dense import DenseBucket
from lit_dp.gradients.hooks import CommHook, resolve_comm_hook
from lit_dp.gradients.reducer import Reducer
from lit_dp.job.process_group import get_rings
from lit_dp.join import DataParallelJoin, DataParallelJoinHook, JoinState, notify
from lit_dp.observability.autotune import AUTO, BucketAutotuner, settled_step
from lit_dp.observability.stats import CommObserver, CommStats
from lit_dp.observability.watchdog import HangWatchdog
from lit_dp.options import MODULE, Options, options_doc

if TYPE_CHECKING:
    from lit_dp.observability.trace import TraceWriter

log = logging.getLogger(__name__)


class DataParallel(nn.Module, Joinable):
    """Run ``layers`` data-parallel: rank 0's state is broadcast, gradients are averaged.

    Args:
        layers: the module to train.
        group: the process group; defaults to the rings created by ``init_parallel_env``
            (the default group when there is one ring).
        options: options already validated by a front door (the strategies pass theirs);
            otherwise the keyword arguments below are validated here.
        unused_parameters_message: the sentence that opens a missing-gradient error (the
            strategies give Lightning's); by default a hint naming ``find_unused_parameters``.
        manager: a ``torchft.Manager``: gradients are averaged over the replica groups of its
            quorum, step by step, instead of over ``group`` (``lit_dp.fault_tolerance``,
            docs/fault_tolerance.md).
        init_sync: broadcast rank 0's parameters and buffers at construction (torch DDP's
            ``init_sync``). Never under a ``manager``, whose own ``init_sync`` gives every
            replica the first one's state at its first quorum.

    Options (``lit_dp.options``), as keyword arguments:
{options}

    ``no_sync()`` accumulates gradients locally (as does ``skip_grad_sync = True``, which
    ``lit_dp.LocalSGD`` sets for its local phase); ``state_dict()`` is the inner module's, with
    no prefix. ``register_comm_hook`` takes torch DDP's communication hooks. With
    ``sharding_stage`` each parameter gets an owner (``owner_of``), whose
    ``lit_dp.ShardedOptimizer`` alone steps it (docs/sharding.md). Without a process group the
    module runs unchanged; a group of one rank (what the Lightning strategies create for one
    device) gets a reducer like any other, so an unused parameter raises on one device as it
    would on many.

    A ``Joinable`` (``torch.distributed.algorithms.join``): ``with model.join():`` or
    ``with Join([model]):`` trains on uneven inputs (``lit_dp.join``). With ``hang_timeout``, a
    collective waiting longer is diagnosed and raised (``lit_dp.observability.watchdog``).
    """

    def __init__(
        self,
        layers: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        options: Options | None = None,
        unused_parameters_message: str | None = None,
        manager: Any = None,
        init_sync: bool = True,
        **option_values: Any,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if options is None:
            options = Options.build(option_values, MODULE)
        elif option_values:
            raise TypeError(f"DataParallel: pass options= or keyword options, not both (got {sorted(option_values)}).")
        auto = options.comm_buffer_size == AUTO
        # With "auto" the first step (before the ready-order rebuild) runs in default-sized buckets.
        bucket_bytes = megabytes_to_bytes("comm_buffer_size", DEFAULT_BUCKET_MB if auto else options.comm_buffer_size)
        last_bucket_bytes = megabytes_to_bytes("last_comm_buffer_size", options.last_comm_buffer_size)
        self._layers = layers
        self._options = options
        self.grad_need_sync = True
        # Set by lit_dp.LocalSGD for its local phase: backward then communicates nothing.
        self.skip_grad_sync = False
        # Read by dynamo to split compiled graphs at bucket boundaries (lit_dp.gradients.compile);
        # its splitter requires at least its own first-piece size (1 MB).
        self.bucket_bytes_cap = max(bucket_bytes, dist._DEFAULT_FIRST_BUCKET_BYTES)
        self._comm_hook: CommHook | None = None
        self._stats: CommObserver | None = None
        self._trace: TraceWriter | None = None
        self._tuner: BucketAutotuner | None = None
        self._reducer: Reducer | None = None
        self._watchdog: HangWatchdog | None = None
        self.join_state = JoinState()
        self._owners: dict[int, int] = {}
        # torchft (lit_dp.fault_tolerance): the group is the replica groups of the Manager's quorum.
        sparse_ids = _sparse_gradient_parameters(layers)
        self._replicas = None if manager is None else replica_group(manager, group, options, bool(sparse_ids))
        if self._replicas is not None:
            group, named = self._replicas, _trainable_parameters(layers)
        else:
            named = _synchronised_parameters(layers, group, init_sync)
        if named:
            rings = [group] if group is not None else get_rings()
            device = named[0][1].device
            names = [name for name, _ in named]
            owners = _shard_owners(named, sparse_ids, options.sharding_stage, dist.get_world_size(rings[0]))
            self._owners = {id(param): owner for (_, param), owner in zip(named, owners or ())}
            self._reducer = Reducer(
                [param for _, param in named],
                names,
                rings,
                bucket_bytes=bucket_bytes,
                last_bucket_bytes=last_bucket_bytes,
                sparse=[id(param) in sparse_ids for _, param in named],
                find_unused_parameters=options.find_unused_parameters,
                gradient_as_bucket_view=options.gradient_as_bucket_view,
                unused_parameters_message=unused_parameters_message,
                owners=owners if options.sharding_stage == 2 else None,
                rebuild_buckets=self._replicas is None,
            )
            self._observe(self._reducer, device, names)
            if self._replicas is not None or dist.get_rank() == 0:
                sizes = ", ".join(f"{nbytes / MB:.2f}" for nbytes in self._reducer.bucket_bytes)
                log.info("lit_dp.DataParallel: %d parameters in buckets of [%s] MB", len(named), sizes)
        # Built here, in each process: PowerSGD's state belongs to the process group.
        registration = resolve_comm_hook(comm_state=options.comm_state, **options.hook_options())
        if registration is not None:
            self.register_comm_hook(*registration)

    def _observe(self, reducer: Reducer, device: torch.device, names: list[str]) -> None:
        """Subscribe what the options ask for to the reducer's events."""
        options = self._options
        if options.comm_buffer_size == AUTO:
            last_bucket_bytes = megabytes_to_bytes("last_comm_buffer_size", options.last_comm_buffer_size)
            self._tuner = BucketAutotuner(reducer, device, last_bucket_bytes)
        if options.trace_dir is not None:
            from lit_dp.observability.trace import TraceWriter  # on demand: `python -m lit_dp.observability.trace` must find it unimported

            self._trace = TraceWriter(options.trace_dir, dist.get_rank(), options.trace_steps, names)
        if options.comm_stats or self._trace is not None:
            self._stats = CommObserver(device, [self._trace.add] if self._trace is not None else [])
            reducer.add_observer(self._stats)
        # Under torchft its own timeout discards a stuck step and drops the replica (docs/fault_tolerance.md).
        if options.hang_timeout is not None and self._replicas is None and dist.get_world_size(reducer.group) > 1:
            self._watchdog = HangWatchdog.start(reducer, options.hang_timeout, directory=options.trace_dir)

    @property
    def module(self) -> nn.Module:
        """The wrapped module (torch DDP's name for Paddle's ``_layers``)."""
        return self._layers

    @property
    def reducer(self) -> Reducer | None:
        """The gradient reducer; None when nothing is synchronised (no process group, no trainable parameters)."""
        return self._reducer

    @property
    def sharding_stage(self) -> int | None:
        """1 or 2 when the optimizer state (and with 2 the gradients) are sharded; None otherwise."""
        return self._options.sharding_stage

    def owner_of(self, param: nn.Parameter) -> int | None:
        """The rank (in ``reducer.group``) that steps ``param`` under sharding; None for a parameter
        this wrapper does not synchronise (frozen, outside the module) or without sharding."""
        return self._owners.get(id(param))

    @property
    def watchdog(self) -> HangWatchdog | None:
        """The hang watchdog (``hang_timeout``); set its ``directory`` to choose where stacks go."""
        return self._watchdog

    @property
    def comm_hook(self) -> CommHook | None:
        """The registered communication hook, if any."""
        return self._comm_hook

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Reduce each dense bucket with ``hook(state, bucket)``, torch DDP's communication hook contract.

        The hook returns a ``torch.futures.Future`` whose value is the bucket's averaged flat
        gradient; ``bucket`` offers ``buffer()``, ``gradients()``, ``parameters()``, ``index()``,
        ``is_last()`` and ``set_buffer()``. As in DDP, gradients reach the hook undivided, and a
        hook can be registered once, before the first synchronised backward. Sparse gradients
        are reduced without it. See docs/comm_hooks.md.
        """
        if self._replicas is not None:
            state = check_comm_hook(state, hook, self._replicas, UNDER_MANAGER)
        comm_hook = CommHook(state, hook)
        if self._comm_hook is not None:
            raise RuntimeError(
                f"lit_dp.DataParallel: a communication hook ({self._comm_hook.name}) is already registered; "
                f"register_comm_hook({comm_hook.name}) can only be called once."
            )
        if self._tuner is not None and self._tuner.chosen_mb is None:
            comm_hook.check_layout_settled_by(settled_step())
        if self._reducer is not None:
            self._reducer.register_comm_hook(comm_hook)
        self._comm_hook = comm_hook
        if dist.is_initialized() and dist.get_rank() == 0:
            log.info("lit_dp.DataParallel: communication hook %s", comm_hook.name)

    @property
    def options(self) -> Options:
        """The options in effect."""
        return self._options

    @property
    def comm_buffer_size(self) -> float | str:
        """The bucket size in MB; with ``"auto"``, the size chosen once tuning is over."""
        if self._tuner is not None and self._tuner.chosen_mb is not None:
            return self._tuner.chosen_mb
        return self._options.comm_buffer_size

    @property
    def autotuner(self) -> BucketAutotuner | None:
        """The bucket-size autotuner (``comm_buffer_size="auto"``), with its sweep once decided."""
        return self._tuner

    def comm_stats(self) -> CommStats | None:
        """This rank's statistics for the last synchronised step whose measurements are complete.

        None before the first step or without ``comm_stats=True``/``trace_dir``. Never waits for
        the device: on CUDA the step before the last is returned while the last is in flight.
        """
        return self._stats.last() if self._stats is not None else None

    def comm_stats_mean(self) -> dict[str, float]:
        """Mean ``time_ms`` and ``exposed_ms`` over the steps so far (the first excluded), and their overlap."""
        return self._stats.mean() if self._stats is not None else {}

    def flush_comm_stats(self) -> None:
        """Resolve every finished step (waiting for the device) and write the trace collected so far."""
        if self._stats is not None:
            self._stats.flush()
        if self._trace is not None:
            self._trace.write()

    # Not traced by dynamo: under `torch.compile(DataParallel(model))` the module call below is
    # compiled as its own frame, inside `bucket_graph_breaks`, and the reducer runs eagerly.
    @torch.compiler.disable(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._reducer is None:
            return self._layers(*inputs, **kwargs)
        with bucket_graph_breaks(self):
            outputs = self._layers(*inputs, **kwargs)
        # The forward decides whether the next backward synchronises (as in torch DDP and Paddle),
        # so `no_sync()` must wrap the forward, not only the backward.
        if torch.is_grad_enabled():
            self.prepare_for_backward(outputs)
        return outputs

    def prepare_for_backward(self, outputs: Any) -> None:
        """Arm the reducer for a backward from ``outputs`` unless gradients stay local.

        ``forward`` calls it; so does the Trainer strategy's ``manual_backward`` under manual
        optimization, where the forward must not decide.
        """
        if self._reducer is not None and self.grad_need_sync and not self.skip_grad_sync:
            notify(self)  # inside a Join context: "still in", before this step's collectives
            if self._replicas is not None:
                self._reducer.divisor = participants(self._replicas)
            self._reducer.prepare_for_backward(outputs)

    def shadow_backward(self) -> None:
        """Take this step's synchronisation without a batch (the Trainer's ``uneven_inputs``):
        gradients accumulated here since the last synchronisation count, and the averages land
        in ``.grad`` (``Reducer.shadow_step``)."""
        if self._reducer is not None and self.grad_need_sync and not self.skip_grad_sync:
            self._reducer.shadow_step(takes_step=True)

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
        if self._replicas is not None:
            raise ValueError(JOIN_REFUSED)
        return DataParallelJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Where the Join context's own all-reduces run: the parameters' device."""
        return next(self._layers.parameters()).device if self._reducer is not None else torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group whose ranks join: the reducer's."""
        return self._reducer.group if self._reducer is not None else dist.group.WORLD

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward inside accumulate gradients locally, without communication."""
        previous = self.grad_need_sync
        self.grad_need_sync = False
        try:
            yield
        finally:
            self.grad_need_sync = previous

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._layers.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._layers.load_state_dict(state_dict, strict=strict, assign=assign)


def fused_allreduce_gradients(
    parameters: Iterable[nn.Parameter],
    group: dist.ProcessGroup | None = None,
    comm_buffer_size: float = 25,
) -> None:
    """Average the dense gradients of ``parameters`` over ``group`` in coalesced buckets (large ones in place).

    For manual synchronisation after ``no_sync()``. Every rank must pass the same parameters.
    A gradient that is None on some ranks counts as zeros there; one None on every rank stays None.
    """
    params = list(dict.fromkeys(p for p in parameters if p.requires_grad))
    if not params or dist.get_world_size(group) < 2:
        return
    sparse = [position for position, p in enumerate(params) if p.grad is not None and p.grad.is_sparse]
    if sparse:
        raise ValueError(
            f"fused_allreduce_gradients: parameters at positions {sparse} have sparse gradients: "
            "expected dense gradients (lit_dp.DataParallel reduces sparse ones)."
        )
    ring = group or dist.group.WORLD
    groups = assign_group_by_size(params, [False] * len(params), [megabytes_to_bytes("comm_buffer_size", comm_buffer_size)])
    buckets = [DenseBucket(indices, [params[i] for i in indices], ring) for indices in groups]
    has_grad = bytearray(p.grad is not None for p in params)
    world_size = dist.get_world_size(group)
    for bucket in buckets:
        bucket.start(has_grad, flag_used=True, world_size=world_size)
    for bucket in buckets:
        bucket.wait()
        # A flag sum of 0: no rank had a gradient, so .grad stays None.
        no_gradient = {k for k, total in enumerate(bucket.flags.tolist()) if total == 0}
        bucket.write_back(as_view=False, skipped=no_gradient)


def _synchronised_parameters(
    layers: nn.Module, group: dist.ProcessGroup | None, init_sync: bool
) -> list[tuple[str, nn.Parameter]]:
    """Broadcast rank 0's state (with ``init_sync``); the trainable parameters to reduce (none without a process group)."""
    if not dist.is_initialized():
        warnings.warn(
            "lit_dp.DataParallel: world size is 1 and no process group exists; "
            "the module runs unchanged without gradient synchronisation.",
            stacklevel=3,
        )
        return []
    if init_sync:
        sync_params_buffers(layers, group=group)
    return _trainable_parameters(layers)


def _trainable_parameters(layers: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [
        (name, param)
        for name, param in layers.named_parameters()
        if param.requires_grad and not getattr(param, "no_sync", False)
    ]


def _shard_owners(
    named: list[tuple[str, nn.Parameter]], sparse_ids: set[int], stage: int | None, world_size: int
) -> list[int] | None:
    """Each parameter's owning rank, balanced by bytes (``assign_owners``); None without sharding."""
    if stage is None:
        return None
    sparse = [name for name, param in named if id(param) in sparse_ids]
    if stage == 2 and sparse:
        raise ValueError(
            f"sharding_stage=2 with sparse gradients (parameter {sparse[0]!r}, an embedding built with sparse=True) "
            "is invalid: a sparse gradient has no fixed layout to reduce to its owner's segment; expected "
            "sharding_stage=1, or sparse=False."
        )
    return assign_owners([param.numel() * param.element_size() for _, param in named], world_size)


def _sparse_gradient_parameters(module: nn.Module) -> set[int]:
    """Ids of parameters whose gradients are sparse: embeddings built with ``sparse=True``."""
    return {
        id(sub.weight)
        for sub in module.modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
    }


DataParallel.__doc__ = DataParallel.__doc__.format(options=options_doc(MODULE))
