"""A 2-rank fit whose rank 0 fails before the rendezvous, run as a user runs it by
``tests/strategies/test_lost_ranks.py``: ``python rank_zero_fails_early.py ROOT`` (Lightning's
launcher starts rank 1 as its child, which then waits for rank 0's rendezvous store).

Every process writes its pid under ``ROOT/pids/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before the slow imports: the test must know of rank 1 however soon it is ended.
(Path(sys.argv[1]) / "pids").mkdir(exist_ok=True)
(Path(sys.argv[1]) / "pids" / str(os.getpid())).touch()

import lit_dp  # noqa: E402
from tests.helpers.lightning import Regressor, trainer  # noqa: E402

TIMEOUT = 600.0  # the process group's: far longer than the test lets the job take


class FailsOnRankZero(lit_dp.PaddleDPStrategy):
    def setup_environment(self) -> None:
        # Lightning's launcher gives LOCAL_RANK to the ranks it starts, not to itself.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            raise RuntimeError("rank 0 failed before the rendezvous")
        super().setup_environment()


def main(root: Path) -> None:
    trainer(FailsOnRankZero(timeout=TIMEOUT), root, max_epochs=1).fit(Regressor())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
