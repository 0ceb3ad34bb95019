"""Token shards: both formats read back token for token, every bad input named, windows split across ranks."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from lit_dp_recipes import shards
from lit_dp_recipes.shards import (
    HEADER_BYTES,
    LLMC_MAGIC,
    inspect_shard,
    tokens,
    write_llmc_shard,
    write_nanogpt_shard,
)
from lit_dp_recipes.token_data import TokenDataModule, TokenWindows


def random_tokens(count: int, vocab: int = 50304, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(vocab, size=count, dtype=np.uint16)


def llmc_header(magic: int = LLMC_MAGIC, version: int = 1, count: int = 0) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    return header.tobytes()


@pytest.mark.parametrize(("writer", "fmt", "offset"), [(write_llmc_shard, "llm.c", HEADER_BYTES), (write_nanogpt_shard, "nanogpt", 0)])
def test_both_formats_read_back_token_for_token(tmp_path, writer, fmt, offset):
    expected = random_tokens(5000)
    path = tmp_path / "shard.bin"  # the same name for both: the format comes from the header
    writer(path, expected)
    shard = inspect_shard(str(path))
    assert (shard.format, shard.offset, shard.num_tokens) == (fmt, offset, 5000)
    data = tokens(shard)
    assert isinstance(data, np.memmap)  # mapped, not read whole
    np.testing.assert_array_equal(data, expected)


def test_llmc_header_is_what_llmc_writes(tmp_path):
    # llm.c's dev/data/data_common.py: 256 little-endian int32 (magic, version, count), then uint16 tokens.
    path = tmp_path / "x.bin"
    write_llmc_shard(path, np.array([1, 2, 65535], dtype=np.uint16))
    raw = path.read_bytes()
    assert raw[:HEADER_BYTES] == llmc_header(count=3)
    assert raw[HEADER_BYTES:] == b"\x01\x00\x02\x00\xff\xff"


def test_windows_of_a_shard_are_its_tokens_shifted_by_one(tmp_path):
    expected = random_tokens(1000, vocab=256)
    write_llmc_shard(tmp_path / "a.bin", expected)
    windows = TokenWindows([inspect_shard(str(tmp_path / "a.bin"))], block_size=64)
    assert len(windows) == (1000 - 1) // 64
    inputs, targets = windows[3]
    np.testing.assert_array_equal(inputs.numpy(), expected[192:256])
    np.testing.assert_array_equal(targets.numpy(), expected[193:257])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (llmc_header(magic=12345, count=10) + bytes(20), r"bad magic 12345 in what is laid out as an llm.c header .* expected 20240520"),
        (llmc_header(version=2, count=10) + bytes(20), r"llm.c header version 2: expected 1 \(magic 20240520: uint16 GPT-2 tokens\)"),
        (llmc_header(count=10) + bytes(18), r"the llm.c header counts 10 tokens \(1044 bytes with the header\) but the file has 1042 bytes"),
        (llmc_header(count=10) + bytes(40), r"the llm.c header counts 10 tokens .* but the file has 1064 bytes"),
        (llmc_header(magic=20240801, version=7, count=5) + bytes(10), r"the llm.c header counts 5 tokens \(1044 bytes"),
        (bytes(2047), r"2047 bytes is not a whole number of uint16 tokens"),
    ],
    ids=["magic", "version", "count_short", "count_long", "llama3_count", "odd_size"],
)
def test_bad_shards_are_named_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path}: {message}"):
        inspect_shard(str(path))


def test_llmc_llama3_shards_are_read_as_uint32(tmp_path):
    # llm.c's version 7: magic 20240801, uint32 Llama-3 ids (vocabulary 128256), told by the header.
    expected = np.random.default_rng(0).integers(128256, size=300, dtype=np.uint32)
    path = tmp_path / "llama.bin"
    path.write_bytes(llmc_header(magic=20240801, version=7, count=300) + expected.astype("<u4").tobytes())
    shard = inspect_shard(str(path))
    assert (shard.format, shard.dtype, shard.dtype_assumed) == ("llm.c", "<u4", False)
    np.testing.assert_array_equal(tokens(shard), expected)
    with pytest.raises(ValueError, match=r"an llm.c shard of uint32 tokens .* but data.dtype=uint16: the header says"):
        inspect_shard(str(path), "uint16")


@pytest.mark.parametrize(("written", "remedy"), [("<u4", "data.dtype=uint32"), ("<i4", "data.dtype=uint32"), ("<i8", "data.dtype=int64")])
def test_a_flat_file_of_wider_ids_is_refused_with_the_dtype_to_set(tmp_path, written, remedy):
    ids = random_tokens(4000, vocab=256).astype(written)
    path = tmp_path / "train.bin"
    ids.tofile(path)  # no header: read as uint16, every other (or three in four) id would be 0
    shard = inspect_shard(str(path))
    assert shard.dtype_assumed
    with pytest.raises(ValueError, match=rf"{path}: \d+% of its first \d+ token ids are 0 when read as uint16.* Set {remedy}"):
        shards.check_shard(shard, window=33, vocab_size=256)
    # Told the dtype, the reader gives the ids back; uint16 given explicitly is trusted as it is.
    name = {"<u4": "uint32", "<i4": "int32", "<i8": "int64"}[written]
    np.testing.assert_array_equal(tokens(inspect_shard(str(path), name)), ids)
    shards.check_shard(inspect_shard(str(path), "uint16"), window=33, vocab_size=256)


def test_a_uint16_file_with_some_zero_ids_passes_the_dtype_check(tmp_path):
    ids = random_tokens(4000, vocab=256)
    ids[::5] = 0  # a fifth: frequent, but no wider dtype's pattern
    write_nanogpt_shard(tmp_path / "train.bin", ids)
    shards.check_shard(inspect_shard(str(tmp_path / "train.bin")), window=33, vocab_size=256)


def test_an_id_outside_the_vocabulary_deep_in_a_shard_is_named_by_the_window_that_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "CHECKED_PREFIX_TOKENS", 100)
    monkeypatch.setattr(shards, "CHECKED_SAMPLES", 2)  # the first and the last token only
    ids = random_tokens(1000, vocab=256)
    ids[555] = 300
    write_llmc_shard(tmp_path / "a.bin", ids)
    shard = inspect_shard(str(tmp_path / "a.bin"))
    shards.check_shard(shard, window=33, vocab_size=256)  # the sample misses it
    windows = TokenWindows([shard], block_size=32, vocab_size=256)
    windows[0]
    with pytest.raises(ValueError, match=rf"{tmp_path / 'a.bin'}: token id 300 at position 555 is >= data.vocab_size=256"):
        windows[555 // 32]


def write_pair(tmp_path, train=None, val=None):
    write_llmc_shard(tmp_path / "d_train_000000.bin", random_tokens(4000, vocab=256) if train is None else train)
    write_nanogpt_shard(tmp_path / "d_val_000000.bin", random_tokens(2000, vocab=256, seed=1) if val is None else val)
    return {"train_shards": str(tmp_path / "*train*.bin"), "val_shards": str(tmp_path / "*val*.bin")}


def test_datamodule_reads_both_formats_and_checks_every_file(tmp_path):
    data = TokenDataModule(**write_pair(tmp_path), vocab_size=256, block_size=32, batch_size=4)
    assert [s.format for s in data.train_shards + data.val_shards] == ["llm.c", "nanogpt"]


@pytest.mark.parametrize(
    ("make", "options", "message"),
    [
        (lambda p: write_pair(p) | {"train_shards": str(p / "nothing*.bin")}, {},
         r"data.train_shards='.*nothing\*.bin' matches no file .* expected a glob of nanoGPT or llm.c token shards"),
        (lambda p: write_pair(p) | {"val_shards": str(p / "nothing*.bin")}, {}, r"data.val_shards='.*' matches no file"),
        (lambda p: write_pair(p, val=random_tokens(30, vocab=256)), {},
         r"d_val_000000.bin: 30 tokens, shorter than one window of data.block_size \+ 1 = 33 tokens"),
        (lambda p: write_pair(p, val=np.r_[random_tokens(1999, vocab=256), 300].astype(np.uint16)), {},
         r"d_val_000000.bin: token id 300 at position 1999 is >= data.vocab_size=256"),
        (lambda p: write_pair(p), {"vocab_size": 100}, r"d_train_000000.bin: token id \d+ at position \d+ is >= data.vocab_size=100"),
        (lambda p: {"train_shards": write_pair(p)["train_shards"]}, {},
         r"data.train_shards is set but data.val_shards is not: expected both globs"),
        (lambda p: write_pair(p) | {"val_shards": str(p / "*.bin")}, {},
         r"data.train_shards='.*' and data.val_shards='.*' both match .*d_train_000000.bin: expected disjoint files"),
        (lambda p: {}, {"vocab_size": 100}, r"data.vocab_size=100 is invalid without shards: .* expected at least 256"),
        (lambda p: {}, {"block_size": 0}, r"data.block_size=0 is invalid: expected an integer >= 1"),
        (lambda p: {}, {"val_fraction": "abc"}, r"data.val_fraction='abc' is invalid: expected a number in \(0, 1\)"),
        (lambda p: write_pair(p), {"dtype": "uint8"}, r"data.dtype='uint8' is invalid: expected auto or one of uint16, uint32"),
    ],
    ids=["train_glob", "val_glob", "short_val", "val_token_id", "vocab", "val_missing", "overlap", "stdlib_vocab", "block",
         "val_fraction", "dtype"],
)
def test_bad_data_options_fail_when_the_module_is_built(tmp_path, make, options, message):
    with pytest.raises(ValueError, match=message):
        TokenDataModule(**make(tmp_path), **{"block_size": 32, "batch_size": 4, **options})


def test_token_id_check_reads_a_bounded_prefix_and_a_sample(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "CHECKED_PREFIX_TOKENS", 100)
    monkeypatch.setattr(shards, "CHECKED_SAMPLES", 11)  # positions 0, 100, ..., 1000
    data = random_tokens(1001, vocab=256)
    data[550] = 999  # neither in the prefix nor sampled: found only when a window reads it
    write_llmc_shard(tmp_path / "a.bin", data)
    shards.check_token_ids(inspect_shard(str(tmp_path / "a.bin")), 256)
    data[500] = 999  # a sampled position
    write_llmc_shard(tmp_path / "a.bin", data)
    with pytest.raises(ValueError, match=r"token id 999 at position 500"):
        shards.check_token_ids(inspect_shard(str(tmp_path / "a.bin")), 256)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_windows_are_disjoint_across_ranks_and_cover_the_shards(tmp_path, world_size, shuffle):
    # Two shards whose windows (63 + 33 = 96) divide among 2 and 3 ranks.
    write_llmc_shard(tmp_path / "a.bin", random_tokens(63 * 16 + 1, vocab=256))
    write_nanogpt_shard(tmp_path / "b.bin", random_tokens(33 * 16 + 5, vocab=256))
    windows = TokenWindows([inspect_shard(str(tmp_path / name)) for name in ("a.bin", "b.bin")], block_size=16)
    assert len(windows) == 96
    seen = []
    for rank in range(world_size):
        sampler = DistributedSampler(windows, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=3, drop_last=True)
        sampler.set_epoch(1)
        seen.append([windows.position(i) for i in sampler])
    flat = [p for rank in seen for p in rank]
    assert len(flat) == len(set(flat))  # disjoint
    expected = {(0, 16 * k) for k in range(63)} | {(1, 16 * k) for k in range(33)}
    assert set(flat) == expected  # every window of both files, each starting a block after the last


def test_the_window_order_is_deterministic_given_the_seed_and_changes_with_the_epoch(tmp_path):
    windows = TokenWindows([random_tokens(16 * 40 + 1, vocab=256)], block_size=16)

    def order(seed, epoch):
        sampler = DistributedSampler(windows, num_replicas=2, rank=0, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(3, 0) == order(3, 0)
    assert order(3, 0) != order(3, 1) and order(3, 0) != order(4, 0)


def test_a_split_too_small_for_one_batch_per_rank_is_named_at_setup(tmp_path):
    data = TokenDataModule(**write_pair(tmp_path), block_size=32, batch_size=64)
    with pytest.raises(ValueError, match=r"data.val_shards \(1 files\) gives 62 windows .* fewer than one batch \(data.batch_size=64\)"):
        data.setup("fit")


def test_stdlib_bytes_without_shards(tmp_path):
    data = TokenDataModule(block_size=32, batch_size=4, max_bytes=20_000)
    data.setup("fit")
    inputs, targets = next(iter(data.train_dataloader()))
    assert inputs.shape == targets.shape == (4, 32)
    assert int(inputs.max()) < 256
