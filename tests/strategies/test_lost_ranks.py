"""When rank 0 fails, the ranks it started end too (``lit_dp.strategies.lost_ranks``).

A dead child rank named with its exit status is tested with the recipes' runs in
``test_preemption.py``; here rank 0 fails before the rendezvous, where its child would otherwise
wait for rank 0's store until the process group's timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from lit_dp.strategies.lost_ranks import STARTED_RANKS_GRACE_SECONDS, _defer_lightnings_observer
from tests.helpers.jobs import alive, alive_after, kill_session

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "rank_zero_fails_early.py"
# The grace, then rank 0's teardown and the interpreters' exits on a loaded machine: far below
# the script's process-group timeout (600 s), which is how long rank 1 used to wait.
ENDS_WITHIN = STARTED_RANKS_GRACE_SECONDS + 75


def test_lightnings_observer_lets_rank_0_report_a_dead_rank_before_it_ends_the_job():
    # Lightning's own observer thread (its loop sleeps before each check); its "main process" is a
    # stand-in sleeper, so that the SIGKILL it sends at the end reaches that and not pytest.
    dead_rank = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    rank_0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_rank.wait(timeout=30)
        observer = _ChildProcessObserver(main_pid=rank_0.pid, child_processes=[dead_rank], sleep_period=0.2)
        observer.start()
        grace = 2.0
        _defer_lightnings_observer(grace)
        assert observer._run() is False  # the death is seen, and rank 0 given its grace
        time.sleep(grace / 2)
        assert rank_0.poll() is None, "the observer ended the job within the grace"
        rank_0.wait(timeout=30)  # then, as Lightning does, it ends the job
        assert rank_0.returncode == -9
    finally:
        rank_0.kill()
        rank_0.wait()


@pytest.mark.slow
def test_when_rank_0_fails_before_the_rendezvous_the_rank_it_started_is_ended(tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environ = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    with open(tmp_path / "output.txt", "w") as output:
        launcher = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path)], cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT,
            env=environ, start_new_session=True,
        )  # fmt: skip
        try:
            try:
                launcher.wait(timeout=ENDS_WITHIN)
            except subprocess.TimeoutExpired:
                pids = [int(path.name) for path in (tmp_path / "pids").iterdir()]
                raise AssertionError(
                    f"rank 0 (pid {launcher.pid}) did not end within {ENDS_WITHIN:.0f} s; alive: {alive(pids)}:\n"
                    f"{(tmp_path / 'output.txt').read_text()[-3000:]}"
                ) from None
            deadline = time.monotonic() + 60  # rank 1's interpreter may start after rank 0 failed
            while len(list((tmp_path / "pids").iterdir())) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            pids = [int(path.name) for path in (tmp_path / "pids").iterdir()]
            left = alive_after(pids, 15)
            ended = time.monotonic() - started
        finally:
            kill_session(launcher)
    text = (tmp_path / "output.txt").read_text()
    assert launcher.returncode != 0, text[-3000:]
    assert "RuntimeError: rank 0 failed before the rendezvous" in text, text[-3000:]
    assert len(pids) == 2, f"rank 1 never started: {text[-3000:]}"
    assert not left, f"processes {left} of the job outlived it:\n{text[-3000:]}"
    assert "lit_dp: rank 1 (pid " in text and "was ended: without rank 0 it could not finish." in text, text[-3000:]
    assert ended < ENDS_WITHIN, f"the job ended {ended:.0f} s after it started"
