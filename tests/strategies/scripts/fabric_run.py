"""A Fabric run of 4 steps on 2 ranks, for ``tests/strategies/test_fabric_teardown.py``.

``python fabric_run.py TRACE_DIR teardown|exit``: Lightning's script launcher starts rank 1
from this file. The strategy traces steps 1 to 9 (``trace_steps=[1, 10]``), more than the run
takes, watches for hangs, and forecasts 8 ranks when the run ends (``forecast_ranks=[8]``). ``teardown``: the script calls ``fabric.strategy.teardown()``,
after which no lit_dp thread may be alive. ``exit``: it ends without one, as Fabric scripts do;
each lit_dp thread left must be one Lightning's test suites can stop (a daemon with ``stop()``).
"""

from __future__ import annotations

import sys
import threading

import torch
from lightning.fabric import Fabric
from torch import nn

import lit_dp  # noqa: F401 - registers "paddle_dp"
from lit_dp.strategies.fabric import PaddleDPStrategy


def lit_dp_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("lit_dp")]


def main(trace_dir: str, ending: str) -> None:
    strategy = PaddleDPStrategy(
        trace_dir=trace_dir,
        trace_steps=[1, 10],
        hang_timeout=60,
        straggler_every_n_steps=2,
        consistency_every_n_steps=2,
        forecast_ranks=[8],
    )
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Linear(6, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(4):
        fabric.backward(model(torch.randn(4, 6)).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert lit_dp_threads(), "no hang watchdog thread: the test would prove nothing"
    if ending == "teardown":
        fabric.strategy.teardown()
        assert not lit_dp_threads(), f"left after teardown: {lit_dp_threads()}"
    else:
        for thread in lit_dp_threads():  # what Lightning's thread police does with a thread left behind
            assert thread.daemon and callable(getattr(thread, "stop", None)), f"cannot be stopped: {thread}"
            thread.stop()
            assert not thread.is_alive(), f"still alive after stop(): {thread}"
    print(f"rank {fabric.global_rank}: {ending} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
