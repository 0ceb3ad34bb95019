"""Which backends a job may name: auto, any backend torch.distributed has here, per-device forms."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lit_dp.job.backends import available_backends, check_backend, uses_nccl


def test_auto_available_and_per_device_forms_pass_normalised():
    assert check_backend("backend", " AUTO ") == "auto"
    assert check_backend("backend", "Gloo") == "gloo"
    assert check_backend("backend", "cpu:gloo, cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert "gloo" in available_backends() and "undefined" not in available_backends()


def test_nccl_is_recognised_in_a_per_device_form():
    assert uses_nccl("nccl") and uses_nccl("cpu:gloo,cuda:nccl") and not uses_nccl("gloo")


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("no_such", r"backend='no_such' is invalid: expected 'auto', a backend .* available here \(gloo, nccl"),
        ("cpu:gloo,cuda:no_such", r"backend\(s\) 'no_such' are not available .*; available: gloo, nccl"),
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
