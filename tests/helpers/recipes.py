"""Running the recipes and benchmarks as a user does, and composing their configs."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from lit_dp_recipes.config import register_configs

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def run_recipe(name: str, *overrides: str, timeout: float = 240, env: dict[str, str] | None = None) -> str:
    """``python recipes/<name>.py overrides...``; its output, or a failure showing the end of it."""
    return _run([sys.executable, str(ROOT / "recipes" / f"{name}.py"), *overrides], f"recipes/{name}.py", timeout, env)


def run_recipe_on_a_terminal(name: str, *overrides: str, columns: int = 120, timeout: float = 240) -> str:
    """``run_recipe`` with standard output and error on a pseudo-terminal ``columns`` wide, as in a
    user's terminal; ``columns=0``: a terminal nobody sized (``script`` started without a terminal).
    Where the recipes see its width they draw progress bars; piped, or on a terminal of no width,
    they print a line per validation instead (``lit_dp_recipes.callbacks.ProgressLines``)."""
    master, terminal = pty.openpty()
    set_terminal_size(terminal, columns)
    chunks: list[bytes] = []
    reader = threading.Thread(target=_read_until_closed, args=(master, chunks), daemon=True)
    reader.start()
    try:
        _run([sys.executable, str(ROOT / "recipes" / f"{name}.py"), *overrides], f"recipes/{name}.py", timeout,
             None, stdout=terminal, stderr=terminal, output=lambda: b"".join(chunks).decode(errors="replace"))
    finally:
        os.close(terminal)
        reader.join(timeout=30)
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def set_terminal_size(descriptor: int, columns: int, rows: int = 40) -> None:
    """The size a (pseudo-)terminal reports; ``columns=0``: none (rows 0 too, as an unsized one reports)."""
    fcntl.ioctl(descriptor, termios.TIOCSWINSZ, struct.pack("HHHH", rows if columns else 0, columns, 0, 0))


def _read_until_closed(descriptor: int, chunks: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(descriptor, 65536)
        except OSError:  # EIO: every process holding the terminal has closed it
            return
        if not chunk:
            return
        chunks.append(chunk)


def torchrun_recipe(name: str, *overrides: str, cwd: Path, max_restarts: int, timeout: float) -> str:
    """``torchrun --standalone --nproc-per-node=2 --max-restarts=N recipes/<name>.py overrides...`` run
    from ``cwd``; its output, whose end the failure shows (torchrun's report names the failed rank)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command = [*launcher, f"--max-restarts={max_restarts}", str(ROOT / "recipes" / f"{name}.py"), *overrides]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{output[-4000:]}"
    return output


def run_benchmark(name: str, *overrides: str, timeout: float = 240) -> str:
    """``python -m benchmarks.<name> overrides...`` from the repository root; its output."""
    return _run([sys.executable, "-m", f"benchmarks.{name}", *overrides], f"benchmarks/{name}.py", timeout, None)


def _run(command: list[str], label: str, timeout: float, env: dict[str, str] | None, stdout: Any = subprocess.PIPE,
         stderr: Any = subprocess.PIPE, output: Any = None) -> str:
    """``command`` from the repository root; its output (``output()`` where it goes elsewhere than a pipe)."""
    # The repository root on the path, so that a recipe's `+callbacks.probe._target_=tests.helpers...`
    # finds the test helpers (a script's own path is its folder, recipes/).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        command,
        cwd=ROOT,
        stdout=stdout,
        stderr=stderr,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {}), "PYTHONPATH": path},
    )
    printed = (result.stdout or "") + (result.stderr or "") if output is None else output()
    assert result.returncode == 0, f"{label} failed ({result.returncode}):\n{printed[-4000:]}"
    return printed


def final_metrics(output: str) -> dict[str, float]:
    line = next(line for line in output.splitlines() if line.startswith("[lit_dp] final "))
    return {key: float(value) for key, value in re.findall(r"(\w+)=([-\d.]+)", line)}


def model_metrics(output: str) -> dict[str, float]:
    """The final metrics of the model (``val_*``, ``train_*``), not timings, which vary from run to run."""
    return {name: value for name, value in final_metrics(output).items() if name.startswith(("val_", "train_"))}


def compose_config(name: str, overrides: list[str], tmp_path: Path):
    """The recipe config ``name`` with ``overrides``, writing under ``tmp_path``."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=[f"paths.output_dir={tmp_path}", *overrides])
