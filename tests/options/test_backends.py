"""Which backends a job may name: auto, any backend torch.distributed has here, per-device forms."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lit_dp.options.backends import available_backends, check_backend, uses_nccl

# A CPU build of torch has no NCCL: the per-device forms are checked with what this build has.
CUDA_BACKEND = "nccl" if dist.is_nccl_available() else "gloo"
AVAILABLE = ", ".join(available_backends())


def test_auto_available_and_per_device_forms_pass_normalised():
    assert check_backend("backend", " AUTO ") == "auto"
    assert check_backend("backend", "Gloo") == "gloo"
    assert check_backend("backend", f"cpu:gloo, cuda:{CUDA_BACKEND}") == f"cpu:gloo,cuda:{CUDA_BACKEND}"
    assert "gloo" in available_backends() and "undefined" not in available_backends()


def test_nccl_is_recognised_in_a_per_device_form():
    assert uses_nccl("nccl") and uses_nccl("cpu:gloo,cuda:nccl") and not uses_nccl("gloo")


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("no_such", rf"backend='no_such' is invalid: expected 'auto', a backend .* available here \({AVAILABLE}\)"),
        ("cpu:gloo,cuda:no_such", rf"backend\(s\) 'no_such' are not available .*; available: {AVAILABLE}\."),
        ("cpu:gloo,cpu:nccl", "expected '<device>:<backend>' pairs separated by commas, one per device type"),
        (3, r"backend=3 is invalid: expected 'auto'"),
    ],
)
def test_unavailable_backend_is_a_clear_error(backend, message):
    with pytest.raises(ValueError, match=message):
        check_backend("backend", backend)


@pytest.mark.skipif(dist.is_mpi_available(), reason="checks the error where torch has no MPI")
def test_mpi_without_mpi_names_the_available_backends():
    with pytest.raises(ValueError, match=r"backend='mpi' is invalid: .*available here \(gloo"):
        check_backend("backend", "mpi")


@pytest.mark.skipif(dist.is_nccl_available(), reason="checks the error where this torch build has no NCCL")
def test_nccl_in_a_build_without_it_says_so():
    with pytest.raises(ValueError, match=r"backend\(s\) 'nccl' are not available .*this torch build has no NCCL"):
        check_backend("backend", "cpu:gloo,cuda:nccl")
    with pytest.raises(ValueError, match=r"backend='nccl' is invalid: .*this torch build has no NCCL"):
        check_backend("backend", "nccl")
