"""A folder of text files -> llm.c token shards, split into training and validation.

``python recipes/prepare_shards.py input_dir=my_texts output_dir=data/my_texts`` (bytes), or
``tokenizer=gpt2`` for GPT-2's BPE through ``tiktoken`` where it is installed. Each file's text
is tokenized on its own (with GPT-2, after an end-of-text token, as llm.c's scripts do); its
last ``val_fraction`` of tokens goes to validation, the rest to training, so even one file
gives both. Shards are written as llm.c's (``lit_dp_recipes.shards``):
``{name}_train_000000.bin``, ``{name}_val_000000.bin``, ... of ``shard_tokens`` tokens each;
what is left at the end joins the last full shard rather than make a short one, which
training would refuse if shorter than one window.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from lit_dp_recipes.cli import CommandLineMistake
from lit_dp_recipes.config import is_fraction
from lit_dp_recipes.report import say
from lit_dp_recipes.shards import MAX_TOKENS, append_llmc_shard, write_llmc_shard

BYTE_VOCAB_SIZE = 256
GPT2_END_OF_TEXT = 50256
GPT2_PADDED_VOCAB_SIZE = 50304  # 50257 rounded up to a multiple of 64, as nanoGPT does
TOKENIZERS = ("bytes", "gpt2")


@dataclass
class Prepared:
    """What ``prepare_shards`` wrote."""

    name: str  # the shards' file names start with it
    files: int
    vocab_size: int  # the data.vocab_size to train with
    train: list[str] = field(default_factory=list)
    val: list[str] = field(default_factory=list)
    train_tokens: int = 0
    val_tokens: int = 0


def make_tokenizer(name: str) -> tuple[Callable[[bytes], np.ndarray], int]:
    """The encoder of ``name`` (text bytes -> token ids) and the ``data.vocab_size`` to train with."""
    if name == "bytes":
        return (lambda data: np.frombuffer(data, dtype=np.uint8)), BYTE_VOCAB_SIZE
    if name == "gpt2":
        try:
            import tiktoken
        except ImportError as error:
            raise ValueError(
                "tokenizer=gpt2 needs tiktoken, which is not installed: pip install tiktoken "
                "(or tokenizer=bytes, which needs nothing)."
            ) from error
        encoding = tiktoken.get_encoding("gpt2")

        def encode(data: bytes) -> np.ndarray:
            ids = encoding.encode_ordinary(data.decode("utf-8", errors="replace"))
            return np.array([GPT2_END_OF_TEXT, *ids], dtype=np.int64)

        return encode, GPT2_PADDED_VOCAB_SIZE
    raise ValueError(f"tokenizer={name!r} is invalid: expected one of {', '.join(TOKENIZERS)}.")


class ShardWriter:
    """Writes tokens to ``{prefix}_000000.bin``, ``{prefix}_000001.bin``, ... of ``shard_tokens`` tokens each."""

    def __init__(self, prefix: Path, shard_tokens: int) -> None:
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.paths: list[str] = []
        self.tokens = 0
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0

    def add(self, token_ids: np.ndarray) -> None:
        self._pending.append(token_ids)
        self._pending_tokens += len(token_ids)
        self.tokens += len(token_ids)
        while self._pending_tokens >= self.shard_tokens:
            pending = np.concatenate(self._pending)
            self._write(pending[: self.shard_tokens])
            self._pending = [pending[self.shard_tokens :]]
            self._pending_tokens = len(self._pending[0])

    def close(self) -> list[str]:
        if self._pending_tokens:
            rest = np.concatenate(self._pending)
            if self.paths and self.shard_tokens + len(rest) <= MAX_TOKENS:
                append_llmc_shard(self.paths[-1], rest)
            else:
                self._write(rest)
        self._pending, self._pending_tokens = [], 0
        return self.paths

    def _write(self, token_ids: np.ndarray) -> None:
        path = f"{self.prefix}_{len(self.paths):06d}.bin"
        write_llmc_shard(path, token_ids)
        self.paths.append(path)


def prepare_shards(
    input_dir: str,
    output_dir: str,
    pattern: str = "**/*.txt",
    tokenizer: str = "bytes",
    val_fraction: float = 0.1,
    shard_tokens: int = 100_000_000,
    name: str | None = None,
) -> Prepared:
    """Tokenize the files ``pattern`` matches under ``input_dir`` into shards in ``output_dir`` (see the module docstring)."""
    encode, vocab_size = make_tokenizer(tokenizer)
    if not os.path.isdir(input_dir):
        raise ValueError(f"input_dir={input_dir!r} is not a folder: expected a folder of text files.")
    files = sorted(p for p in glob.glob(os.path.join(input_dir, pattern), recursive=True) if os.path.isfile(p))
    if not files:
        raise ValueError(f"input_dir={input_dir!r} has no file matching pattern={pattern!r}: expected text files.")
    if not is_fraction(val_fraction):
        raise ValueError(f"val_fraction={val_fraction!r} is invalid: expected a number in (0, 1).")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or not 1 <= shard_tokens <= MAX_TOKENS // 2:
        raise ValueError(f"shard_tokens={shard_tokens!r} is invalid: expected an integer in [1, {MAX_TOKENS // 2}].")
    name = name or Path(input_dir).resolve().name
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.glob(f"{name}_train_*.bin")) + sorted(out.glob(f"{name}_val_*.bin"))
    if existing:
        raise ValueError(
            f"output_dir={output_dir!r} already holds shards named {name!r} ({existing[0].name}, ...): "
            "expected a new folder, or another name=."
        )
    train, val = ShardWriter(out / f"{name}_train", shard_tokens), ShardWriter(out / f"{name}_val", shard_tokens)
    for path in files:
        token_ids = encode(Path(path).read_bytes())
        held_out = int(round(len(token_ids) * val_fraction))
        train.add(token_ids[: len(token_ids) - held_out])
        val.add(token_ids[len(token_ids) - held_out :])
    if not train.tokens or not val.tokens:
        raise ValueError(
            f"input_dir={input_dir!r}: {len(files)} files gave {train.tokens} training and {val.tokens} validation "
            "tokens: expected more text (or another val_fraction)."
        )
    return Prepared(name, len(files), vocab_size, train.close(), val.close(), train.tokens, val.tokens)


def prepare_from_config(cfg: DictConfig) -> Prepared:
    """``recipes/prepare_shards.py``: ``prepare_shards`` with ``conf/prepare_shards.yaml``'s keys; says what it wrote."""
    try:
        prepared = prepare_shards(
            cfg.input_dir, cfg.output_dir, cfg.pattern, cfg.tokenizer, cfg.val_fraction, cfg.shard_tokens, cfg.name
        )
    except ValueError as error:  # each names the key and the value given (docs/conventions.md)
        raise CommandLineMistake(str(error)) from None
    for line in summary(prepared, cfg.output_dir).splitlines():
        say(line)
    return prepared


def summary(prepared: Prepared, output_dir: str) -> str:
    """What was written, and the command that trains on it."""
    return (
        f"{prepared.files} files -> {prepared.train_tokens} training tokens in {len(prepared.train)} shards, "
        f"{prepared.val_tokens} validation tokens in {len(prepared.val)} shards, in {output_dir}\n"
        f"train with: python recipes/gpt.py data.train_shards='{output_dir}/{prepared.name}_train_*.bin' "
        f"data.val_shards='{output_dir}/{prepared.name}_val_*.bin' data.vocab_size={prepared.vocab_size}"
    )
