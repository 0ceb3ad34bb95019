"""`python -m benchmarks.gpt_recipe`: the bare loop and the recipe on one config, their ratio and recompiles."""

from __future__ import annotations

import pytest

from benchmarks.gpt_recipe import main

TINY = [
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=16", "data.batch_size=4",
    "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "callbacks.throughput.warmup=2",
    "compile=true", "compile_backend=aot_eager",
]


@pytest.mark.slow
def test_benchmark_reports_both_runs_their_ratio_and_no_recompiles(tmp_path):
    report = main([*TINY, f"output_dir={tmp_path}"])
    rows = {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in report.splitlines() if line.startswith("| "))
    }
    bare, recipe = rows["bare loop (nanoGPT's)"], rows["recipe (Lightning, paddle_dp)"]
    bare_rate, recipe_rate = (float(row[0].replace(",", "")) for row in (bare, recipe))
    assert bare_rate > 0 and recipe_rate > 0
    assert float(bare[1]) == 1.0
    assert float(recipe[1]) == pytest.approx(recipe_rate / bare_rate, abs=1e-3 + 1 / bare_rate)  # rates are printed rounded
    assert bare[2] == recipe[2] == "n/a"  # no peak known for a CPU
    assert bare[3] == recipe[3] == "0"  # validation at steps 3 and 6, inside the measured steps: nothing recompiled
    assert "GPT 1 x 32" in report and "batch 4 x 16" in report


def test_bad_benchmark_options_are_named():
    with pytest.raises(ValueError, match=r"trainer.max_steps=2 is invalid here: expected more steps than callbacks.throughput.warmup=10"):
        main(["trainer.max_steps=2"])
    with pytest.raises(ValueError, match=r"rounds=0 is invalid"):
        main(["rounds=0"])
