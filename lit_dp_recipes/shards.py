"""Token shards on disk: nanoGPT's flat ``.bin`` files and llm.c's headed ones, read and checked.

The formats users already have, all little-endian:

- **nanoGPT** (``data/*/prepare.py``): the tokens and nothing else, uint16.
- **llm.c / modded-nanogpt** (``dev/data/data_common.py``): a header of 256 int32, of which
  ``[0]`` is the magic, ``[1]`` the version and ``[2]`` the token count, then the tokens:
  magic 20240520 version 1 holds uint16 GPT-2 tokens, magic 20240801 version 7 uint32
  Llama-3 tokens.

The format is told from the header, never from the file's name: a file whose first int32 is
a magic is an llm.c shard, of the dtype its header says. A file that is not, but whose first
KB has the shape of an llm.c header (a count matching the file's size, then 253 zeros) is a
damaged llm.c shard, refused for its magic; anything else is a flat file, whose dtype nothing
in the file says: ``data.dtype`` (``auto``: uint16, nanoGPT's). An assumed dtype is checked
against the tokens themselves: a flat uint32 file read as uint16 gives a 0 for every other id
(the high halves of ids below 65536), an int64 one three 0s in four, so a third or more of 0
ids stops the run with the dtype the pattern points to. Shards are memory-mapped, never read
whole: ``inspect_shard`` reads the header, ``check_shard`` a bounded sample of tokens,
``tokens`` maps the file for reading.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLMC_MAGIC = 20240520
LLMC_VERSION = 1  # uint16 tokens (GPT-2)
LLMC_LLAMA3_MAGIC = 20240801
# magic -> (version, token dtype, tokenizer), as llm.c's dev/data/data_common.py writes them.
LLMC_HEADERS = {LLMC_MAGIC: (LLMC_VERSION, "<u2", "GPT-2"), LLMC_LLAMA3_MAGIC: (7, "<u4", "Llama-3")}
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")  # what nanoGPT writes, and what prepare_shards writes
TOKEN_BYTES = TOKEN_DTYPE.itemsize
MAX_TOKENS = 2**31 - 1  # the header's count is an int32
# data.dtype: the dtype of flat files (llm.c's headers say their own).
AUTO_DTYPE = "auto"
DTYPES = {"uint16": "<u2", "uint32": "<u4", "int32": "<i4", "int64": "<i8"}

# The token-id check (see check_token_ids): the maximum over this many leading tokens, plus
# this many positions spread evenly over the rest of the file. At most ~2 MB and a few
# thousand pages per shard, so a folder of 100 M-token shards is checked in seconds.
CHECKED_PREFIX_TOKENS = 1 << 20
CHECKED_SAMPLES = 4096
# The dtype check of flat files read as uint16 (see check_assumed_dtype): real text has few
# id-0 tokens; the high halves of wider ids are 0 in a third or more of the values.
ZERO_SHARE_LIMIT = 1 / 3
MIN_CHECKED_TOKENS = 64  # fewer say nothing about a dtype


@dataclass(frozen=True)
class Shard:
    """One token file: where its tokens start, how many there are, and their dtype."""

    path: str
    format: str  # "llm.c" or "nanogpt"
    offset: int  # bytes before the first token
    num_tokens: int
    dtype: str = TOKEN_DTYPE.str  # a little-endian numpy dtype, e.g. "<u2"
    dtype_assumed: bool = False  # a flat file read as uint16 because data.dtype=auto

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


def check_dtype_option(dtype: object) -> str:
    """``data.dtype``: ``auto`` or one of ``DTYPES``; a ``ValueError`` naming the option otherwise."""
    if dtype != AUTO_DTYPE and dtype not in DTYPES:
        raise ValueError(f"data.dtype={dtype!r} is invalid: expected {AUTO_DTYPE} or one of {', '.join(DTYPES)}.")
    return dtype


def inspect_shard(path: str, dtype: str = AUTO_DTYPE) -> Shard:
    """The shard at ``path``, its format told from its header; a ``ValueError`` naming the file if it is not one.

    ``dtype`` (``data.dtype``) is the dtype of a flat file; ``auto`` reads it as uint16 and
    marks it assumed. An llm.c shard has the dtype its header says, and another ``dtype`` is refused.
    """
    check_dtype_option(dtype)
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        head = file.read(HEADER_BYTES)
    if len(head) == HEADER_BYTES:
        header = np.frombuffer(head, dtype="<i4")
        magic, version, count = (int(v) for v in header[:3])
        if magic in LLMC_HEADERS:
            expected_version, token_dtype, tokenizer = LLMC_HEADERS[magic]
            name = _dtype_name(token_dtype)
            if version != expected_version:
                raise ValueError(
                    f"{path}: llm.c header version {version}: expected {expected_version} (magic {magic}: {name} "
                    f"{tokenizer} tokens)."
                )
            if dtype not in (AUTO_DTYPE, name):
                raise ValueError(
                    f"{path}: an llm.c shard of {name} tokens (magic {magic}, version {version}), but data.dtype={dtype}: "
                    f"the header says the dtype; leave data.dtype={AUTO_DTYPE} (data.dtype sets flat files' only)."
                )
            expected = HEADER_BYTES + count * np.dtype(token_dtype).itemsize
            if count < 0 or expected != size:
                raise ValueError(
                    f"{path}: the llm.c header counts {count} tokens ({expected} bytes with the header) "
                    f"but the file has {size} bytes: a truncated or damaged shard."
                )
            return Shard(path, "llm.c", HEADER_BYTES, count, token_dtype)
        if _has_llmc_header_shape(header, size):
            raise ValueError(
                f"{path}: bad magic {magic} in what is laid out as an llm.c header (count {count} matches the "
                f"file's size): expected {LLMC_MAGIC} (or {LLMC_LLAMA3_MAGIC})."
            )
    token_dtype = DTYPES["uint16" if dtype == AUTO_DTYPE else dtype]
    itemsize = np.dtype(token_dtype).itemsize
    if size % itemsize:
        raise ValueError(
            f"{path}: {size} bytes is not a whole number of {_dtype_name(token_dtype)} tokens: expected a flat "
            f"nanoGPT file (uint16, or data.dtype) or an llm.c shard (magic {LLMC_MAGIC} or {LLMC_LLAMA3_MAGIC})."
        )
    return Shard(path, "nanogpt", 0, size // itemsize, token_dtype, dtype_assumed=dtype == AUTO_DTYPE)


def _has_llmc_header_shape(header: np.ndarray, size: int) -> bool:
    count = int(header[2])
    sizes = {HEADER_BYTES + count * np.dtype(d).itemsize for _, d, _ in LLMC_HEADERS.values()}
    return count >= 0 and size in sizes and not header[3:].any()


def _dtype_name(dtype: str) -> str:
    return np.dtype(dtype).name


def tokens(shard: Shard) -> np.ndarray:
    """The shard's tokens, memory-mapped read-only (pages are read as windows touch them)."""
    if shard.num_tokens == 0:
        return np.zeros(0, dtype=shard.dtype)
    return np.memmap(shard.path, dtype=shard.dtype, mode="r", offset=shard.offset, shape=(shard.num_tokens,))


def check_shard(shard: Shard, window: int, vocab_size: int) -> None:
    """Refuse a shard shorter than one ``window`` of tokens, read in a dtype its tokens contradict,
    or holding a token id >= ``vocab_size``."""
    if shard.num_tokens < window:
        raise ValueError(
            f"{shard.path}: {shard.num_tokens} tokens, shorter than one window of data.block_size + 1 = {window} "
            "tokens: use a smaller data.block_size or leave the file out of the glob."
        )
    if shard.dtype_assumed:
        check_assumed_dtype(shard)
    check_token_ids(shard, vocab_size)


def check_assumed_dtype(shard: Shard) -> None:
    """A flat file read as uint16 (``data.dtype=auto``) whose first tokens are a third or more 0s is
    refused, with the dtype the zeros' pattern points to (see the module docstring)."""
    prefix = np.asarray(tokens(shard)[: min(shard.num_tokens, CHECKED_PREFIX_TOKENS)])
    if len(prefix) < MIN_CHECKED_TOKENS:
        return
    zeros = prefix == 0
    share = float(zeros.mean())
    if share < ZERO_SHARE_LIMIT:
        return
    high_halves = (zeros[1::4].mean(), zeros[2::4].mean(), zeros[3::4].mean())
    if min(high_halves) > 0.9:
        guess = "int64, 8 bytes a token: three uint16 in four are the 0 high bytes of small ids"
        remedy = "data.dtype=int64"
    elif zeros[1::2].mean() > 0.9:
        guess = "uint32 (or int32), 4 bytes a token: every other uint16 is the 0 high half of an id"
        remedy = "data.dtype=uint32"
    else:
        guess = "another dtype than uint16"
        remedy = "data.dtype=uint32, int32 or int64, whichever wrote it"
    raise ValueError(
        f"{shard.path}: {share:.0%} of its first {len(prefix)} token ids are 0 when read as uint16, nanoGPT's flat "
        f"format. A flat file does not say its dtype, and this one looks written as {guess}. Set {remedy} "
        "(data.dtype=uint16 if these ids are right)."
    )


def check_token_ids(shard: Shard, vocab_size: int) -> None:
    """A cheap check that the shard's ids fit the vocabulary: not every token, a bounded sample.

    The maximum over the first ``CHECKED_PREFIX_TOKENS`` tokens, and ``CHECKED_SAMPLES``
    positions spread evenly over the whole file (its last token included). A wrong tokenizer
    or vocabulary shows in any sample; a single stray id deep in a shard may not, and then the
    window that reaches it refuses it (``TokenWindows``), naming the file and the position.
    """
    if vocab_size > np.iinfo(shard.dtype).max:
        return  # every id of the dtype fits
    data = tokens(shard)
    prefix = data[: min(len(data), CHECKED_PREFIX_TOKENS)]
    positions = np.unique(np.linspace(0, len(data) - 1, num=min(len(data), CHECKED_SAMPLES), dtype=np.int64))
    for where, values in ((np.arange(len(prefix)), np.asarray(prefix)), (positions, np.asarray(data[positions]))):
        bad = np.flatnonzero((values >= vocab_size) | (values < 0))
        if len(bad):
            first = int(bad[0])
            raise out_of_vocabulary(shard.path, int(values[first]), int(where[first]), vocab_size)


def out_of_vocabulary(source: str, token: int, position: int, vocab_size: int) -> ValueError:
    """The error for token id ``token`` at ``position`` of ``source``, outside ``[0, vocab_size)``."""
    what = f"is >= data.vocab_size={vocab_size}" if token >= 0 else "is negative"
    return ValueError(
        f"{source}: token id {token} at position {position} {what}: set "
        "data.vocab_size to the tokenizer's vocabulary (256 for bytes, 50304 for GPT-2's 50257 padded), or "
        "data.dtype to the dtype the file was written in."
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
