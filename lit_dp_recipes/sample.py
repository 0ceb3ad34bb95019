"""Text from a GPT recipe's checkpoint, as nanoGPT's ``sample.py`` writes it.

The model comes back from the checkpoint's own hyperparameters (``GPT.load_from_checkpoint``),
so any checkpoint of the recipe works: the run's ``last.ckpt``, a ``step=<N>.ckpt``, the best
one. Its vocabulary says how text becomes tokens: 256 is bytes; GPT-2's (50304, padded) is
tiktoken's ``gpt2`` encoding where tiktoken is installed, else token ids (``tokenizer=ids``).
Each sample starts from ``prompt`` and adds ``max_new_tokens``, each drawn from the ``top_k``
most likely at ``temperature``, with the context cropped to the model's ``block_size``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from lit_dp_recipes.gpt import GPT
from lit_dp_recipes.prepare import BYTE_VOCAB_SIZE, GPT2_END_OF_TEXT, make_tokenizer

TOKENIZERS = ("auto", "bytes", "gpt2", "ids")
GPT2_VOCAB_SIZE = 50257  # the ids tiktoken's gpt2 encoding decodes; the rest of 50304 is padding


@dataclasses.dataclass
class SampleConfig:
    """The command's keys (``key=value`` on its command line)."""

    ckpt_path: str = "???"  # a checkpoint of the GPT recipe
    prompt: str = ""  # the text each sample continues; empty: a newline (bytes), <|endoftext|> (gpt2)
    num_samples: int = 1
    max_new_tokens: int = 200
    temperature: float = 0.8  # < 1: more likely tokens, > 1: more diverse
    top_k: Optional[int] = 200  # draw from the k most likely tokens only; null: from all
    seed: int = 1337
    device: str = "auto"  # auto: cuda when there is a GPU, else cpu; or any torch device
    tokenizer: str = "auto"  # auto: bytes for a vocabulary of 256, else gpt2 (ids without tiktoken); ids: token ids, space-separated


@dataclasses.dataclass(frozen=True)
class Codec:
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    start: list[int]  # what an empty prompt starts from


def load(ckpt_path: str, device: torch.device) -> GPT:
    """The recipe's model from ``ckpt_path``, in eval mode on ``device``."""
    model = GPT.load_from_checkpoint(ckpt_path, map_location=device)
    return model.eval()


def codec(tokenizer: str, vocab_size: int) -> Codec:
    """How text becomes ``vocab_size`` token ids and back (``tokenizer``: one of ``TOKENIZERS``)."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer={tokenizer!r} is invalid: expected one of {', '.join(TOKENIZERS)}.")
    if tokenizer == "auto":
        tokenizer = "bytes" if vocab_size == BYTE_VOCAB_SIZE else "gpt2" if importlib.util.find_spec("tiktoken") else "ids"
        if tokenizer == "ids":
            print(f"[lit_dp] a vocabulary of {vocab_size} and no tiktoken installed: token ids (pip install tiktoken for text)")
    if tokenizer == "ids":

        def token_ids(text: str) -> list[int]:
            words = text.split()
            if not all(word.isdigit() and int(word) < vocab_size for word in words):
                raise ValueError(f"prompt={text!r} is invalid with tokenizer=ids: expected token ids below {vocab_size}, space-separated.")
            return [int(word) for word in words]

        return Codec(token_ids, lambda ids: " ".join(map(str, ids)), [0])
    if tokenizer == "bytes":
        if vocab_size != BYTE_VOCAB_SIZE:
            raise ValueError(
                f"tokenizer=bytes with a model of vocabulary {vocab_size} is invalid: expected a byte-level model "
                f"(vocabulary {BYTE_VOCAB_SIZE}), or tokenizer=gpt2 or ids."
            )
        return Codec(lambda text: list(text.encode()), lambda ids: bytes(ids).decode("utf-8", errors="replace"), [ord("\n")])
    make_tokenizer("gpt2")  # its error names tiktoken when it is missing
    import tiktoken

    encoding = tiktoken.get_encoding("gpt2")
    decode = lambda ids: encoding.decode([i for i in ids if i < GPT2_VOCAB_SIZE])  # noqa: E731 - the padding ids are never text
    return Codec(encoding.encode_ordinary, decode, [GPT2_END_OF_TEXT])


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, temperature: float, top_k: int | None,
             generator: torch.Generator) -> list[int]:
    """``prompt`` followed by ``max_new_tokens`` drawn one by one (nanoGPT's ``GPT.generate``)."""
    device = model.device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    block_size = model.hparams.block_size
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -block_size:])[:, -1, :] / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probabilities = torch.softmax(logits.float(), dim=-1)
        following = torch.multinomial(probabilities.cpu(), num_samples=1, generator=generator).to(device)
        tokens = torch.cat([tokens, following], dim=1)
    return tokens[0].tolist()


def check(config: SampleConfig) -> None:
    if config.ckpt_path == "???":
        raise ValueError("ckpt_path is required: a checkpoint of the GPT recipe, e.g. outputs/gpt/<run>/checkpoints/last.ckpt.")
    if not Path(config.ckpt_path).is_file():
        raise ValueError(f"ckpt_path={config.ckpt_path!r} is invalid: no such file (a run's checkpoints are in outputs/gpt/<run>/checkpoints/).")
    for name, least in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 1)):
        value = getattr(config, name)
        if value is not None and value < least:
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {least}.")
    if not config.temperature > 0:
        raise ValueError(f"temperature={config.temperature!r} is invalid: expected a positive number.")


def sample(config: SampleConfig) -> list[str]:
    """``config.num_samples`` texts from the checkpoint, printed as they come."""
    check(config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else torch.device(config.device)
    model = load(config.ckpt_path, device)
    hparams = model.hparams
    text = codec(config.tokenizer, hparams.vocab_size)
    prompt = text.encode(config.prompt) if config.prompt else text.start
    generator = torch.Generator().manual_seed(config.seed)
    print(
        f"[lit_dp] sampling {config.ckpt_path}: GPT {hparams.n_layer} layers x {hparams.n_embd}, vocabulary "
        f"{hparams.vocab_size}, on {device}; {config.num_samples} x {config.max_new_tokens} tokens, temperature "
        f"{config.temperature:g}, top_k {config.top_k}, seed {config.seed}",
        flush=True,
    )
    samples = []
    for _ in range(config.num_samples):
        samples.append(text.decode(generate(model, prompt, config.max_new_tokens, config.temperature, config.top_k, generator)))
        print(samples[-1], flush=True)
        print("---------------", flush=True)
    return samples
