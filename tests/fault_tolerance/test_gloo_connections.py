"""``GlooConnections``: the TCP connections of a real Gloo process group, shut down and watched.

Three ranks build a Gloo group through ``GlooConnections.record`` and keep one of its works:
what kept a replica group's context, and its connections, alive after torchft's abort in issue
34. Rank 2 then shuts its connections down while ranks 0 and 1 wait in an all-reduce with it.
Without the shutdown they would wait for the group's whole timeout; with it, they fail at once,
and see the connections hung up.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lit_dp.fault_tolerance.gloo_connections import GlooConnections
from tests.helpers.distributed import free_port, run_ranks

TIMEOUT = 30.0  # the group's: a rank left waiting would wait this long
AT_ONCE = 10.0  # generous on a loaded machine, and a third of TIMEOUT


def shut_down_while_peers_wait(rank: int, port: int) -> dict:
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timedelta(seconds=60))
    group, connections = GlooConnections.record(
        lambda: dist.ProcessGroupGloo(store, rank, 3, timedelta(seconds=TIMEOUT)), skip_ports=(port,)
    )
    kept = group.allreduce([torch.ones(4)])  # a work kept alive keeps the group's context, and its connections
    kept.wait()
    seen: dict = {"recorded": len(connections.sockets), "hung up while all live": connections.hung_up()}
    if rank == 2:
        store.wait(["0/waiting", "1/waiting"])
        time.sleep(0.5)  # the peers' all-reduces are posted
        connections.shutdown()
        store.wait(["0/done", "1/done"])  # alive, its group and the kept work with it, until they are done
    else:
        work = group.allreduce([torch.ones(4)])
        store.set(f"{rank}/waiting", "1")
        started = time.monotonic()
        try:
            work.wait()
            seen["failed after"] = "the all-reduce completed without rank 2"
        except RuntimeError:
            seen["failed after"] = time.monotonic() - started
        seen["hung up after"] = connections.hung_up()
        store.set(f"{rank}/done", "1")
    # Rank 0 hosts the store: it leaves last, so that no rank's last wait loses it.
    store.set(f"{rank}/finished", "1")
    if rank == 0:
        store.wait(["1/finished", "2/finished"])
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="GlooConnections reads /proc (Linux)")
def test_a_shut_down_group_fails_its_peers_pending_all_reduce_at_once():
    results = run_ranks(shut_down_while_peers_wait, 3, free_port(), timeout=120)
    for rank, seen in results.items():
        # A connection to each peer; neither the store's (skipped) nor Gloo's listener.
        assert seen["recorded"] == 2, (rank, seen)
        assert seen["hung up while all live"] is False, (rank, seen)
    for rank in (0, 1):
        waited = results[rank]["failed after"]
        assert isinstance(waited, float) and waited < AT_ONCE, f"rank {rank}: {waited} (the group's timeout: {TIMEOUT} s)"
        assert results[rank]["hung up after"] is True, (rank, results[rank])


def test_without_proc_nothing_is_recorded(monkeypatch):
    monkeypatch.setattr("lit_dp.fault_tolerance.gloo_connections._FD_DIR", "/nonexistent")
    built, connections = GlooConnections.record(lambda: "built")
    assert built == "built" and connections.sockets == {}
    assert not connections.hung_up()
    connections.shutdown()
