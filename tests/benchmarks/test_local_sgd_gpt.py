"""benchmarks/local_sgd_gpt.py and benchmarks/local_sgd_sweep.py, shrunk: every mode runs and is reported."""

from __future__ import annotations

import re

import pytest

from tests.helpers.recipes import run_benchmark

TINY = '["data.max_bytes=30000","data.block_size=32","data.batch_size=4","model.n_layer=1","model.n_embd=32","model.n_head=2","model.warmup_steps=1","callbacks.throughput.warmup=1","trainer.limit_val_batches=1"]'


@pytest.mark.slow
@pytest.mark.timeout(1200)  # five recipe runs of 2 ranks, a few minutes on a loaded 2-core machine
def test_gpt_benchmark_reports_every_mode_with_its_traffic(tmp_path):
    output = run_benchmark(
        "local_sgd_gpt", "local_steps=[2]", "max_steps=4", "fragments=[2]", f"extra={TINY}", f"hydra.run.dir={tmp_path}",
        timeout=1100,
    )  # fmt: skip
    rows = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(r"^\| ([\w +=]+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", output, re.M)
    }
    assert set(rows) == {"data parallel", "average K=2", "nesterov K=2", "nesterov+bf16 K=2", "nesterov F=2 K=2"}, output
    assert float(rows["average K=2"][2]) == pytest.approx(0.5, abs=0.01)  # an average every 2 steps: half DP's bytes
    assert float(rows["nesterov+bf16 K=2"][2]) == pytest.approx(0.25, abs=0.01)
    # Streaming: the same bytes per step, about half the model per sync (two fragments of whole tensors).
    assert float(rows["nesterov F=2 K=2"][2]) == pytest.approx(0.5, abs=0.01)
    assert 0.3 < float(rows["nesterov F=2 K=2"][3]) / float(rows["nesterov K=2"][3]) < 0.7, output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sweep_reports_every_mode(tmp_path):
    output = run_benchmark(
        "local_sgd_sweep", "steps=4", "local_steps=[2]", "outer=[[0.8,0.5]]", "val_batches=1", f"hydra.run.dir={tmp_path}"
    )
    for mode in ("data parallel", "averaging K=2", "nesterov K=2 lr=0.8 momentum=0.5"):
        assert re.search(rf"^\| {mode} \| \d+\.\d{{4}} \|$", output, re.M), output
