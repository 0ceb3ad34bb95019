"""The GPT recipe end to end: text -> shards -> 2-process fits (paddle_dp against ddp), compiled runs, resume."""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest
import torch

from lit_dp_recipes.gpt import GPT, adamw, lr_at
from lit_dp_recipes.train import train
from tests.helpers.documented import gpu_commands, on_device
from tests.helpers.recipes import QUIET, compose_config, final_metrics, run_recipe

TINY_MODEL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "data.batch_size=4"]


def write_texts(folder) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir()
    for index in range(2):
        # Letters with some structure (a repeated phrase), so the loss falls.
        words = rng.choice(["lit", "dp", "paddle", "bucket", "reduce", "the", "grad"], size=2500)
        (folder / f"doc{index}.txt").write_text(" ".join(words))


def last_weights(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_text_to_shards_to_a_2_process_fit_where_paddle_dp_ends_with_ddps_weights(tmp_path):
    write_texts(tmp_path / "texts")
    prepared = run_recipe("prepare_shards", f"input_dir={tmp_path / 'texts'}", f"output_dir={tmp_path / 'shards'}",
                          f"hydra.run.dir={tmp_path / 'prepare'}")
    command = next(line for line in prepared.splitlines() if line.startswith("[lit_dp] train with:"))
    data = re.findall(r"(data\.\w+)='?([^' ]+)'?", command)
    assert [key for key, _ in data] == ["data.train_shards", "data.val_shards", "data.vocab_size"]
    common = [
        *QUIET, *TINY_MODEL, *(f"{key}={value}" for key, value in data),
        "trainer.max_steps=4", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=4",
        "trainer.limit_val_batches=2", "model.warmup_steps=1",
    ]
    ours = run_recipe("gpt", *common, "strategy=paddle_dp", "+callbacks.probe._target_=tests.helpers.probes.SynchronisedSteps",
                      f"hydra.run.dir={tmp_path / 'paddle_dp'}")
    theirs = run_recipe("gpt", *common, "strategy=ddp", f"hydra.run.dir={tmp_path / 'ddp'}")
    # Under accumulation the first micro-batch of each step accumulates locally: no all-reduce.
    probes = sorted(line for line in ours.splitlines() if line.startswith("[probe]"))
    assert probes == [f"[probe] rank={r} synchronised=4 micro_batches=8 optimizer_steps=4" for r in (0, 1)]
    assert "val_loss" in final_metrics(ours) and "val_loss" in final_metrics(theirs)
    ours_weights, ddp_weights = last_weights(tmp_path / "paddle_dp"), last_weights(tmp_path / "ddp")
    assert ours_weights.keys() == ddp_weights.keys()
    for name in ours_weights:
        # Both average the same gradients (divided by the world size, then summed by gloo): the
        # same float operations, so any difference would be a bug, not rounding; assert_close's
        # fp32 defaults leave room only for the order of a sum.
        torch.testing.assert_close(ours_weights[name], ddp_weights[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_bf16_mixed_with_the_fused_adamw_and_clipping_trains_under_ddp_as_under_paddle_dp(tmp_path):
    # Issue 39, 6: under strategy=ddp Lightning's plugin refused to clip the fused AdamW at step 1
    # ("does not allow for gradient clipping because it performs unscaling of gradients internally").
    common = [*QUIET, "experiment=gpt_tiny", "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=0.5",
              "trainer.max_steps=4", "trainer.val_check_interval=4"]
    runs = {}
    for strategy in ("ddp", "paddle_dp"):
        output = run_recipe("gpt", *common, f"strategy={strategy}", f"hydra.run.dir={tmp_path / strategy}")
        assert "val_loss" in final_metrics(output), output[-2000:]
        runs[strategy] = last_weights(tmp_path / strategy)
    # What the runs used: the recipe's AdamW on CPU is the fused kernel (lit_dp_recipes.gpt.adamw).
    assert adamw(GPT(), 1e-3, 0.1, (0.9, 0.95), torch.device("cpu")).defaults["fused"]
    for name in runs["ddp"]:
        # The same gradients, averaged alike, clipped by the same plugin: equal up to the order of a sum.
        torch.testing.assert_close(runs["paddle_dp"][name], runs["ddp"][name], msg=lambda m: f"{name}: {m}")


def _gpu_configurations() -> list:
    """The documented GPU commands run by ``python``, one per recipe and experiment (their configuration)."""
    chosen = {}
    for command in gpu_commands():
        if command.argv[0] != "python" or command.script == "charlm" or any(
            a.startswith("data.train_shards=") and not a.endswith("=...") for a in command.argv
        ):
            # torchrun's is digits' trainer=gpu again; charlm.py is gpt.py under its earlier name
            # (charlm_gpt2 is gpt2_small on bytes); named shards are the user's own.
            continue
        experiment = next((a for a in command.argv if a.startswith(("experiment=", "trainer="))), "")
        chosen.setdefault((command.script, experiment), command)
    return list(chosen.values())


@pytest.mark.slow
@pytest.mark.parametrize("command", _gpu_configurations(), ids=lambda c: c.source)
def test_the_gpu_configurations_run_on_cpu_under_ddp_too(command, tmp_path):
    # The issue-39 peer: what the README offers to compare (bf16-mixed, compiled, the fused AdamW,
    # clipping) trains under strategy=ddp as under paddle_dp, shortened to CPU as on_device says.
    argv = on_device(command, "cpu")
    output = run_recipe(command.script, *argv[2:], *QUIET, "strategy=ddp", f"hydra.run.dir={tmp_path}", timeout=600)
    assert "[lit_dp] strategy=DDPPeer" in output and "[lit_dp] final " in output, output[-2000:]


@pytest.mark.slow
def test_compiled_recipe_recompiles_nothing_after_warmup_and_logs_tokens_per_second_and_mfu(tmp_path):
    output = run_recipe(
        "gpt", *QUIET, "experiment=gpt_tiny", "compile=true", "compile_backend=aot_eager",
        "callbacks.throughput.peak_flops=1e6",  # a made-up peak: CPUs have no entry in the table
        f"hydra.run.dir={tmp_path}",
        env={"TORCH_LOGS": "dynamo,graph_code"},  # dynamo names each function it traces, tagged with the rank
    )
    metrics = final_metrics(output)
    # Validation runs at steps 5 and 10, inside the measured steps (3 to 10): neither it nor the
    # training steps around it compile anything once the warm-up compiled train and no-grad graphs.
    assert metrics["dynamo_recompiles"] == 0
    assert "[lit_dp] dynamo: 2 graphs compiled, 0 after the warm-up" in output
    assert 0 < metrics["val_loss"] < 6.0  # below a uniform guess over 256 bytes (ln 256 = 5.55) plus slack
    assert metrics["tokens_per_sec"] > 0
    flops_per_token = GPT(block_size=32, n_layer=1, n_head=2, n_embd=32).flops_per_token(32)  # gpt_tiny
    assert metrics["mfu"] == pytest.approx(flops_per_token * metrics["tokens_per_sec"] / (1e6 * 2), rel=1e-3)  # 2 ranks
    compiled = [line for line in output.splitlines() if "===== __compiled_fn" in line]
    assert any(line.startswith("[rank0]") for line in compiled) and any(line.startswith("[rank1]") for line in compiled)
    # What dynamo traced is the model's forward (and loss), never a step with its logging.
    traced = [line for line in output.splitlines() if "torchdynamo start tracing" in line]
    assert len(traced) == 4 and all(re.search(r"tracing forward .*lit_dp_recipes/gpt.py", line) for line in traced), traced


def logged_rates(run_dir) -> list[float]:
    """The learning rate of each optimizer step, in order (LearningRateMonitor, every step here)."""
    [metrics] = run_dir.glob("csv/version_*/metrics.csv")
    with open(metrics) as file:
        return [float(row["lr-AdamW/decay"]) for row in csv.DictReader(file) if row.get("lr-AdamW/decay")]


@pytest.mark.slow
def test_a_resumed_run_continues_the_learning_rate_schedule(tmp_path):
    common = [
        *QUIET, *TINY_MODEL, "data.max_bytes=40000", "trainer.devices=1", "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=1", "model.warmup_steps=2", "model.lr_decay_steps=8",
    ]
    train(compose_config("gpt", [*common, "trainer.max_steps=4", "trainer.val_check_interval=4"], tmp_path / "first"))
    checkpoint = tmp_path / "first" / "checkpoints" / "last.ckpt"
    train(compose_config("gpt", [*common, "trainer.max_steps=8", "trainer.val_check_interval=4", f"ckpt_path={checkpoint}"],
                         tmp_path / "second"))
    first, second = logged_rates(tmp_path / "first"), logged_rates(tmp_path / "second")
    assert len(first) == len(second) == 4
    # Steps 4 to 7 run at the rates of steps 4 to 7 (down the cosine), not from the warm-up again.
    assert first + second == pytest.approx([lr_at(step, 3e-3, 3e-4, 2, 8) for step in range(8)])
