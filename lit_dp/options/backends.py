"""Which torch.distributed backends a job may name, checked before any process starts.

Like Lightning's ``DDPStrategy(process_group_backend=...)``, lit_dp passes any backend that
``torch.distributed`` reports available on this machine through to ``init_process_group``:
``gloo``, ``nccl``, ``mpi``, ``ucc``, ``xccl``, one registered with
``torch.distributed.Backend.register_backend``, or torch's per-device form
``"cpu:gloo,cuda:nccl"``. ``auto`` is lit_dp's own: NCCL for CUDA devices, Gloo otherwise.
"""

from __future__ import annotations

import torch.distributed as dist

AUTO = "auto"
PER_DEVICE_EXAMPLE = "cpu:gloo,cuda:nccl"


def available_backends() -> list[str]:
    """The backends ``torch.distributed`` reports available in this process, in torch's order."""
    return [name for name in dist.Backend.backend_list if name != "undefined" and dist.is_backend_available(name)]


def check_backend(option: str, value: object) -> str:
    """``value`` lower-cased if it is ``auto``, an available backend or a per-device form of them.

    Raises:
        ValueError: naming ``option``, the value and the backends available here.
    """
    available = available_backends()
    expected = (
        f"'{AUTO}', a backend torch.distributed reports available here ({', '.join(available)}), "
        f"or a per-device form such as '{PER_DEVICE_EXAMPLE}'"
    )
    if not isinstance(value, str):
        raise ValueError(f"{option}={value!r} is invalid: expected {expected}.")
    name = value.strip().lower()
    if name == AUTO or name in available:
        return name
    if ":" not in name:
        raise ValueError(f"{option}={value!r} is invalid: expected {expected}{_missing_nccl_hint([name])}.")
    pairs = [item.strip().partition(":") for item in name.split(",")]
    devices = [device.strip() for device, _, _ in pairs]
    unavailable = [backend.strip() for _, _, backend in pairs if backend.strip() not in available]
    if any(not sep or not device for (device, sep, _) in pairs) or len(set(devices)) != len(devices):
        raise ValueError(
            f"{option}={value!r} is invalid: expected '<device>:<backend>' pairs separated by commas, one per "
            f"device type, such as '{PER_DEVICE_EXAMPLE}'."
        )
    if unavailable:
        raise ValueError(
            f"{option}={value!r} is invalid: backend(s) {', '.join(map(repr, unavailable))} are not available "
            f"in this torch.distributed; available: {', '.join(available)}{_missing_nccl_hint(unavailable)}."
        )
    return ",".join(f"{device}:{backend.strip()}" for device, (_, _, backend) in zip(devices, pairs))


def _missing_nccl_hint(unavailable: list[str]) -> str:
    # The usual cause: a CPU build of torch (`torch.version.cuda is None`), which has no NCCL at all.
    if "nccl" not in unavailable or dist.is_nccl_available():
        return ""
    return " (this torch build has no NCCL: install a CUDA build of torch for NCCL, or use gloo)"


def uses_nccl(backend: str) -> bool:
    """Whether ``backend`` (resolved, possibly per-device) runs NCCL for CUDA tensors."""
    return backend == "nccl" or "cuda:nccl" in backend.split(",")
