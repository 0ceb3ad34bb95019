"""`python -m benchmarks.gpt_recipe`: the bare loop and the recipe on one config, their ratio and recompiles."""

from __future__ import annotations

import pytest

from benchmarks.gpt_recipe import check_config
from tests.helpers.recipes import compose_config, run_benchmark

TINY = [
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=16", "data.batch_size=4",
    "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "callbacks.throughput.warmup=2",
    "compile=true", "compile_backend=aot_eager",
]


@pytest.mark.slow
def test_benchmark_reports_both_runs_their_ratio_and_no_recompiles(tmp_path):
    report = run_benchmark("gpt_recipe", *TINY, f"hydra.run.dir={tmp_path}")
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
    assert not list(tmp_path.glob("**/*.ckpt"))  # the recipe ran without its checkpoints, as the bare loop does


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=2", r"trainer.max_steps=2 is invalid here: expected more steps than callbacks.throughput.warmup=10"),
        ("trainer.devices=2", r"trainer.devices=2 is invalid here: the bare loop runs on one device"),
        ("trainer.precision=16-mixed", r"trainer.precision='16-mixed' is invalid here: expected one of 32-true, 32, bf16-mixed"),
        ("rounds=0", r"rounds=0 is invalid: expected an integer >= 1"),
    ],
)
def test_bad_benchmark_options_are_named_before_anything_runs(tmp_path, override, message):
    # The benchmark's config is the recipe's with these keys (benchmarks/conf/gpt_recipe.yaml).
    cfg = compose_config("gpt", ["experiment=gpt_bench_cpu", "trainer.devices=1", "+rounds=1", override], tmp_path)
    with pytest.raises(ValueError, match=message):
        check_config(cfg)
