"""`python -m benchmarks.gpt_recipe`: the variants' table, the bad options it refuses, and the guards
that hold the recipe to its bare loop on CPU where a GPU would show the difference: the recipe on one
rank compiles the bare loop's graphs, and its step dispatches the bare loop's operators plus a
budget named op by op."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from benchmarks.gpt_recipe import BareLoop, Measured, check_config, report, write_random_shards
from lit_dp.gradients.group import as_if_many_ranks
from lit_dp_recipes.train import train
from tests.helpers.probes import OpsPerStep, counting_ops
from tests.helpers.recipes import QUIET, compose_config, run_benchmark

TINY = [
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=16", "data.batch_size=4",
    "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "callbacks.throughput.warmup=2",
    "compile=true", "compile_backend=aot_eager",
]
# What one step of the recipe dispatches beyond the bare loop's, every one Lightning's (found with a
# stack per operator): `self.log("train_loss", loss)` clones, detaches and squeezes the value
# (core/module.py) and its result collection clones it (result.py); the closure keeps a detached
# clone of the loss (loops/optimization/automatic.py); the step's output is detached
# (utilities/memory.py) and so is the loss the precision plugin hands back (plugins/precision).
# lit_dp's own share at one rank is none: no flag, no copy, no collective.
LIGHTNING_OPS = Counter({"aten.detach.default": 4, "aten.clone.default": 3, "aten.squeeze.default": 1})


def table(report_text: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in report_text.splitlines() if line.startswith("| "))
    }


@pytest.mark.slow
def test_benchmark_reports_every_variant_its_ratio_and_no_recompiles(tmp_path):
    report_text = run_benchmark("gpt_recipe", *TINY, f"hydra.run.dir={tmp_path}", timeout=600)
    rows = table(report_text)
    assert list(rows)[1:] == ["bare", "recipe", "no_clip", "unwatched", "multi_rank", "multi_rank_no_breaks"]
    bare_rate = float(rows["bare"][2].replace(",", ""))
    for name in list(rows)[1:]:
        what, ms, rate, ratio, fast_ms, fast_ratio, mfu, host_ms, busy, idle, kernels, recompiles = rows[name]
        rate = float(rate.replace(",", ""))
        assert rate > 0 and float(ms) == pytest.approx(4 * 16 / rate * 1e3, rel=0.01)
        assert float(ratio) == pytest.approx(rate / bare_rate, abs=1e-3 + 1 / bare_rate)  # rates are printed rounded
        assert float(host_ms) > 0 and float(fast_ms) > 0
        assert float(fast_ratio) == pytest.approx(float(fast_ms) / float(rows["bare"][4]), abs=0.01)
        assert mfu == busy == idle == kernels == "n/a"  # no peak known for a CPU, no profiler off CUDA
        assert recompiles == "0"  # validation at steps 3 and 6, inside the measured steps: nothing recompiled
    assert "GPT 1 x 32" in report_text and "batch 4 x 16" in report_text
    assert not list(tmp_path.glob("**/*.ckpt"))  # the recipe ran without its checkpoints, as the bare loop does


@pytest.mark.slow
def test_at_two_devices_each_variant_runs_as_a_command_of_its_own(tmp_path):
    tiny = [o for o in TINY if not o.startswith("compile")]
    report_text = run_benchmark(
        "gpt_recipe", *tiny, "trainer.devices=2", "variants=[recipe,ddp]", f"hydra.run.dir={tmp_path}", timeout=600
    )
    rows = table(report_text)
    assert list(rows)[1:] == ["recipe", "ddp"]
    assert "2 device(s)" in report_text
    for name in ("recipe", "ddp"):
        assert float(rows[name][2].replace(",", "")) > 0
        assert rows[name][-1] == "n/a"  # nothing compiled: the recipe logs no recompiles then


def test_the_report_names_each_variant_and_divides_by_the_first(tmp_path):
    cfg = compose_config("gpt", ["experiment=gpt_bench_cpu", "model.n_layer=1", "trainer.devices=1"], tmp_path)
    bare = [Measured(1000.0, 2.0, host_cpu_ms=1.5, fast_ms=1.6), Measured(900.0, 2.2, fast_ms=1.8)]
    recipe = [Measured(980.0, 2.1, recompiles=0, fast_ms=1.7), Measured(880.0, 2.3, recompiles=0, fast_ms=1.9)]
    text = report(cfg, {"bare": bare, "recipe": recipe})
    rows = table(text)
    assert rows["recipe"][:6] == ["recipe (Lightning, paddle_dp)", "2.20", "930", "0.979", "1.80", "1.059"]
    assert rows["bare"][7] == "1.50" and rows["recipe"][7] == "n/a" and rows["recipe"][-1] == "0"
    assert "recipe / bare per round: 0.980, 0.978" in text
    assert "recipe's fastest-tenth step time / bare's per round: 1.062, 1.056" in text


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=2", r"trainer.max_steps=2 is invalid here: expected more steps than callbacks.throughput.warmup=10\."),
        ("trainer.devices=2", r"trainer.devices=2 with variants containing bare is invalid: the bare loop runs on one device"),
        ("trainer.precision=16-mixed", r"trainer.precision='16-mixed' is invalid here: expected one of 32-true, 32, bf16-mixed"),
        ("rounds=0", r"rounds=0 is invalid: expected an integer >= 1"),
        ("variants=[recipe,fast]", r"variants=\['recipe', 'fast'\] is invalid: expected some of bare, recipe, no_clip"),
    ],
)
def test_bad_benchmark_options_are_named_before_anything_runs(tmp_path, override, message):
    # The benchmark's config is the recipe's with these keys (benchmarks/conf/gpt_recipe.yaml).
    cfg = compose_config("gpt", ["experiment=gpt_bench_cpu", "trainer.devices=1"], tmp_path)
    with open_dict(cfg):
        cfg.rounds, cfg.profile_steps, cfg.variants = 1, 10, ["bare", "recipe"]
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override]))
    with pytest.raises(ValueError, match=message):
        check_config(cfg)


def recipe_config(tmp_path: Path, *overrides: str):
    """A small GPT on random tokens, one device, the recipe's step callbacks but no checkpoints."""
    cfg = compose_config(
        "gpt",
        [
            *QUIET, "experiment=gpt_bench_cpu", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
            "data.block_size=16", "data.batch_size=4", "trainer.devices=1", "trainer.max_steps=5",
            "trainer.val_check_interval=5", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=50", "ckpt_path=null",
            "~callbacks.model_checkpoint", "~callbacks.step_checkpoint", "callbacks.throughput.warmup=1", *overrides,
        ],
        tmp_path,
    )
    train_path, val_path = write_random_shards(cfg, tmp_path)
    with open_dict(cfg):
        cfg.data.train_shards, cfg.data.val_shards = train_path, val_path
    return cfg


@pytest.mark.slow
def test_a_recipe_step_dispatches_the_bare_loops_operators_and_lightnings_few_more(tmp_path):
    # The GPU configuration: bf16 autocast, the fused AdamW, clipping; paddle_dp on one rank.
    cfg = recipe_config(tmp_path, "trainer.precision=bf16-mixed", "+callbacks.ops._target_=tests.helpers.probes.OpsPerStep")
    assert cfg.trainer.gradient_clip_val == 1.0 and cfg.strategy._target_ == "lit_dp.PaddleDPStrategy"
    loop = BareLoop(cfg, cfg.data.train_shards, cfg.data.val_shards)
    assert loop.optimizer.defaults["fused"]
    for step in range(3):
        loop.step(step)
    with counting_ops() as bare:
        loop.step(3, fetch=False)  # the recipe's loader fetches outside the step too
    train(cfg)
    recipe = OpsPerStep.counted
    assert sum(bare.values()) > 200  # forward, backward, clipping and the optimizer, all counted
    assert not bare - recipe, "the recipe skipped part of the step"
    extra = recipe - bare
    assert all(extra[op] <= LIGHTNING_OPS[op] for op in extra), f"beyond the budget: {dict(extra - LIGHTNING_OPS)}"


def graphs_compiled(run) -> int:
    """How many graphs the backend compiled during ``run()`` (AOT autograd's, one per piece of a split graph)."""
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["aot_autograd"]["total"]
    run()
    return torch._dynamo.utils.counters["aot_autograd"]["total"] - before


@pytest.mark.slow
def test_the_compiled_recipe_on_one_rank_compiles_as_many_graphs_as_the_bare_loop(tmp_path):
    # 6 MB of parameters in 1 MB buckets: where communication can overlap backward, dynamo splits the
    # graph at the buckets (many ranks' path); on one rank there is nothing to overlap.
    cfg = recipe_config(
        tmp_path, "model.n_embd=256", "model.n_head=4", "compile=true", "compile_backend=aot_eager", "strategy.comm_buffer_size=1"
    )

    def bare() -> None:
        loop = BareLoop(cfg, cfg.data.train_shards, cfg.data.val_shards)
        loop.evaluate(1)
        for step in range(3):
            loop.step(step)

    def many_ranks() -> None:
        with as_if_many_ranks():
            train(cfg)

    bare_graphs = graphs_compiled(bare)
    assert graphs_compiled(lambda: train(cfg)) == bare_graphs
    assert graphs_compiled(many_ranks) > bare_graphs + 2  # the same count sees the splits where they buy overlap
