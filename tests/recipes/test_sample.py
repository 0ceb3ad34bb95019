"""The sample command: text from the GPT recipe's checkpoints, byte-level or GPT-2 tokens, on CPU or GPU."""

from __future__ import annotations

import importlib.util

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_dp_recipes.gpt import GPT
from lit_dp_recipes.prepare import GPT2_PADDED_VOCAB_SIZE
from lit_dp_recipes.run.sample import main
from lit_dp_recipes.sample import SampleConfig, codec, generate, load, sample


def checkpoint(tmp_path, vocab_size: int) -> str:
    """A checkpoint as the recipe's Trainer writes it, after one step of a tiny GPT."""
    model = GPT(block_size=16, n_layer=1, n_head=2, n_embd=16, vocab_size=vocab_size)
    tokens = torch.randint(0, min(vocab_size, 256), (8, 17))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    path = tmp_path / f"vocab{vocab_size}.ckpt"
    trainer.save_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory) -> str:
    return checkpoint(tmp_path_factory.mktemp("bytes"), 256)


def test_a_byte_level_checkpoint_samples_text_reproducibly(byte_checkpoint, capsys):
    config = SampleConfig(ckpt_path=byte_checkpoint, prompt="def ", num_samples=2, max_new_tokens=40, device="cpu")
    first = sample(config)
    assert len(first) == 2 and all(text.startswith("def ") for text in first)
    assert sample(config) == first  # the seed decides
    printed = capsys.readouterr().out
    assert "[lit_dp] sampling" in printed and "GPT 1 layers x 16, vocabulary 256, on cpu" in printed
    assert printed.count("---------------") == 4


def test_generation_adds_the_tokens_asked_for_beyond_the_models_context(byte_checkpoint):
    model = load(byte_checkpoint, torch.device("cpu"))
    ids = generate(model, [10], max_new_tokens=40, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert len(ids) == 41 and all(0 <= i < 256 for i in ids)  # 41 > block_size 16: the context is cropped


def test_a_gpt2_token_checkpoint_samples_token_ids_and_names_tiktoken_when_it_is_missing(tmp_path, capsys):
    path = checkpoint(tmp_path, GPT2_PADDED_VOCAB_SIZE)
    (ids,) = sample(SampleConfig(ckpt_path=path, tokenizer="ids", prompt="50256 464", max_new_tokens=5, device="cpu"))
    assert [int(i) for i in ids.split()][:2] == [50256, 464] and len(ids.split()) == 7
    if importlib.util.find_spec("tiktoken") is None:
        with pytest.raises(ValueError, match="tokenizer=gpt2 needs tiktoken"):
            sample(SampleConfig(ckpt_path=path, tokenizer="gpt2", max_new_tokens=5, device="cpu"))
        (auto,) = sample(SampleConfig(ckpt_path=path, max_new_tokens=5, device="cpu"))  # ids, saying why
        assert len(auto.split()) == 6 and "no tiktoken installed: token ids" in capsys.readouterr().out


def test_bad_settings_are_refused_naming_the_key(byte_checkpoint):
    with pytest.raises(ValueError, match="ckpt_path is required"):
        sample(SampleConfig())
    with pytest.raises(ValueError, match="ckpt_path='nowhere.ckpt' is invalid: no such file"):
        sample(SampleConfig(ckpt_path="nowhere.ckpt"))
    with pytest.raises(ValueError, match="expected token ids below 256"):
        codec("ids", 256).encode("1 300")
    with pytest.raises(ValueError, match="temperature=0.0 is invalid"):
        sample(SampleConfig(ckpt_path=byte_checkpoint, temperature=0.0))
    with pytest.raises(ValueError, match="tokenizer=bytes with a model of vocabulary 50304 is invalid"):
        codec("bytes", GPT2_PADDED_VOCAB_SIZE)
    # One line each, as the recipes answer (docs/conventions.md).
    with pytest.raises(SystemExit, match="^error: max_new_token=5 is not a key=value of the sampler: did you mean max_new_tokens"):
        main([f"ckpt_path={byte_checkpoint}", "max_new_token=5"])
    with pytest.raises(SystemExit, match="^error: temperature=abc is invalid: Value 'abc' of type 'str' could not be converted to Float.$"):
        main([f"ckpt_path={byte_checkpoint}", "temperature=abc"])
    with pytest.raises(SystemExit, match="^error: top_k=0 is invalid"):
        main([f"ckpt_path={byte_checkpoint}", "top_k=0"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_auto_samples_on_the_gpu(byte_checkpoint, capsys):
    (text,) = sample(SampleConfig(ckpt_path=byte_checkpoint, max_new_tokens=20))
    assert "on cuda" in capsys.readouterr().out and text
