"""A sharded checkpoint's folder as one full checkpoint file::

    python -m lit_dp.checkpoint.consolidate outputs/digits/<run>/checkpoints/last.ckpt
    python -m lit_dp.checkpoint.consolidate FOLDER --output_file last.full.ckpt

The file is what ``state_dict_type="full"`` would have written at that step: a Trainer's checkpoint
with its ``state_dict`` and ``optimizer_states`` (each optimizer's state in torch's own form, integer
keys), Lightning's loops and callbacks' state, and lit_dp's entry with every rank's LocalSGD model
between syncs; a ``fabric.save`` folder as the dict it was given. ``LightningModule.load_from_checkpoint``
and ``trainer.fit(ckpt_path=...)`` read it, under any strategy (the optimizer states are the
unsharded optimizers'). The arguments are those of Lightning's own command,
``python -m lightning.pytorch.utilities.consolidate_checkpoint``, which reads these folders too
(the model's weights come out the same; the optimizer states keep the strings that
``torch.distributed.checkpoint`` makes of their integer keys, which a resumed fit does not match).

The consolidation runs in one process and holds the whole checkpoint in memory, as Lightning's and
torch's ``dcp_to_torch_save`` do.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from lit_dp.checkpoint.atomic import write_atomically
from lit_dp.checkpoint.sharded import ShardedCheckpoint, is_sharded

# How a Trainer's checkpoint names its entries in a sharded folder (Lightning's FSDPStrategy's names).
_OPTIMIZER = re.compile(r"optimizer_(\d+)")
_FEATURES = "lit_dp"  # lit_dp.strategies.feature.CHECKPOINT_KEY: the strategies' own entry


def consolidate(folder: str | Path) -> dict[str, Any]:
    """The full checkpoint a sharded folder holds, in memory."""
    checkpoint = ShardedCheckpoint(folder)
    meta = checkpoint.meta(weights_only=False)  # the job's own file (hyper-parameters are objects)
    entries = checkpoint.read(lambda path: True)
    if "loops" in meta or "pytorch-lightning_version" in meta:  # a Trainer's: Lightning's names back
        if "model" in entries:
            entries["state_dict"] = entries.pop("model")
        optimizers = sorted((int(match.group(1)), name) for name in entries if (match := _OPTIMIZER.fullmatch(name)))
        if optimizers:
            entries["optimizer_states"] = [entries.pop(name) for _, name in optimizers]
    return {**meta, **entries}


def main(arguments: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lit_dp.checkpoint.consolidate",
        description="Writes a sharded lit_dp (or Lightning) checkpoint folder as one full checkpoint file.",
    )
    parser.add_argument("checkpoint_folder", help="the folder of a checkpoint saved with state_dict_type='sharded'")
    parser.add_argument(
        "--output_file",
        help="the file to write (it must not exist); default: the folder's name with '.consolidated' appended",
    )
    given = parser.parse_args(arguments)
    folder = Path(given.checkpoint_folder)
    if not is_sharded(folder):
        parser.error(f"checkpoint_folder={str(folder)!r} is not a sharded checkpoint's folder: expected a folder holding meta.pt and .metadata")
    output = Path(given.output_file) if given.output_file else folder.with_name(folder.name + ".consolidated")
    if output.exists():
        parser.error(f"--output_file={str(output)!r} exists: expected a path to a file not yet written")
    write_atomically(consolidate(folder), output)
    print(f"[lit_dp] {folder} consolidated into {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
