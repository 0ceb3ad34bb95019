"""benchmarks/local_sgd_gpt.py and benchmarks/local_sgd_sweep.py, shrunk: every mode runs and is reported."""

from __future__ import annotations

import math
import re

import pytest

from benchmarks.local_sgd_gpt import LocalSGDGPTConfig, _modes, against_fp32, gap_closed, report, with_warmup_traffic
from tests.helpers.recipes import run_benchmark

TINY = '["data.max_bytes=30000","data.block_size=32","data.batch_size=4","model.n_layer=1","model.n_embd=32","model.n_head=2","model.warmup_steps=1","callbacks.throughput.warmup=1","trainer.limit_val_batches=1"]'


@pytest.mark.slow
@pytest.mark.timeout(1200)  # five recipe runs of 2 ranks, a few minutes on a loaded 2-core machine
def test_gpt_benchmark_reports_every_mode_with_its_traffic(tmp_path):
    output = run_benchmark(
        "local_sgd_gpt", "local_steps=[2]", "max_steps=4", "fragments=[2]", f"extra={TINY}", f"hydra.run.dir={tmp_path}",
        timeout=1100,
    )  # fmt: skip
    lines = [line for line in output.splitlines() if re.match(r"^\| (?!mode )[a-z]", line)]
    rows = {cells[0]: cells[1:] for cells in (line.strip("|").split("|") for line in lines) if len(cells) == 11}
    # The second table: DiLoCo in bf16 against DiLoCo in fp32, at half its bytes per step.
    bf16 = [cells for cells in (line.strip("|").split("|") for line in lines) if len(cells) == 5]
    assert [cells[0].strip() for cells in bf16] == ["nesterov+bf16 K=2"], output
    assert float(bf16[0][4]) == pytest.approx(0.5, abs=0.01), output
    rows = {name.strip(): [cell.strip() for cell in cells] for name, cells in rows.items()}
    assert set(rows) == {"data parallel", "average K=2", "nesterov K=2", "nesterov+bf16 K=2", "nesterov F=2 K=2"}, output
    sent_vs_dp = {name: float(cells[4]) for name, cells in rows.items()}
    assert sent_vs_dp["average K=2"] == pytest.approx(0.5, abs=0.01)  # an average every 2 steps: half DP's bytes
    assert sent_vs_dp["nesterov+bf16 K=2"] == pytest.approx(0.25, abs=0.01)
    # Streaming: the same bytes per step, about half the model per sync (two fragments of whole tensors).
    assert sent_vs_dp["nesterov F=2 K=2"] == pytest.approx(0.5, abs=0.01)
    assert 0.3 < float(rows["nesterov F=2 K=2"][5]) / float(rows["nesterov K=2"][5]) < 0.7, output
    # Each DiLoCo row carries its loss above data parallelism's and the fraction of averaging's gap it closes
    # (its value: test_report_computes_the_fraction_of_averagings_gap_closed); the other rows leave them blank.
    loss = {name: float(cells[0]) for name, cells in rows.items()}
    for name in ("nesterov K=2", "nesterov+bf16 K=2", "nesterov F=2 K=2"):
        assert math.isfinite(float(rows[name][2])), (name, output)
        assert float(rows[name][1]) == pytest.approx(loss[name] - loss["data parallel"], abs=2e-4), (name, output)
    assert rows["data parallel"][1:3] == ["", ""] and rows["average K=2"][2] == "", output


def test_report_computes_the_fraction_of_averagings_gap_closed():
    def row(val_loss: float) -> dict[str, float]:
        return {"val_loss": val_loss, "tokens_per_sec": 100.0, "mb_per_step": 1.0, "mb_per_sync": 1.0, "wall_s": 10.0}

    results = {
        "data parallel": row(1.70),
        "average K=16": row(1.80),
        "nesterov K=16": row(1.75),
        "nesterov F=4 K=16": row(1.82),
        "nesterov K=64": row(1.90),
    }
    table = report(results, LocalSGDGPTConfig(local_steps=(16, 64)))
    closed = {line.split("|")[1].strip(): line.split("|")[4].strip() for line in table.splitlines()[2:]}
    # (1.80 - 1.75) / (1.80 - 1.70); worse than averaging is negative; no averaging at K=64, no fraction.
    expected = {"nesterov K=16": "0.50", "nesterov F=4 K=16": "-0.20"}
    assert closed == {name: expected.get(name, "") for name in results}, table
    assert gap_closed(results, "nesterov K=16") == pytest.approx(0.5)


def test_a_warm_up_reaches_every_localsgd_mode_and_counts_in_its_bytes_per_step():
    config = LocalSGDGPTConfig(local_steps=(16,), sync_dtypes=(), warmup_steps=64)
    assert dict(_modes(config)) == {
        "data parallel": [],
        "average K=16": ["strategy.local_sgd.steps=16", "strategy.local_sgd.warmup_steps=64"],
        "nesterov K=16": ["strategy.local_sgd.steps=16", "strategy.local_sgd.warmup_steps=64", "strategy.local_sgd.outer=nesterov"],
    }
    results = with_warmup_traffic({"data parallel": {"mb_per_step": 1.6}, "average K=16": {"mb_per_step": 0.1}}, config)
    assert results["average K=16"]["mb_per_step"] == pytest.approx((64 * 1.6 + 256 * 0.1) / 320)
    assert results["data parallel"]["mb_per_step"] == 1.6
    with pytest.raises(ValueError, match=r"max_steps=320 is invalid with local_steps K=64 and warmup_steps=32"):
        _modes(LocalSGDGPTConfig(local_steps=(64,), warmup_steps=32))


def test_each_wire_format_runs_with_and_without_error_feedback_against_fp32():
    config = LocalSGDGPTConfig(local_steps=(16,), average=False, sync_dtypes=("int4",), error_feedback=(True, False))
    diloco = ["strategy.local_sgd.steps=16", "strategy.local_sgd.outer=nesterov"]
    assert dict(_modes(config)) == {
        "data parallel": [],
        "nesterov K=16": diloco,
        "nesterov+int4 EF K=16": [*diloco, "strategy.local_sgd.sync_dtype=int4", "strategy.local_sgd.error_feedback=True"],
        "nesterov+int4 no EF K=16": [*diloco, "strategy.local_sgd.sync_dtype=int4", "strategy.local_sgd.error_feedback=False"],
    }

    def row(val_loss: float, mb_per_step: float) -> dict[str, float]:
        return {"val_loss": val_loss, "tokens_per_sec": 100.0, "mb_per_step": mb_per_step, "mb_per_sync": 1.0, "wall_s": 10.0}

    results = {
        "data parallel": row(1.70, 1.6),
        "nesterov K=16": row(1.80, 0.1),
        "nesterov+int4 EF K=16": row(1.809, 0.0133),
        "nesterov+int4 no EF K=16": row(1.98, 0.0133),
    }
    compared = against_fp32(results)
    assert list(compared) == ["nesterov+int4 EF K=16", "nesterov+int4 no EF K=16"]
    assert compared["nesterov+int4 EF K=16"] == pytest.approx((1.809, 1.80, 0.5, 0.133))
    table = report(results, config)
    assert "| nesterov+int4 no EF K=16 | 1.9800 | 1.8000 | +10.00% | 0.1330 |" in table, table


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sweep_reports_every_mode(tmp_path):
    output = run_benchmark(
        "local_sgd_sweep", "steps=4", "local_steps=[2]", "outer=[[0.8,0.5]]", "val_batches=1", f"hydra.run.dir={tmp_path}"
    )
    loss = r"\d+\.\d{4}"
    assert re.search(rf"^\| data parallel \| {loss} \|  \|  \|$", output, re.M), output
    assert re.search(rf"^\| averaging K=2 \| {loss} \| {loss} \|  \|$", output, re.M), output  # the workers' own too
    # DiLoCo: also the fraction of averaging's gap closed, from the two rows above.
    row = re.search(rf"^\| nesterov K=2 lr=0.8 momentum=0.5 \| ({loss}) \| {loss} \| (-?\d+\.\d\d) \|$", output, re.M)
    assert row is not None, output
