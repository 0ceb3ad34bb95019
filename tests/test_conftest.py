"""The test session itself: it stops on SIGTERM within seconds, whatever test is running (a CI job's
timeout or cancel), because no test leaves a stop signal's handler behind (``tests/conftest.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.recipes import ROOT

# A test that runs long, after a test of the suite that sets up Fabric's paddle_dp in this process: until
# its teardown the strategy's handlers record SIGTERM to stop at a step, and a test that left them in place
# kept `timeout -s TERM` from stopping the session (issue 52).
LONG = textwrap.dedent(
    """
    import os, time
    from pathlib import Path

    def test_long():
        Path(os.environ["LONG_TEST_STARTED"]).touch()
        time.sleep(300)
    """
)
STOPS_WITHIN = 20  # seconds


@pytest.mark.slow
def test_sigterm_stops_the_session_within_seconds_after_a_test_that_set_up_fabric_in_process(tmp_path):
    (tmp_path / "test_long.py").write_text(LONG)
    started = tmp_path / "started"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
               "--rootdir", str(ROOT), "tests/strategies/test_fabric.py::test_comm_hooks_and_statistics_through_fabric",
               str(tmp_path / "test_long.py")]
    session = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "LONG_TEST_STARTED": str(started)})
    try:
        deadline = time.monotonic() + 240
        while not started.exists() and session.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), f"the long test never started:\n{session.communicate(timeout=60)[0][-3000:]}"
        session.send_signal(signal.SIGTERM)  # what `timeout -s TERM` sends
        try:
            status = session.wait(timeout=STOPS_WITHIN)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the session ran on {STOPS_WITHIN} s after SIGTERM") from None
        assert status == -signal.SIGTERM, session.communicate(timeout=60)[0][-3000:]
    finally:
        if session.poll() is None:
            session.kill()
            session.wait(timeout=30)
