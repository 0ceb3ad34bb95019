"""Token shards on disk: nanoGPT's flat ``.bin`` files and llm.c's headed ones, read and checked.

Two formats users already have, both little-endian uint16 token ids:

- **nanoGPT** (``data/*/prepare.py``): the tokens and nothing else.
- **llm.c / modded-nanogpt** (``dev/data/data_common.py``): a header of 256 int32, of which
  ``[0]`` is the magic 20240520, ``[1]`` the version (1: uint16 tokens) and ``[2]`` the token
  count, then the tokens.

The format is told from the header, never from the file's name: a file whose first int32 is
the magic is an llm.c shard. A file that is not, but whose first KB has the shape of an llm.c
header (a count matching the file's size, then 253 zeros) is a damaged llm.c shard, refused
for its magic; anything else is a flat nanoGPT file. Shards are memory-mapped, never read
whole: ``inspect_shard`` reads the header and a bounded sample of tokens, ``tokens`` maps the
file for reading.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLMC_MAGIC = 20240520
LLMC_VERSION = 1  # uint16 tokens (GPT-2); llm.c's version 7 (magic 20240801) holds uint32 Llama-3 tokens
LLMC_LLAMA3_MAGIC = 20240801
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
TOKEN_BYTES = TOKEN_DTYPE.itemsize
MAX_TOKENS = 2**31 - 1  # the header's count is an int32

# The token-id check (see check_token_ids): the maximum over this many leading tokens, plus
# this many positions spread evenly over the rest of the file. At most ~2 MB and a few
# thousand pages per shard, so a folder of 100 M-token shards is checked in seconds.
CHECKED_PREFIX_TOKENS = 1 << 20
CHECKED_SAMPLES = 4096


@dataclass(frozen=True)
class Shard:
    """One token file: where its tokens start and how many there are."""

    path: str
    format: str  # "llm.c" or "nanogpt"
    offset: int  # bytes before the first token
    num_tokens: int

    def __len__(self) -> int:
        return self.num_tokens


def resolve_shards(pattern: str, option: str) -> list[str]:
    """The files ``pattern`` (a glob, ``**`` allowed) matches, sorted; a ``ValueError`` naming ``option`` if none."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{option}={pattern!r} is invalid: expected a glob of token shards such as 'data/*train*.bin'.")
    paths = sorted(path for path in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(path))
    if not paths:
        raise ValueError(
            f"{option}={pattern!r} matches no file (relative paths start at {os.getcwd()}): "
            "expected a glob of nanoGPT or llm.c token shards."
        )
    return paths


def inspect_shard(path: str) -> Shard:
    """The shard at ``path``, its format told from its header; a ``ValueError`` naming the file if it is not one."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        head = file.read(HEADER_BYTES)
    if len(head) == HEADER_BYTES:
        header = np.frombuffer(head, dtype="<i4")
        magic, version, count = (int(v) for v in header[:3])
        if magic == LLMC_MAGIC:
            if version != LLMC_VERSION:
                raise ValueError(
                    f"{path}: llm.c header version {version}: expected {LLMC_VERSION} (uint16 GPT-2 tokens)."
                )
            expected = HEADER_BYTES + count * TOKEN_BYTES
            if count < 0 or expected != size:
                raise ValueError(
                    f"{path}: the llm.c header counts {count} tokens ({expected} bytes with the header) "
                    f"but the file has {size} bytes: a truncated or damaged shard."
                )
            return Shard(path, "llm.c", HEADER_BYTES, count)
        if magic == LLMC_LLAMA3_MAGIC:
            raise ValueError(
                f"{path}: an llm.c Llama-3 shard (magic {magic}, uint32 tokens): expected uint16 tokens "
                f"(magic {LLMC_MAGIC}, version {LLMC_VERSION}) or a flat nanoGPT file."
            )
        if _has_llmc_header_shape(header, size):
            raise ValueError(
                f"{path}: bad magic {magic} in what is laid out as an llm.c header (count {count} matches the "
                f"file's size): expected {LLMC_MAGIC}."
            )
    if size % TOKEN_BYTES:
        raise ValueError(
            f"{path}: {size} bytes is not a whole number of uint16 tokens: expected a nanoGPT .bin "
            f"(flat uint16) or an llm.c shard (magic {LLMC_MAGIC})."
        )
    return Shard(path, "nanogpt", 0, size // TOKEN_BYTES)


def _has_llmc_header_shape(header: np.ndarray, size: int) -> bool:
    count = int(header[2])
    return count >= 0 and HEADER_BYTES + count * TOKEN_BYTES == size and not header[3:].any()


def tokens(shard: Shard) -> np.ndarray:
    """The shard's tokens, memory-mapped read-only (pages are read as windows touch them)."""
    if shard.num_tokens == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(shard.path, dtype=TOKEN_DTYPE, mode="r", offset=shard.offset, shape=(shard.num_tokens,))


def check_shard(shard: Shard, window: int, vocab_size: int) -> None:
    """Refuse a shard shorter than one ``window`` of tokens, or holding a token id >= ``vocab_size``."""
    if shard.num_tokens < window:
        raise ValueError(
            f"{shard.path}: {shard.num_tokens} tokens, shorter than one window of data.block_size + 1 = {window} "
            "tokens: use a smaller data.block_size or leave the file out of the glob."
        )
    check_token_ids(shard, vocab_size)


def check_token_ids(shard: Shard, vocab_size: int) -> None:
    """A cheap check that the shard's ids fit the vocabulary: not every token, a bounded sample.

    The maximum over the first ``CHECKED_PREFIX_TOKENS`` tokens, and ``CHECKED_SAMPLES``
    positions spread evenly over the whole file (its last token included). A wrong tokenizer
    or vocabulary shows in any sample; a single stray id deep in a shard may not, and then the
    embedding raises when a window reaches it.
    """
    if vocab_size > np.iinfo(TOKEN_DTYPE).max:
        return  # every uint16 fits
    data = tokens(shard)
    prefix = data[: min(len(data), CHECKED_PREFIX_TOKENS)]
    positions = np.unique(np.linspace(0, len(data) - 1, num=min(len(data), CHECKED_SAMPLES), dtype=np.int64))
    for where, values in ((np.arange(len(prefix)), np.asarray(prefix)), (positions, np.asarray(data[positions]))):
        bad = np.flatnonzero(values >= vocab_size)
        if len(bad):
            first = int(bad[0])
            raise ValueError(
                f"{shard.path}: token id {int(values[first])} at position {int(where[first])} is >= "
                f"data.vocab_size={vocab_size}: set data.vocab_size to the tokenizer's vocabulary "
                "(256 for bytes, 50304 for GPT-2's 50257 padded)."
            )


def write_llmc_shard(path: str | Path, token_ids: np.ndarray) -> None:
    """Write ``token_ids`` as an llm.c shard: the 256-int32 header, then the uint16 tokens."""
    token_ids = _as_tokens(token_ids)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (LLMC_MAGIC, LLMC_VERSION, len(token_ids))
    with open(path, "wb") as file:
        file.write(header.tobytes())
        file.write(token_ids.tobytes())


def append_llmc_shard(path: str | Path, token_ids: np.ndarray) -> None:
    """Append ``token_ids`` to an existing llm.c shard and update its header's count."""
    token_ids = _as_tokens(token_ids)
    shard = inspect_shard(str(path))
    if shard.format != "llm.c":
        raise ValueError(f"{path}: not an llm.c shard, cannot append to it.")
    total = shard.num_tokens + len(token_ids)
    if total > MAX_TOKENS:
        raise ValueError(f"{path}: {total} tokens would not fit the header's int32 count.")
    with open(path, "r+b") as file:
        file.seek(0, os.SEEK_END)
        file.write(token_ids.tobytes())
        file.seek(2 * 4)
        file.write(np.array([total], dtype="<i4").tobytes())


def write_nanogpt_shard(path: str | Path, token_ids: np.ndarray) -> None:
    """Write ``token_ids`` as nanoGPT does: flat uint16, no header."""
    _as_tokens(token_ids).tofile(path)


def _as_tokens(token_ids: np.ndarray) -> np.ndarray:
    token_ids = np.asarray(token_ids)
    if len(token_ids) and (token_ids.min() < 0 or token_ids.max() > np.iinfo(TOKEN_DTYPE).max):
        raise ValueError(f"token ids must lie in [0, 65535] to be stored as uint16, got [{token_ids.min()}, {token_ids.max()}].")
    if len(token_ids) > MAX_TOKENS:
        raise ValueError(f"{len(token_ids)} tokens in one shard: expected at most {MAX_TOKENS} (the header's int32).")
    return token_ids.astype(TOKEN_DTYPE, copy=False)
