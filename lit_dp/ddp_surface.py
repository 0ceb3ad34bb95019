"""What torch DDP offers around the training step, on ``DataParallel``: communication hooks
(``register_comm_hook``), ``_set_static_graph``, ``_get_ddp_logging_data``, pickling and
``copy.deepcopy``, and the deprecated LocalSGD accessors.

A mixin of ``DataParallel``, whose state it reads; pickling rebuilds the runtime with
``DataParallel._build_runtime``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

import lit_dp.gradients.group as groups
from lit_dp.fault_tolerance.replica_group import check_comm_hook
from lit_dp.gradients.buckets import megabytes_to_bytes
from lit_dp.gradients.hooks import CommHook
from lit_dp.job.process_group import get_rings
from lit_dp.observability.autotune import settled_step
from lit_dp.options import AUTO
from lit_dp.options.fault_tolerance import UNDER_MANAGER
from lit_dp.options.warning import LitDPDeprecationWarning

log = logging.getLogger("lit_dp.data_parallel")  # the model's own lines, under its logger

# What a pickled or deep-copied DataParallel leaves behind and rebuilds (torch DDP drops its
# process group, reducer and logger the same way): the process group, the reducer and its hooks,
# and the observers, which hold threads, files and the rendezvous store.
_RUNTIME_STATE = (
    "_rings",
    "_reducer",
    "_waiter",
    "_comm_hook",
    "_observers",
    "_gradients_local",
    "_parameter_gathers",
    "_buffer_group",
)

_MOVED_TO_JOIN_STATE = (
    "{} is deprecated: a LocalSGD tells its model its phase (keep_gradients_local); use model.join_state.local_sgd."
)


class DDPSurface:
    """torch DDP's hooks, debugging, static-graph and pickling surface."""

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
        self._register_comm_hook(state, hook, declared_stateless=False)

    def _register_comm_hook(self, state: object, hook: Callable, declared_stateless: bool) -> None:
        """``register_comm_hook``; ``declared_stateless``: the options chose named hooks that declare it."""
        with self._logging_errors():
            if self._manager is not None:
                state = check_comm_hook(state, hook, self._rings[0], UNDER_MANAGER, declared_stateless)
            comm_hook = CommHook(state, hook, self._waiter)
            if self._comm_hook is not None:
                raise RuntimeError(
                    "register_comm_hook or register_builtin_comm_hook can only be called once. lit_dp.DataParallel: "
                    f"{self._comm_hook.name} is already registered, {comm_hook.name} cannot be added."
                )
            if self._observers.tuner is not None and self._observers.tuner.chosen_mb is None:
                comm_hook.check_layout_settled_by(settled_step())
            if self._reducer is not None:
                self._reducer.register_comm_hook(comm_hook)
        self._comm_hook = comm_hook
        if self._rings and self._rings[0].rank() == 0:
            log.info("lit_dp.DataParallel: communication hook %s", comm_hook.name)

    def _set_static_graph(self) -> None:
        """torch DDP's way to set ``static_graph`` after construction; like DDP, only before training."""
        with self._logging_errors():
            if self._trained:
                raise RuntimeError(
                    "lit_dp.DataParallel._set_static_graph(): it should be called before training loop starts "
                    "(torch DDP's rule); pass static_graph=True to the constructor instead."
                )
        self.static_graph = True
        if self._reducer is not None:
            self._reducer.set_static_graph()

    @contextmanager
    def _logging_errors(self) -> Iterator[None]:
        """Keep the message of an error raised inside for ``_get_ddp_logging_data`` (as DDP logs its own)."""
        try:
            yield
        except (TypeError, ValueError, RuntimeError) as error:
            self._logged_error = str(error)
            raise

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch DDP's debugging summary, under DDP's keys, for what lit_dp has: the construction's
        choices, the parameters, the synchronised iterations so far and the last error raised by an
        API call (``has_error``, ``error``). DDP's environment and per-iteration timing keys are absent."""
        params = [param for param in self.module.parameters() if param.requires_grad]
        group = self.process_group
        reducer = self._reducer
        return {
            "module_name": type(self.module).__name__,
            "world_size": group.size() if group is not None else 1,
            "rank": group.rank() if group is not None else 0,
            "backend_name": groups.backend_name(group) if group is not None else "",
            "device_ids": ",".join(map(str, self.device_ids or [])),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": megabytes_to_bytes("comm_buffer_size", self.comm_buffer_size),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "is_multi_device_module": int(self.is_multi_device_module),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
            "bucket_sizes": ", ".join(map(str, reducer.bucket_bytes)) if reducer is not None else "",
            "iteration": reducer.step + 1 if reducer is not None else 0,
            "has_error": int(self._logged_error is not None),
            "error": self._logged_error or "",
        }

    @property
    def local_sgd(self) -> Any:
        """Deprecated: ``model.join_state.local_sgd`` (the model itself no longer reads its LocalSGD)."""
        warnings.warn(_MOVED_TO_JOIN_STATE.format("DataParallel.local_sgd"), LitDPDeprecationWarning, stacklevel=2)
        return self.join_state.local_sgd

    def use_local_sgd(self, local_sgd: Any) -> None:
        """Deprecated: a ``lit_dp.LocalSGD`` tells its model itself (``join_state.driven_by``, ``keep_gradients_local``)."""
        warnings.warn(_MOVED_TO_JOIN_STATE.format("DataParallel.use_local_sgd"), LitDPDeprecationWarning, stacklevel=2)
        self.join_state.driven_by(local_sgd)
        self.keep_gradients_local(local_sgd.in_local_phase)

    def __getstate__(self) -> dict[str, Any]:
        """As torch DDP: only a model on the default group can be pickled or deep-copied; the
        process group, the reducer and the observers stay behind (``__setstate__`` rebuilds)."""
        if self._manager is not None:
            raise RuntimeError(
                f"lit_dp.DataParallel: pickling and copy.deepcopy of a {UNDER_MANAGER} are not supported: the copy "
                "would average over the default process group instead of the replica groups. Copy the inner module "
                "(model.module) and wrap the copy instead."
            )
        if self._rings and self._given_group is not None and self._given_group is not default_group():
            raise RuntimeError(
                "lit_dp.DataParallel: pickling and copy.deepcopy need the default process group, as in torch DDP "
                "(DDP Pickling/Unpickling are only supported when using DDP with the default process group); this "
                f"model averages over a group of {self._rings[0].size()} given as process_group/group. Copy "
                "the inner module (model.module) and wrap the copy instead."
            )
        state = dict(self.__dict__)
        state["_had_group"] = bool(self._rings)
        if self._options.comm_buffer_size == AUTO:
            state["_options"] = self._options.replace(comm_buffer_size=self.comm_buffer_size)  # what tuning chose
        for name in _RUNTIME_STATE:
            state.pop(name, None)
        state["_given_group"] = None  # the default group, found again when unpickled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_group = state.pop("_had_group")
        super().__setstate__(state)
        if had_group and not dist.is_initialized():
            raise RuntimeError(
                "lit_dp.DataParallel: unpickling a model trained data-parallel needs the default process group; "
                "call init_process_group (or lit_dp.init_parallel_env) first, or unpickle the inner module."
            )
        # A copy averages its own gradients (a second reducer over its own parameters), as DDP's does.
        self._build_runtime(get_rings() if had_group else [], copy=True)
        self._buffer_group = self._rings[0] if self._rings else None


def default_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None
