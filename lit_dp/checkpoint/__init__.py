"""Checkpoints that every rank writes and reads its own share of (docs/checkpoints.md).

Two formats, chosen by the strategies' ``state_dict_type`` option (Lightning's name, from its FSDP
strategy):

- ``"full"`` (the default): one ``torch.save`` file, the one every Lightning tool reads, written by
  rank 0 while the other ranks stream it what only they hold, one tensor at a time
  (``lit_dp.checkpoint.full``);
- ``"sharded"``: a folder, Lightning's sharded layout, that every rank writes its part of in
  parallel with ``torch.distributed.checkpoint`` and reads only its part of
  (``lit_dp.checkpoint.sharded``).

What each rank holds apart from the others (ZeRO's optimizer state, LocalSGD's models between
syncs) is marked in its checkpoint as ``RankEntries`` (``lit_dp.checkpoint.tree``). Either format is
written under a temporary name and renamed into place when complete (``lit_dp.checkpoint.atomic``),
synchronously or in the background (``lit_dp.checkpoint.background``, ``async_save``).
``python -m lit_dp.checkpoint.consolidate FOLDER`` turns a sharded checkpoint into the full file
(``lit_dp.checkpoint.consolidate``).
"""

from lit_dp.checkpoint.atomic import CheckpointWriteError
from lit_dp.checkpoint.sharded import ShardedCheckpoint, is_sharded
from lit_dp.checkpoint.tree import RankEntries

__all__ = ["CheckpointWriteError", "RankEntries", "ShardedCheckpoint", "is_sharded"]
