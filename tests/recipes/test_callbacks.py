"""The recipes' callbacks: the MFU arithmetic and the options of the throughput meter."""

from __future__ import annotations

import pytest
import torch

from lit_dp_recipes.callbacks import TokenThroughput, peak_bf16_flops
from lit_dp_recipes.charlm import CharGPT


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ],
)
def test_peak_bf16_flops_by_device_name(name, peak):
    assert peak_bf16_flops(name) == peak


def test_flops_per_token_of_gpt2_small_is_nanogpts():
    with torch.device("meta"):
        model = CharGPT(block_size=1024, n_layer=12, n_head=12, n_embd=768, vocab_size=50304)
    # nanoGPT prints "number of parameters: 123.69M" for this model (124,475,904 less the
    # 786,432 of the position embedding); its estimate_mfu adds 12 * L * H * Q * T.
    assert model.flops_per_token(1024) == 6 * 123_689_472 + 12 * 12 * 768 * 1024


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"warmup": 0}, r"callbacks.throughput.warmup=0 is invalid: expected an integer >= 1"),
        ({"peak_flops": -1.0}, r"callbacks.throughput.peak_flops=-1.0 is invalid: expected a positive FLOP/s"),
    ],
)
def test_bad_throughput_options_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        TokenThroughput(**options)

