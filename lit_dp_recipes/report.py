"""The recipes' ``[lit_dp] ...`` lines: said once, by rank 0, on the console and in the job's log file.

A line goes to standard output, where the user and the tests read it, and to the logger
``lit_dp_recipes.report``, which ``conf/hydra/default.yaml`` sends to Hydra's job log
(``<run folder>/<task>.log``) only. The library's own lines (``lit_dp``'s ``rank_zero_info``,
through Lightning's ``lightning.pytorch`` logger) reach the same file by the same config.
Before the Trainer exists the rank comes from the launcher's variables (``RANK``,
``LOCAL_RANK``, ``SLURM_PROCID``), as Lightning's ``rank_zero_only`` reads them.
"""

from __future__ import annotations

import logging

from lightning.fabric.utilities.rank_zero import rank_zero_only

PREFIX = "[lit_dp] "
log = logging.getLogger(__name__)


def metric(value: float) -> str:
    """A metric as a line shows it: four decimals for a loss or an accuracy (``val_acc=0.9722``), one
    from 100 up and none from 1000 up, where more digits are noise (``tokens_per_sec=24101``)."""
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:.0f}"
    return f"{value:.1f}" if magnitude >= 100 else f"{value:.4f}"


def say(message: str) -> None:
    """Print ``[lit_dp] message`` on rank 0 and write it to the job's log file."""
    if rank_zero_only.rank != 0:
        return
    print(PREFIX + message, flush=True)
    log.info(PREFIX + message)
