"""A training script written for torch DDP, moved to lit_dp by changing two lines, under torchrun.

``tests/scripts/gpt_train.py`` (nanoGPT's idioms: ``init_process_group``, ``DDP(model)``,
accumulation through ``require_backward_grad_sync``, ``raw_model = model.module``, gradient
clipping, ``destroy_process_group``) runs on 2 CPU processes once with torch DDP and once with
``lit_dp.DataParallel``. The losses must agree step for step, and so must the number of
synchronised backwards (one per iteration: accumulation keeps the others local). Same data, same
initial model (rank 0's, broadcast at construction), same averaged gradients: the losses are
compared at float tolerance, though on 2 ranks they come out bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "gpt_train.py"
ITERATIONS = 12
TIMEOUT = 300


def torchrun(tmp_path: Path, wrapper: str, init: str = "torch") -> dict:
    out = tmp_path / f"{wrapper}-{init}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--wrapper", wrapper, "--init", init, "--iterations", str(ITERATIONS), "--out", str(out),
    ]  # fmt: skip
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"torchrun ({wrapper}, init {init}) did not finish within {TIMEOUT}s:\n{expired.stderr}")
    # torchrun's own report names the rank that failed and its traceback.
    assert done.returncode == 0, f"torchrun ({wrapper}, init {init}) failed:\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    """The run with torch DDP, the reference of both tests."""
    return torchrun(tmp_path_factory.mktemp("ddp"), "ddp")


@pytest.mark.slow
def test_a_ddp_script_gives_ddps_losses_and_communication_after_the_two_line_change(tmp_path, ddp):
    ours = torchrun(tmp_path, "lit_dp")
    assert len(ours["losses"]) == len(ddp["losses"]) == ITERATIONS
    for step, (loss, expected) in enumerate(zip(ours["losses"], ddp["losses"])):
        torch.testing.assert_close(loss, expected, msg=lambda m: f"iteration {step}: lit_dp's loss differs: {m}")
    assert ddp["synchronised"] == ours["synchronised"] == ITERATIONS, "one synchronised backward per iteration"
    torch.testing.assert_close(ours["weights"], ddp["weights"])


@pytest.mark.slow
def test_the_two_line_change_includes_lit_dps_init(tmp_path, ddp):
    ours = torchrun(tmp_path, "lit_dp", init="lit_dp")
    torch.testing.assert_close(ours["losses"], ddp["losses"])
    assert ours["synchronised"] == ITERATIONS
