"""The GPT recipe on one GPU (``pytest -m cuda``; skipped without one): compiled, bf16, no host sync in a step."""

from __future__ import annotations

import pytest
import torch

from lit_dp_recipes.train import train
from tests.helpers.recipes import QUIET, compose_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_compiled_bf16_recipe_steps_without_host_syncs_or_recompiles(tmp_path):
    cfg = compose_config(
        "gpt",
        [
            *QUIET, "experiment=gpt_tiny", "trainer=gpu", "trainer.devices=1", "trainer.precision=bf16-mixed",
            "compile=true", "data.num_workers=1", "trainer.max_steps=40", "trainer.val_check_interval=20",
            "trainer.log_every_n_steps=10", "trainer.gradient_clip_val=1.0",
            "+callbacks.probe._target_=tests.helpers.probes.HostSyncs", "+callbacks.probe.warmup=5",
        ],
        tmp_path,
    )
    metrics = train(cfg)
    # Steps 5..39 less the log steps (9, 19, 29, 39) and those before a validation (19, 39): 31.
    assert metrics["host_sync_steps"] >= 25
    # Pinned batches copied without blocking, the loss logged as a tensor, fused AdamW, clipping
    # on the device: nothing in a step waits for the GPU.
    assert metrics["host_syncs"] == 0
    assert metrics["dynamo_recompiles"] == 0
    assert metrics["tokens_per_sec"] > 0
