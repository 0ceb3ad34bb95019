"""The two formats' writers and readers on real processes (Gloo), without Lightning.

Each rank holds a checkpoint as a strategy builds it: what every rank holds alike (a model, a
schedule) and what only it holds (``RankEntries``: a ZeRO shard by parameter index, a LocalSGD model
by rank). The oracle is the checkpoint assembled in memory on rank 0 (``full.assemble``, the union of
every rank's entries): the full file streamed to rank 0 loads equal to it, and a sharded folder,
consolidated, equals it too; each rank reads back only its own entries.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lit_dp.checkpoint.consolidate import consolidate
from lit_dp.checkpoint.full import assemble, save_full
from lit_dp.checkpoint.sharded import ShardedCheckpoint, save_sharded
from lit_dp.checkpoint.tree import RankEntries
from tests.helpers.distributed import run_ranks


def rank_checkpoint(rank: int, world_size: int) -> dict:
    """What rank ``rank`` holds: the model alike on every rank, its own two parameters' AdamW state, and (past
    rank 0) its own model between syncs."""
    generator = torch.Generator().manual_seed(rank)
    shard = {
        2 * rank: {"exp_avg": torch.randn(5, generator=generator), "step": torch.tensor(3.0)},
        2 * rank + 1: {"exp_avg": torch.randn(300, 7, generator=generator, dtype=torch.float64), "none": None},
    }
    replica = {"model": {"w": torch.full((3, 2), float(rank))}, "optimizers": [{"state": {0: {"m": torch.ones(2) * rank}}, "param_groups": [{"params": [0]}]}]}
    return {
        "state_dict": {"w": torch.arange(6.0).reshape(3, 2), "empty": torch.zeros(0)},
        "optimizer_states": [{"state": RankEntries(shard), "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": list(range(2 * world_size))}]}],
        "lit_dp": {"local_sgd": {"step": 7, "outer": {"snapshot": [torch.ones(2), torch.zeros(3)], "momentum": [None, None]},
                                 "replicas": {"world_size": world_size, "ranks": RankEntries({rank: replica} if rank else {})}}},
        "epoch": 3,
        "loops": {"fit_loop": {}},
    }  # fmt: skip


def assert_same(ours, theirs, where: str = "") -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert set(ours) == set(theirs), f"{where}: keys {sorted(ours, key=str)} != {sorted(theirs, key=str)}"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for index, (mine, reference) in enumerate(zip(ours, theirs)):
            assert_same(mine, reference, f"{where}[{index}]")
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def _init(rank: int) -> int:
    dist.init_process_group("gloo")
    return dist.get_world_size()


def full_and_sharded(rank: int, tmp_path: str) -> dict:
    world_size = _init(rank)
    tmp = Path(tmp_path)
    mine = rank_checkpoint(rank, world_size)
    whole = assemble(mine, dist.group.WORLD)
    save_full(mine, tmp / "full.ckpt", dist.group.WORLD)
    entries = {"model": mine["state_dict"], "optimizer_0": mine["optimizer_states"][0], "lit_dp": mine["lit_dp"]}
    meta = {"epoch": 3, "loops": {"fit_loop": {}}, "pytorch-lightning_version": "2.6"}
    save_sharded(entries, meta if rank == 0 else None, tmp / "sharded.ckpt", dist.group.WORLD)
    dist.barrier()
    folder = ShardedCheckpoint(tmp / "sharded.ckpt")
    # Each rank reads its own entries: its parameters' optimizer state, its own LocalSGD model.
    optimizer = folder.optimizer_state("optimizer_0", lambda index: index // 2 == rank)
    assert set(optimizer["state"]) == {2 * rank, 2 * rank + 1}
    assert_same(optimizer["state"], mine["optimizer_states"][0]["state"], f"rank {rank}'s shard")
    own = folder.read_under(("lit_dp", "local_sgd", "replicas", "ranks", str(rank)))
    assert (own is None) == (rank == 0)
    if rank:
        assert_same(own, mine["lit_dp"]["local_sgd"]["replicas"]["ranks"][rank], f"rank {rank}'s replica")
    if rank == 0:
        assert_same(torch.load(tmp / "full.ckpt", weights_only=False, mmap=True), whole, "the full file")
        consolidated = consolidate(tmp / "sharded.ckpt")
        del consolidated["pytorch-lightning_version"]
        assert_same(consolidated, whole, "the consolidated folder")
    dist.barrier()
    return {name: os.path.getsize(tmp / "sharded.ckpt" / name) for name in os.listdir(tmp / "sharded.ckpt")}


def test_the_streamed_file_and_the_sharded_folder_hold_every_ranks_entries(tmp_path):
    sizes = run_ranks(full_and_sharded, 2, str(tmp_path), launcher="torchrun", timeout=180)[0]
    assert set(sizes) == {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"}
    assert list(tmp_path.glob(".*partial*")) == [], "a temporary name outlived a completed write"


def failed_write(rank: int, tmp_path: str) -> str:
    world_size = _init(rank)
    blocked = Path(tmp_path) / "a file"
    blocked.write_text("not a folder")
    try:
        save_full(rank_checkpoint(rank, world_size), blocked / "last.ckpt", dist.group.WORLD)
    except (OSError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_failed_write_raises_on_every_rank_naming_it(tmp_path):
    errors = run_ranks(failed_write, 2, str(tmp_path), launcher="torchrun", timeout=120)
    path = tmp_path / "a file" / "last.ckpt"
    assert errors[0].startswith("CheckpointWriteError: [Errno ") and f"lit_dp: could not write the checkpoint {path}: " in errors[0]
    assert errors[1] == f"RuntimeError: lit_dp: rank 0 failed writing the checkpoint {path}: {errors[0]}", errors[1]


def test_a_truncated_rank_file_is_named(tmp_path):
    save_sharded({"model": {"w": torch.ones(1000)}}, {"epoch": 0}, tmp_path / "last.ckpt", None)
    shard = tmp_path / "last.ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert ShardedCheckpoint(tmp_path / "last.ckpt").missing_files().startswith("__0_0.distcp holds 100 bytes of ")


@pytest.mark.parametrize("first", ["file", "folder"])
def test_a_checkpoint_replaces_one_of_the_other_format_and_of_its_own(tmp_path, first):
    path = tmp_path / "last.ckpt"
    writers = {
        "file": lambda step: save_full({"global_step": step, "w": torch.ones(3) * step}, path, None),
        "folder": lambda step: save_sharded({"model": {"w": torch.ones(3) * step}}, {"global_step": step}, path, None),
    }
    second = "folder" if first == "file" else "file"
    for step, kind in enumerate((first, first, second), start=1):
        writers[kind](step)
        assert path.is_dir() == (kind == "folder")
    step = ShardedCheckpoint(path).meta()["global_step"] if second == "folder" else torch.load(path)["global_step"]
    assert step == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
