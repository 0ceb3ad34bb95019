"""A rank started by lit_dp's launcher ends with the process that started it (``lit_dp.job.orphans``).

Real processes, no torch: a launcher (a small Python process) starts a rank the way lit_dp's
launchers do (``launcher_environment``), the rank binds itself as ``import lit_dp`` does, and the
test kills the launcher the way nothing in it can answer (SIGKILL). The test kills what is left by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lit_dp.job.orphans import GONE_STATUS, LAUNCHER_PID, bind_to_launcher
from tests.helpers.recipes import ROOT

# lit_dp.job.orphans loaded from its file, without `import lit_dp` and the torch it loads (seconds per process).
LOAD = textwrap.dedent(
    f"""
    import importlib.util
    spec = importlib.util.spec_from_file_location("orphans", {str(ROOT / "lit_dp" / "job" / "orphans.py")!r})
    orphans = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(orphans)
    """
)
# The rank: binds itself, says it is ready, then waits far longer than any test does.
RANK = LOAD + textwrap.dedent(
    """
    import os, sys, time
    if sys.argv[1] == "watch":  # the fallback where there is no parent-death signal (macOS)
        orphans.POLL_SECONDS = 0.1
        orphans._parent_death_signal = lambda signum: False
    orphans.bind_to_launcher()
    print(os.getpid(), os.environ.get(orphans.LAUNCHER_PID), flush=True)
    time.sleep(600)
    """
)
# The launcher: starts the rank bound to itself, passes on its line, then waits to be killed.
LAUNCHER = LOAD + textwrap.dedent(
    """
    import os, subprocess, sys, time
    rank = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]], env=orphans.launcher_environment(dict(os.environ)),
                            stdout=subprocess.PIPE, text=True)
    print(rank.stdout.readline().strip(), flush=True)
    time.sleep(600)
    """
)
ENDS_WITHIN = 15  # seconds: the kernel's signal is immediate, the watcher polls every 0.1 s here


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.parametrize("binding", ["parent-death signal", "watch"])
def test_a_rank_ends_when_its_launcher_is_killed(binding, tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "rank.py"), binding],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rank = None
    try:
        line = launcher.stdout.readline().split()
        assert line, "the rank did not start"
        rank, variable = int(line[0]), line[1]
        assert variable == "None", "the rank's own children must not inherit the binding"
        launcher.kill()  # SIGKILL: no handler of the launcher's runs
        launcher.wait(timeout=30)
        deadline = time.monotonic() + ENDS_WITHIN
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank), f"the rank (pid {rank}) outlived its launcher by {ENDS_WITHIN} s ({binding})"
    finally:
        for pid in (launcher.pid, rank):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)


def test_a_rank_whose_launcher_died_before_it_bound_itself_ends_at_once_saying_why(tmp_path):
    # While a rank imports torch its launcher may die: the parent the rank finds is then not its launcher.
    (tmp_path / "rank.py").write_text(RANK)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    done = subprocess.run([sys.executable, str(tmp_path / "rank.py"), "parent-death signal"], check=False, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), LAUNCHER_PID: str(gone.pid),
                                                      "LOCAL_RANK": "1"})
    assert done.returncode == GONE_STATUS
    assert done.stderr.strip().endswith(f"[lit_dp] local rank 1 (pid {done.stderr.split('(pid ')[1].split(')')[0]}): "
                                        f"the process that started it (pid {gone.pid}) is gone; ending it")
    assert done.stdout == ""


def test_a_malformed_launcher_pid_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(LAUNCHER_PID, "abc")
    with pytest.raises(ValueError, match=rf"^{LAUNCHER_PID}='abc' is invalid: expected the pid of the process that"):
        bind_to_launcher()
    monkeypatch.delenv(LAUNCHER_PID, raising=False)
    bind_to_launcher()  # unset: nothing to bind (this test process is nobody's rank)
