"""The GPT recipe compiled, in bf16, with the fused AdamW and clipping: on one GPU (``pytest -m cuda``;
skipped without one), no host sync in a step; and its CPU twin, which CI runs (the end-to-end tier).

The twin is the GPU test's configuration translated by the rule the documented GPU commands follow
on CPU (tests/helpers/documented.py, ``on_device``): ``trainer.accelerator=cpu``, and the
``aot_eager`` backend, since inductor compiles C++ for over a minute per graph on 2 cores. Until
lit_dp's precision plugin (issue 32), this configuration crashed at its first step on both devices:
Lightning refused to clip the fused AdamW under bf16-mixed.
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_dp_recipes.train import train
from tests.helpers.recipes import QUIET, compose_config

GPU_CONFIG = [
    *QUIET, "experiment=gpt_tiny", "trainer=gpu", "trainer.devices=1", "trainer.precision=bf16-mixed",
    "compile=true", "data.num_workers=1", "trainer.log_every_n_steps=10", "trainer.gradient_clip_val=1.0",
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_bf16_recipe_steps_without_host_syncs_or_recompiles(tmp_path):
    cfg = compose_config(
        "gpt",
        [
            *GPU_CONFIG, "trainer.max_steps=40", "trainer.val_check_interval=20",
            "+callbacks.probe._target_=tests.helpers.probes.HostSyncs", "+callbacks.probe.warmup=5",
        ],
        tmp_path,
    )
    metrics = train(cfg)
    # Steps 5..39 less the log steps (9, 19, 29, 39), the steps before them and those before a
    # validation (19, 39): 27. (Measured on an H100 before the steps before log steps were left
    # out: 8 syncs, all LearningRateMonitor's on log steps.)
    assert metrics["host_sync_steps"] >= 25
    # Pinned batches copied without blocking, the loss logged as a tensor, fused AdamW, clipping
    # on the device: nothing in a step waits for the GPU.
    assert metrics["host_syncs"] == 0
    # Nor does any of lit_dp's code in any step, log steps included (the statistics are on in the
    # recipe: CommStatsMonitor's maximum over ranks is read once it reached the host).
    assert metrics["lit_dp_sync_steps"] >= 31  # 33: steps 5..39 less those before a validation
    assert metrics["lit_dp_host_syncs"] == 0
    assert metrics["dynamo_recompiles"] == 0
    assert metrics["tokens_per_sec"] > 0


@pytest.mark.slow
def test_its_cpu_twin_trains_compiled_in_bf16_with_the_fused_adamw_clipped(tmp_path):
    cfg = compose_config(
        "gpt",
        [
            *GPU_CONFIG, "trainer.accelerator=cpu", "compile_backend=aot_eager", "trainer.max_steps=12",
            "trainer.val_check_interval=6", "callbacks.throughput.warmup=3",
        ],
        tmp_path,
    )
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.gradient_clip_val == 1.0 and cfg.compile
    metrics = train(cfg)
    assert metrics["dynamo_recompiles"] == 0  # validation at step 6, after the warm-up: nothing recompiled
    assert metrics["tokens_per_sec"] > 0
    assert math.isfinite(metrics["train_loss"]) and metrics["val_loss"] < math.log(cfg.data.vocab_size)
