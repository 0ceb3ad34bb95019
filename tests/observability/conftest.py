"""The 2-rank run shared by the statistics, trace and autotune tests (``tests.helpers.observability``)."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.observability import stats_trace_and_autotune


@pytest.fixture(scope="package")
def two_ranks(tmp_path_factory) -> tuple[dict, object]:
    """Each rank's results of ``stats_trace_and_autotune``, and the trace folder."""
    trace_dir = tmp_path_factory.mktemp("trace")
    return run_ranks(stats_trace_and_autotune, 2, str(trace_dir), timeout=120), trace_dir
