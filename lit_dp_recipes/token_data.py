"""Windows of tokens for a language model: from the user's shards, or from the standard library's bytes.

``TokenDataModule`` reads nanoGPT or llm.c shards (``lit_dp_recipes.shards``) given as globs,
memory-mapped; with no shards it trains on the Python standard library's source as bytes,
which is on every machine, so the recipe runs offline.

A window is ``block_size + 1`` tokens: the inputs and the next-token targets. Windows start
every ``block_size`` tokens and never cross a file's end. Each rank reads its own windows
through ``torch``'s ``DistributedSampler`` (shuffled by ``seed`` and the epoch, the remainder
that does not divide among the ranks left out), so every window is read once per epoch
across the ranks, by one rank, the same on every run. Batches are always full
(``drop_last``): a last, smaller batch would make ``torch.compile`` compile its shape anew.
On a GPU the loader pins its batches, so the Trainer's copy to the device does not block.
"""

from __future__ import annotations

import bisect
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit_dp_recipes.config import is_fraction
from lit_dp_recipes.shards import (
    AUTO_DTYPE,
    Shard,
    check_dtype_option,
    check_shard,
    inspect_shard,
    out_of_vocabulary,
    resolve_shards,
    tokens,
)

BYTE_VOCAB_SIZE = 256


def stdlib_text(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of the standard library's .py files, in a stable (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class TokenWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens over shards or in-memory token arrays.

    Shards are memory-mapped on first use in each process (and not pickled to loader workers
    or spawned ranks: each maps the file itself). With ``vocab_size``, a window holding an id
    outside ``[0, vocab_size)`` is refused with the file and the position (the shards' check
    before training reads a sample, not every token).
    """

    def __init__(self, sources: Sequence[Shard | np.ndarray], block_size: int, vocab_size: int | None = None,
                 name: str = "the in-memory tokens") -> None:
        self.sources = list(sources)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.name = name  # what an in-memory source is called in an error
        counts = [max(0, (len(source) - 1) // block_size) for source in self.sources]
        self._first = np.cumsum([0, *counts]).tolist()  # global index of each source's first window
        self._arrays: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self._first[-1]

    def position(self, index: int) -> tuple[int, int]:
        """(source, first token) of window ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        source = bisect.bisect_right(self._first, index) - 1
        return source, (index - self._first[source]) * self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        source, start = self.position(index)
        if self._arrays is None:
            self._arrays = [tokens(s) if isinstance(s, Shard) else s for s in self.sources]
        chunk = self._arrays[source][start : start + self.block_size + 1]
        if self.vocab_size is not None and len(chunk):
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                where = self.sources[source]
                raise out_of_vocabulary(
                    where.path if isinstance(where, Shard) else self.name,
                    bad, start + int(np.flatnonzero(chunk == bad)[0]), self.vocab_size,
                )
        window = torch.from_numpy(chunk.astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}


class TokenDataModule(pl.LightningDataModule):
    """Token windows for training and validation, from shards (``train_shards``/``val_shards``) or stdlib bytes.

    Every shard, validation ones included, is checked when the module is built, before any
    process starts: its format and header, its length (at least one window), and a sample of
    its token ids against ``vocab_size`` (``lit_dp_recipes.shards.check_token_ids``). Each
    ``ValueError`` names the file and what is wrong.
    """

    def __init__(
        self,
        train_shards: str | None = None,
        val_shards: str | None = None,
        vocab_size: int = BYTE_VOCAB_SIZE,
        block_size: int = 64,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        max_bytes: int = 1_000_000,
        val_fraction: float = 0.1,
        dtype: str = AUTO_DTYPE,
    ) -> None:
        super().__init__()
        for option, value, least in (
            ("vocab_size", vocab_size, 1),
            ("block_size", block_size, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("max_bytes", max_bytes, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"data.{option}={value!r} is invalid: expected an integer >= {least}.")
        if not is_fraction(val_fraction):
            raise ValueError(f"data.val_fraction={val_fraction!r} is invalid: expected a number in (0, 1).")
        self.dtype = check_dtype_option(dtype)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.train_shards, self.val_shards = self._checked_shards(train_shards, val_shards)
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def _checked_shards(self, train: str | None, val: str | None) -> tuple[list[Shard], list[Shard]]:
        if train is None and val is None:
            if self.vocab_size < BYTE_VOCAB_SIZE:
                raise ValueError(
                    f"data.vocab_size={self.vocab_size} is invalid without shards: the standard-library text is "
                    f"bytes, expected at least {BYTE_VOCAB_SIZE}."
                )
            return [], []
        if train is None or val is None:
            given, missing = ("data.train_shards", "data.val_shards") if val is None else ("data.val_shards", "data.train_shards")
            raise ValueError(f"{given} is set but {missing} is not: expected both globs (or neither, for the stdlib bytes).")
        train_paths = resolve_shards(train, "data.train_shards")
        val_paths = resolve_shards(val, "data.val_shards")
        shared = sorted(set(map(_real, train_paths)) & set(map(_real, val_paths)))
        if shared:
            raise ValueError(
                f"data.train_shards={train!r} and data.val_shards={val!r} both match {shared[0]}"
                f"{f' (and {len(shared) - 1} more)' if len(shared) > 1 else ''}: expected disjoint files."
            )
        checked = []
        for paths in (train_paths, val_paths):
            shards = [inspect_shard(path, self.dtype) for path in paths]
            for shard in shards:
                check_shard(shard, self.block_size + 1, self.vocab_size)
            checked.append(shards)
        return checked[0], checked[1]

    def setup(self, stage: str | None = None) -> None:
        ranks = self.trainer.world_size if self.trainer is not None else 1
        self.train_set, self.val_set = self._windows(ranks)

    def train_batches(self, ranks: int) -> int:
        """The batches each of ``ranks`` ranks draws in an epoch, known before any rank starts (the
        sampler and the loader drop what does not fill a batch); a ``ValueError`` where a split
        gives a rank less than one batch."""
        train, _ = self._windows(ranks)
        return len(train) // ranks // self.batch_size

    def check_model(self, model: pl.LightningModule) -> None:
        """Before any rank starts: a model of ``block_size``/``vocab_size`` (the GPT's) has a position for
        each input of a window and an embedding for each token id the data holds (it would fail at its
        first batch in every rank)."""
        for key in ("block_size", "vocab_size"):
            value, data = model.hparams.get(key), getattr(self, key)
            if value is not None and value < data:
                raise ValueError(
                    f"model.{key}={value!r} is invalid with data.{key}={data}: expected at least data.{key} "
                    f"(model.{key} follows data.{key} unless set)."
                )

    def _windows(self, ranks: int) -> tuple[TokenWindows, TokenWindows]:
        """The training and validation windows, each split giving each of ``ranks`` ranks a batch at least."""
        if self.train_shards:
            train = TokenWindows(self.train_shards, self.block_size, self.vocab_size)
            val = TokenWindows(self.val_shards, self.block_size, self.vocab_size)
        else:
            data = np.frombuffer(stdlib_text(self.max_bytes), dtype=np.uint8)
            split = int(len(data) * (1 - self.val_fraction))
            train, val = TokenWindows([data[:split]], self.block_size), TokenWindows([data[split:]], self.block_size)
        for split, windows, shards in (("train", train, self.train_shards), ("val", val, self.val_shards)):
            if len(windows) // ranks < self.batch_size:
                source = f"data.{split}_shards ({len(shards)} files)" if shards else f"the stdlib text's {split} split"
                whose = f"for each of the {ranks} ranks" if ranks != 1 else "for its one rank"
                raise ValueError(
                    f"{source} gives {len(windows)} windows of data.block_size + 1 = {self.block_size + 1} tokens: "
                    f"fewer than one batch (data.batch_size={self.batch_size}) {whose}."
                )
        return train, val

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, windows: TokenWindows, shuffle: bool) -> DataLoader:
        trainer = self.trainer
        ranks, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # A DistributedSampler of our own: Lightning leaves it in place (it would otherwise wrap
        # any other sampler in one) and calls its set_epoch every epoch.
        sampler = DistributedSampler(windows, num_replicas=ranks, rank=rank, shuffle=shuffle, seed=self.seed, drop_last=True)
        on_gpu = trainer is not None and trainer.strategy.root_device.type == "cuda"
        return DataLoader(
            windows,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,  # no new workers after every validation
            pin_memory=on_gpu,
        )


def _real(path: str) -> str:
    return str(Path(path).resolve())
