"""A 2-rank fit whose rank 1 gets stuck in ``training_step`` (``hang_timeout=10``), run as a user runs
it by ``tests/strategies/test_hang_watchdog.py``: ``python stuck_fit.py ROOT`` (Lightning's launcher
starts rank 1 as its child) or ``torchrun --nproc-per-node=2 stuck_fit.py ROOT``.

Every process of the job writes its pid under ``ROOT/pids/``; rank 1 writes the time it got stuck
to ``ROOT/hang_started``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lit_dp
from tests.helpers.lightning import Regressor, trainer

HANG_TIMEOUT = 10.0
STUCK_AT_BATCH = 3  # after the two synchronised steps of warm-up


class StuckRegressor(Regressor):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == STUCK_AT_BATCH:
            (self.root / "hang_started").write_text(str(time.time()))
            time.sleep(3600)  # stuck in user code
        return self.step_loss(*batch)  # no step-level sync_dist: the others wait in a bucket


def main(root: Path) -> None:
    (root / "pids").mkdir(exist_ok=True)
    (root / "pids" / str(os.getpid())).touch()
    trainer(lit_dp.PaddleDPStrategy(hang_timeout=HANG_TIMEOUT), root, max_epochs=1).fit(StuckRegressor(root))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
