"""The GPT recipe's model: its schedule, its weight-decay split, its optimizer, its options."""

from __future__ import annotations

import math

import pytest
import torch

from lit_dp_recipes.gpt import GPT, adamw, decay_groups, lr_at


def test_schedule_is_nanogpts_linear_warmup_then_cosine_then_flat():
    lr, min_lr, warmup, decay = 1.0, 0.1, 4, 14
    rates = [lr_at(step, lr, min_lr, warmup, decay) for step in range(20)]
    assert rates[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])  # (step + 1) / (warmup + 1)
    assert rates[4] == pytest.approx(lr)  # the peak, where the cosine starts
    assert rates[9] == pytest.approx(min_lr + 0.5 * (lr - min_lr))  # half way down
    assert all(a > b for a, b in zip(rates[4:14], rates[5:14]))
    assert rates[14:] == [min_lr] * 6
    midway = lr_at(6, lr, min_lr, warmup, decay)
    assert midway == pytest.approx(min_lr + 0.5 * (1 + math.cos(math.pi * 2 / 10)) * (lr - min_lr))


def test_weight_decay_on_matrices_and_embeddings_only():
    model = GPT(n_layer=2, n_embd=32, n_head=2)
    decay, no_decay = decay_groups(model, 0.1)
    names = {id(p): name for name, p in model.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} == {
        name for name, p in model.named_parameters() if name.endswith("weight") and "norm" not in name
    }
    assert all(names[id(p)].endswith("bias") or "norm" in names[id(p)] for p in no_decay["params"])
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    # Every parameter once: the head is tied to the token embedding.
    everything = decay["params"] + no_decay["params"]
    assert len(everything) == len({id(p) for p in everything}) == len(list(model.parameters()))
    assert model.head.weight is model.tokens.weight


def test_adamw_is_fused_where_torch_has_the_kernel():
    optimizer = adamw(GPT(n_layer=1, n_embd=32, n_head=2), 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"))
    assert all(group["fused"] for group in optimizer.param_groups)  # torch >= 2.4 has a CPU kernel


def test_forward_gives_the_loss_of_its_logits():
    torch.manual_seed(0)
    model = GPT(n_layer=1, n_embd=32, n_head=2, block_size=16)
    inputs, targets = torch.randint(256, (3, 16)), torch.randint(256, (3, 16))
    logits = model(inputs)
    assert logits.shape == (3, 16, 256)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model(inputs, targets), expected)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_embd": 30, "n_head": 4}, r"model.n_embd=30 is invalid: expected a multiple of model.n_head=4"),
        ({"vocab_size": 0}, r"model.vocab_size=0 is invalid: expected a positive integer"),
        ({"lr": 0.0}, r"model.lr=0.0 is invalid"),
        ({"lr": 1e-3, "min_lr": 1e-2}, r"model.min_lr=0.01 is invalid: expected a rate in \[0, model.lr=0.001\]"),
        ({"warmup_steps": -1}, r"model.warmup_steps=-1 is invalid: expected an integer >= 0"),
        ({"warmup_steps": 10, "lr_decay_steps": 5}, r"model.lr_decay_steps=5 is invalid: .* >= model.warmup_steps=10"),
        ({"weight_decay": -0.1}, r"model.weight_decay=-0.1 is invalid"),
        ({"dropout": 1.0}, r"model.dropout=1.0 is invalid"),
    ],
)
def test_bad_model_options_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        GPT(**options)


def test_flops_per_token_of_gpt2_small_is_nanogpts():
    with torch.device("meta"):
        model = GPT(block_size=1024, n_layer=12, n_head=12, n_embd=768, vocab_size=50304)
    # nanoGPT prints "number of parameters: 123.69M" for this model (124,475,904 less the
    # 786,432 of the position embedding); its estimate_mfu adds 12 * L * H * Q * T.
    assert model.flops_per_token(1024) == 6 * 123_689_472 + 12 * 12 * 768 * 1024
