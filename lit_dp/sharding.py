"""``lit_dp.ShardedOptimizer``: sharding stages 1 and 2 (ZeRO-1/2, Paddle's sharding) for any torch optimizer.

The model's wrapper decides the stage, since stage 2 changes what its reducer does in backward;
the optimizer wrapper reads the owners from it::

    model = lit_dp.DataParallel(net, sharding_stage=2)
    optimizer = lit_dp.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    for inputs, targets in loader:
        criterion(model(inputs), targets).backward()
        optimizer.clip_grad_norm_(1.0)    # the exact global norm: one all-reduce
        optimizer.step()                  # steps this rank's parameters, then gathers everyone's
        optimizer.zero_grad()
        scheduler.step()

What a rank holds: every parameter has one owner (``DataParallel.owner_of``, balanced by bytes,
``lit_dp.gradients.buckets.assign_owners``). The user's optimizer is rebuilt over the owned
parameters (its class, its ``defaults``, its parameter groups with their hyper-parameters), so
optimizer state exists on the owner only. Stage 1: every rank still receives every averaged
gradient. Stage 2: each rank receives only its own (``lit_dp.gradients.scatter``). After the
local step, the owners broadcast their parameters (``lit_dp.gradients.gather``): inside
``step()``, or, with ``sharding_overlap``, during the next forward, each module waiting for its
own parameters only.

The optimizer the user built stays the one their LR scheduler holds: this wrapper shares its
parameter-group dicts (a scheduler's change of ``lr`` is copied to the local optimizer at every
step) and refuses to let it step. ``consolidate_state_dict(to)`` then ``state_dict()`` on that
rank give the unsharded optimizer's ``state_dict()`` (the protocol of torch's
``ZeroRedundancyOptimizer``); ``shard_state_dict()`` gives this rank's part of it with no collective,
what the strategies' checkpoints keep (``lit_dp.checkpoint``: each owner writes its own part);
``load_state_dict`` takes it, or any unsharded state of the same optimizer, or the part of one that
this rank needs (``needs``), on any world size: the state is split among the owners of this run.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lit_dp.checkpoint.tree import RankEntries
from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.buckets import megabytes_to_bytes
from lit_dp.gradients.gather import ParameterGather


class ShardedOptimizer(Optimizer):
    """Steps only this rank's parameters of ``optimizer``, then gathers everyone's (see the module docstring).

    Args:
        optimizer: the user's optimizer over ``model``'s parameters, or an optimizer class, then
            built over ``model.parameters()`` with the keyword ``defaults``.
        model: the ``lit_dp.DataParallel`` built with ``sharding_stage=1`` or ``2``.

    Parameters of ``optimizer`` that ``model`` does not synchronise (frozen ones, say) have no
    owner: every rank keeps them in its local optimizer, as without sharding.
    """

    def __init__(self, optimizer: Optimizer | type[Optimizer], model: DataParallel, **defaults: Any) -> None:
        if not isinstance(model, DataParallel) or model.sharding_stage is None:
            stage = getattr(model, "sharding_stage", None)
            raise ValueError(
                f"lit_dp.ShardedOptimizer needs the model wrapped as lit_dp.DataParallel(..., sharding_stage=1 or 2); "
                f"got {type(model).__name__} with sharding_stage={stage!r}."
            )
        if isinstance(optimizer, type):
            optimizer = optimizer(model.parameters(), **defaults)
        elif defaults:
            raise TypeError(f"lit_dp.ShardedOptimizer: keyword defaults {sorted(defaults)} go with an optimizer class.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"lit_dp.ShardedOptimizer wraps a torch.optim.Optimizer; got {type(optimizer).__name__}.")
        reducer = model.reducer
        self._group = reducer.group if reducer is not None else None
        self._rank = dist.get_rank(self._group) if self._group is not None else 0
        self._world_size = dist.get_world_size(self._group) if self._group is not None else 1
        self._overlap = model.options.sharding.overlap
        self._waiter = model.waiter  # every wait of its collectives, watched by the model's hang watchdog
        # The user's optimizer, under the name wrappers use (DeepSpeed's, LightningOptimizer's), so
        # Lightning's LearningRateMonitor sees the one its scheduler holds.
        self.optimizer = optimizer
        # The same group dicts as `optimizer`'s: what its scheduler writes, this wrapper reads.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._params = [param for group in self.param_groups for param in group["params"]]
        self._owners = [model.owner_of(param) for param in self._params]
        self._gather = self._build_gather(model)
        mine = {id(param) for param, owner in zip(self._params, self._owners) if owner in (None, self._rank)}
        local_groups = [
            {**_hyperparameters(group), "params": [p for p in group["params"] if id(p) in mine]}
            for group in self.param_groups
        ]
        self.local_optimizer = type(optimizer)(local_groups, **_constructor_defaults(optimizer))
        self.state = self.local_optimizer.state
        self._consolidated: dict[str, Any] | None = None
        if optimizer.state:  # stepped or loaded before: keep the owned part of its state
            self.load_state_dict(optimizer.state_dict())
            optimizer.state.clear()
        self._hooks = [optimizer.register_step_pre_hook(_refuse_step)]
        if self._overlap and self._gather is not None:
            self._hooks += self._wait_in_forward(model)
            model.register_parameter_gather(self)  # read all weights (consistency checks) after its gather
        weakref.finalize(self, _remove_hooks, self._hooks)

    def _build_gather(self, model: DataParallel) -> ParameterGather | None:
        """The broadcast of this optimizer's owned parameters, in the module's order."""
        if self._world_size == 1:
            return None
        owner_of = {id(param): owner for param, owner in zip(self._params, self._owners) if owner is not None}
        ordered = [param for param in model.module.parameters() if id(param) in owner_of]
        if not ordered:
            return None
        bucket_bytes = megabytes_to_bytes("comm_buffer_size", model.comm_buffer_size)
        owners = [owner_of[id(param)] for param in ordered]
        return ParameterGather(ordered, owners, self._group, bucket_bytes, self._waiter)

    def _wait_in_forward(self, model: DataParallel) -> list[torch.utils.hooks.RemovableHandle]:
        """A forward pre-hook per module holding gathered parameters: it waits for their buckets only."""
        gather = self._gather
        assert gather is not None
        handles = []
        for module in model.module.modules():
            positions = [gather.bucket_of(param) for param in module.parameters(recurse=False)]
            positions = [position for position in positions if position is not None]
            if positions:
                handles.append(module.register_forward_pre_hook(_waiter(weakref.ref(gather), max(positions))))
        return handles

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "local_optimizer" in self.__dict__:
            raise NotImplementedError(
                "lit_dp.ShardedOptimizer.add_param_group: owners are fixed when the optimizer is built; "
                "build the optimizer with every parameter group it will need."
            )
        super().add_param_group(param_group)  # Optimizer.__init__ registering the wrapped optimizer's groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (if given), step this rank's parameters, then gather every rank's."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_for_parameters()  # with overlap: whatever the forward did not need
        _copy_hyperparameters(self.param_groups, self.local_optimizer.param_groups)
        self.local_optimizer.step()
        _copy_hyperparameters(self.local_optimizer.param_groups, self.param_groups)
        if self._gather is not None:
            self._gather.start()
            if not self._overlap:
                self._gather.wait()
        # LR schedulers built on the wrapped optimizer check that it stepped before they do
        # (torch.optim.lr_scheduler's `_opt_called`): it stepped, through this wrapper.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return loss

    def wait_for_parameters(self) -> None:
        """Wait until every rank holds every updated parameter (a no-op unless ``sharding_overlap``
        left the last gather in flight): before reading weights outside the model's forward."""
        if self._gather is not None:
            self._gather.wait()

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over all ranks' gradients, each counted once.

        Each rank takes the norm of the gradients it owns; one all-reduce (a sum of p-th
        powers, or a max for ``inf``) gives the total, and each rank scales its own gradients.
        Gradients a rank does not own (present under stage 1) are left unscaled: no step uses them.
        Returns the total norm, as torch's does.
        """
        norm_type = float(norm_type)
        sharded, replicated = [], []
        for param, owner in zip(self._params, self._owners):
            if param.grad is not None and owner in (None, self._rank):
                (replicated if owner is None else sharded).append(param.grad)
        device = next((p.device for p in self._params), torch.device("cpu"))
        total = _norm(sharded, norm_type, device)
        if self._world_size > 1:
            inf = norm_type == float("inf")
            total = total if inf else total**norm_type
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            work = dist.all_reduce(total, op=op, group=self._group, async_op=True)
            self._waiter.wait(work, "sharding's global gradient norm")
            total = total if inf else total ** (1.0 / norm_type)
        if replicated:  # the same on every rank (or the user's own business): added once, locally
            total = _norm([total, _norm(replicated, norm_type, device)], norm_type, device)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
                "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in sharded + replicated:
            grad.mul_(coefficient.to(grad.device, grad.dtype))
        return total

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the whole optimizer state on rank ``to`` (of the model's group); call on every rank.

        Tensors arrive on the CPU. ``state_dict()`` on rank ``to`` then returns it.
        """
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self._world_size:
            raise ValueError(f"to={to!r} is invalid: expected a rank of the model's group, in [0, {self._world_size}).")
        part = super().state_dict()  # this rank's state, indexed as the unsharded optimizer's
        keep = {
            index: _to_cpu(state)
            for index, state in part["state"].items()
            if self._owners[index] == self._rank or (self._owners[index] is None and self._rank == to)
        }
        if self._world_size == 1:
            self._consolidated = {"state": keep, "param_groups": part["param_groups"]}
            return
        received: list[dict[int, Any]] | None = [{} for _ in range(self._world_size)] if self._rank == to else None
        with self._waiter.outside("sharding's consolidation of the optimizer state"):
            dist.gather_object(keep, received, dst=dist.get_global_rank(self._group, to), group=self._group)
        if received is not None:
            state = {index: value for states in received for index, value in states.items()}
            self._consolidated = {"state": dict(sorted(state.items())), "param_groups": part["param_groups"]}

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of the unsharded optimizer's ``state_dict()``, with no collective: every parameter
        group, and as ``RankEntries`` the state of the parameters this rank owns (and on the group's first rank,
        of those no rank owns, which every rank holds alike). The union of every rank's ``state`` is the unsharded
        optimizer's. Its tensors are this rank's own (not copied)."""
        part = super().state_dict()
        own = {index: state for index, state in part["state"].items() if self._writes(index)}
        return {"state": RankEntries(own), "param_groups": part["param_groups"]}

    def needs(self, index: int) -> bool:
        """Whether this rank keeps the state of the parameter ``index`` (in the unsharded optimizer's order): it owns
        it, or no rank does (every rank keeps those). What a checkpoint's reader reads for it."""
        return self._owners[index] in (None, self._rank)

    def _writes(self, index: int) -> bool:
        owner = self._owners[index]
        return owner == self._rank or (owner is None and self._rank == 0)

    def state_dict(self) -> dict[str, Any]:
        """The state collected by ``consolidate_state_dict`` on this rank, in the unsharded format.

        Handed over once (the copy is not kept): consolidate again for a newer one.
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"lit_dp.ShardedOptimizer.state_dict() on rank {self._rank}: no consolidated state here. Call "
                f"consolidate_state_dict(to={self._rank}) on every rank first (Lightning and Fabric do when they "
                "save a checkpoint)."
            )
        consolidated, self._consolidated = self._consolidated, None
        return consolidated

    def unwrap(self, to: int = 0) -> Optimizer:
        """The wrapped optimizer, holding the whole state on rank ``to`` (none elsewhere); call on every rank.

        For the end of training (the Trainer strategy does it when fitting ends, so that
        ``trainer.save_checkpoint`` works after ``fit`` as under ``"ddp"``); this wrapper must
        not step afterwards.
        """
        self.wait_for_parameters()
        self.consolidate_state_dict(to)
        _remove_hooks(self._hooks)
        if self._consolidated is not None:
            self.optimizer.load_state_dict(self.state_dict())
        return self.optimizer

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded (or consolidated) optimizer state: this rank keeps its owned part."""
        saved_groups = state_dict["param_groups"]
        saved_sizes = [len(group["params"]) for group in saved_groups]
        sizes = [len(group["params"]) for group in self.param_groups]
        if saved_sizes != sizes:
            raise ValueError(
                f"lit_dp.ShardedOptimizer.load_state_dict: the saved state has parameter groups of sizes "
                f"{saved_sizes}, this optimizer {sizes}: expected the state of the same optimizer over the same "
                "parameters."
            )
        saved_index = {
            id(param): index
            for saved, group in zip(saved_groups, self.param_groups)
            for index, param in zip(saved["params"], group["params"])
        }
        local_groups, local_state, position = [], {}, 0
        for saved, group in zip(saved_groups, self.local_optimizer.param_groups):
            local_groups.append(
                {**_hyperparameters(saved), "params": list(range(position, position + len(group["params"])))}
            )
            for param in group["params"]:
                if saved_index[id(param)] in state_dict["state"]:
                    local_state[position] = state_dict["state"][saved_index[id(param)]]
                position += 1
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.local_optimizer.state  # loading replaced the local optimizer's dict
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(_hyperparameters(saved))


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's ``defaults`` that its constructor takes: ``AdamW`` keeps ``decoupled_weight_decay``
    there but does not take it (it is ``Adam``'s). The groups carry every hyper-parameter anyway."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {key: value for key, value in optimizer.defaults.items() if key in parameters}


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _copy_hyperparameters(sources: list[dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    for source, target in zip(sources, targets):
        target.update(_hyperparameters(source))


def _norm(tensors: Iterable[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``tensors`` together, in float32 (0 for none)."""
    norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32).to(device) for t in tensors]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _refuse_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    raise RuntimeError(
        f"This {type(optimizer).__name__} is wrapped by lit_dp.ShardedOptimizer, which holds the state of this rank's "
        "parameters: call the ShardedOptimizer's step() instead."
    )


def _waiter(gather_ref: weakref.ref, position: int) -> Callable[[nn.Module, Any], None]:
    def wait_for_own_parameters(_module: nn.Module, _args: Any) -> None:
        gather = gather_ref()
        if gather is not None:
            gather.wait_until(position)

    return wait_for_own_parameters


def _remove_hooks(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
