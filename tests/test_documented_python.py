"""Every Python block the README and docs/ show runs as written (tests/helpers/documented_python.py says how).

Quick tier: every block is valid Python, a fragment says why it is one, and the blocks that
start no process run, together in one process. Slow tier: each block that starts processes runs
as a script of its own. A block fails here when an example stops working, so the docs cannot
drift from the code.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.documented_python import ROOT, python_blocks

BLOCKS = python_blocks()
RUN = [block for block in BLOCKS if block.fragment_reason is None]
TIMEOUT = 240


def _environ() -> dict[str, str]:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "CUDA_VISIBLE_DEVICES"):
        environ.pop(name, None)
    return environ


def test_every_block_is_python_and_every_fragment_says_why():
    assert BLOCKS, "no python block found in the docs"
    for block in BLOCKS:
        assert block.fragment_reason != "", f"{block.source}: '# fragment:' without a reason"
        if block.fragment_reason is None:
            ast.parse(block.code, filename=block.source)
    assert len(RUN) >= len(BLOCKS) // 2, "most blocks should run: a fragment is the exception"


def test_the_blocks_that_start_no_process_run_as_written(tmp_path):
    blocks = [{"source": b.source, "code": b.code} for b in RUN if not b.starts_processes]
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps(blocks))
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.documented_python", str(listing)],
        cwd=work, env=_environ(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in RUN if b.starts_processes], ids=lambda b: b.source)
def test_a_block_that_starts_processes_runs_as_its_own_script(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block.code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_environ(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, f"{block.source}:\n{(done.stdout + done.stderr)[-6000:]}"
