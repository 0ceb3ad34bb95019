"""Communication hooks: torch DDP's ``register_comm_hook`` contract over lit_dp's dense buckets.

A hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, called once per dense
bucket and synchronised backward; the future's value is the bucket's averaged flat gradient, which
lit_dp writes back into ``.grad``. ``bucket`` offers what torch's own hooks call on
``dist.GradBucket`` (``torch/distributed/algorithms/ddp_comm_hooks/``), so they run unchanged:
``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, the ``fp16/bf16_compress_wrapper``
wrappers, ``powerSGD_hook`` and ``batched_powerSGD_hook``.

Which hook the options choose (``comm_hook``, a named hook such as ``powersgd``, ``comm_dtype``)
is ``lit_dp.options.comm_hooks``'s to say; this module runs the one it is given.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lit_dp.gradients.strides import shaped_like
from lit_dp.gradients.waiting import UNWATCHED, CollectiveHangError, Waiter
from lit_dp.options.comm_hooks import Hook, hook_name, named_hooks


class GradBucket:
    """The surface of ``torch.distributed.GradBucket`` that communication hooks call.

    ``index()`` is the bucket's position among the dense buckets in launch order (0 is reduced
    first, as in DDP); it is stable once the buckets are rebuilt after the first iteration.
    ``buffer()`` holds the bucket's gradients only, flat and not divided by the world size.
    """

    __slots__ = ("_index", "_count", "_buffer", "_params")

    def __init__(self, index: int, count: int, buffer: torch.Tensor, params: list[nn.Parameter]) -> None:
        self._index = index
        self._count = count
        self._buffer = buffer
        self._params = params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        """True for the bucket reduced last in an iteration (PowerSGD counts iterations on it)."""
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor ``buffer()`` and ``gradients()`` return (the compress wrappers do)."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view into ``buffer()`` per parameter, with its sizes and strides (PowerSGD writes through
        them; the layout contract of ``lit_dp.gradients.dense``, as DDP's ``GradBucket.gradients()``)."""
        pieces = self._buffer.split([p.numel() for p in self._params])
        return [shaped_like(piece, param) for piece, param in zip(pieces, self._params)]

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)


class CommHook:
    """A registered ``(state, hook)``: calls the hook per bucket and checks what comes back.

    With Gloo a future completes on a worker thread of the process group, and hooks such as
    PowerSGD issue further collectives from their ``then`` callbacks, i.e. from that thread. Two
    buckets in flight would then issue collectives in an order that differs between ranks, and
    Gloo matches collectives by order (measured: PowerSGD on 2 ranks with several buckets fails
    with a connection reset). So with Gloo a bucket (and any collective lit_dp issues after it)
    waits until the previous bucket's future has completed: ``settle()``. With NCCL a future
    completes as soon as its work is enqueued, callbacks run in the calling thread in order, and
    buckets overlap freely.
    """

    def __init__(self, state: object, hook: Hook, waiter: Waiter = UNWATCHED) -> None:
        check_signature(hook)
        self.state = state
        self.hook = hook
        self.name = hook_name(hook)
        self._in_flight: torch.futures.Future | None = None
        # Hooks communicate on their state's group, by default the world group.
        self._ordered = dist.is_initialized() and dist.get_backend() != "nccl"
        self.waiter = waiter  # the owner's policy for every wait (a deadline under the hang watchdog)

    def check_layout_settled_by(self, step: int) -> None:
        """Raise if the hook keeps per-bucket memory before synchronised ``step``, from which on the
        buckets no longer change (``comm_buffer_size="auto"`` rebuilds them until then).

        Each named hook declares whether its state keeps such memory (``NamedHook.bucket_memory``;
        PowerSGD's error feedback and warm start do), whether it was chosen by name or its state
        passed to ``register_comm_hook``. Other hooks with per-bucket state are the user's to check
        (see docs/comm_hooks.md).
        """
        for named in named_hooks():
            why = named.bucket_memory(self.state, step) if named.bucket_memory is not None else None
            if why is not None:
                raise ValueError(
                    f"comm_buffer_size='auto' rebuilds the buckets until synchronised step {step}, but {self.name} "
                    f"{why}, or a fixed comm_buffer_size."
                )

    def launch(
        self, index: int, count: int, gradients: torch.Tensor, params: list[nn.Parameter]
    ) -> torch.futures.Future:
        """Call the hook on one bucket's flat gradients; returns its future."""
        try:
            future = self.hook(self.state, GradBucket(index, count, gradients, params))
        except Exception as error:
            raise RuntimeError(f"lit_dp: communication hook {self.name} raised on bucket {index}: {error!r}") from error
        # torch._C.Future: what Work.get_future() and Future.then() return (torch.futures.Future derives from it).
        if not isinstance(future, torch._C.Future):
            # torch DDP's error, type and words: "callback must return a torch.futures.Future object".
            raise RuntimeError(
                f"lit_dp: communication hook {self.name}: callback must return a torch.futures.Future object, but "
                f"got {type(future).__qualname__} for bucket {index}; expected a future whose value is the bucket's "
                "averaged flat gradient tensor."
            )
        self._in_flight = future if self._ordered else None
        return future

    def settle(self) -> None:
        """With Gloo, wait for the last bucket's future, so collectives keep one order on every rank."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            self._wait(future, index=None)

    def collect(self, future: torch.futures.Future, index: int, gradients: torch.Tensor) -> None:
        """Wait for the hook's result and write it into ``gradients`` (unless it already is that tensor)."""
        if future is self._in_flight:
            self._in_flight = None
        value = self._wait(future, index)
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]  # a collective's own future holds [tensor]; torch DDP takes its one tensor too
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"lit_dp: communication hook {self.name} returned a future whose value is "
                f"{type(value).__qualname__} for bucket {index}: expected a tensor of {gradients.numel()} elements."
            )
        if value.shape != gradients.shape or value.device != gradients.device or not value.is_floating_point():
            raise ValueError(
                f"lit_dp: communication hook {self.name} returned a tensor of shape {tuple(value.shape)}, "
                f"{value.dtype} on {value.device} for bucket {index}: expected shape {tuple(gradients.shape)} "
                f"(the bucket's flat gradients), a floating-point dtype, on {gradients.device}."
            )
        # torch's compress wrappers return their half-precision buffer; DDP casts it back the same way.
        if value.data_ptr() != gradients.data_ptr() or value.dtype != gradients.dtype or value.stride() != (1,):
            gradients.copy_(value)

    def _wait(self, future: torch.futures.Future, index: int | None) -> Any:
        try:
            return self.waiter.wait_future(future)
        except CollectiveHangError:
            raise  # the watchdog's diagnosis, as it is
        except Exception as error:
            bucket = "a bucket" if index is None else f"bucket {index}"
            raise RuntimeError(f"lit_dp: communication hook {self.name} failed on {bucket}: {error}") from error


def check_signature(hook: object) -> None:
    """torch DDP's checks of a hook given to ``register_comm_hook``, with its error types and words:
    callable, and where annotated, a ``GradBucket`` argument and a ``Future[Tensor]`` result."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. lit_dp.DataParallel.register_comm_hook got {hook!r}.")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a callable without a signature (some builtins)
        return
    parameters = list(signature.parameters.values())
    bucket = _annotation(hook, parameters[1].annotation) if len(parameters) > 1 else inspect.Parameter.empty
    if bucket not in (inspect.Parameter.empty, dist.GradBucket, GradBucket, "dist.GradBucket", "GradBucket"):
        raise ValueError(
            f"Communication hook: bucket annotation should be dist.GradBucket. {hook_name(hook)} annotates {bucket!r}."
        )
    returns = _annotation(hook, signature.return_annotation)
    futures = (torch.futures.Future[torch.Tensor], torch.futures.Future, "torch.futures.Future[torch.Tensor]")
    if returns is not inspect.Signature.empty and returns not in futures:
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
            f"{hook_name(hook)} annotates {returns!r}."
        )


def _annotation(hook: object, annotation: object) -> object:
    """An annotation as an object; one written as a string (``from __future__ import annotations``)
    is evaluated in the hook's module, or kept as the string when that module cannot resolve it."""
    if not isinstance(annotation, str):
        return annotation
    namespace = getattr(inspect.unwrap(hook), "__globals__", {})  # type: ignore[arg-type]
    try:
        return eval(annotation, dict(namespace))  # noqa: S307 - the hook's own annotation, in its own module
    except Exception:  # noqa: BLE001 - a name the module does not define: compare the text
        return annotation

