"""One replica group under Fabric with ``fault_tolerance="torchft"``, with transient faults injected at torchft's process group.

    python -m tests.helpers.ft_transient OUT STEPS [--local-sgd K] [--sync-dtype D] [--error-feedback B] [--hidden H]
        [--fail GROUP:RANK:N[,N...]] [--slow-heal S[:N]]
    torchrun --standalone --nproc-per-node=2 -m tests.helpers.ft_transient OUT STEPS ...

The loop docs/fault_tolerance.md shows for Fabric (with ``--local-sgd K``, DiLoCo across the groups:
``local_sgd_steps=K, local_sgd_outer="nesterov"``; ``--sync-dtype``, ``--error-feedback``: its
``local_sgd_sync_dtype``, ``local_sgd_error_feedback``), for STEPS optimizer steps: torchft's committed
steps with per-step sync, LocalSGD's steps with DiLoCo (both travel with a recovering group's state).
``--hidden H``: the classifier's hidden width (16).

``--fail GROUP:RANK:N,...``: on rank RANK of replica group GROUP, the N-th collective across groups
(counted from 1 in this process: all-reduces of buckets, counts and syncs, and a wire-format sync's
all-to-alls and all-gathers alike) is issued and completes for the peers, then reports a failure
here only, as a connection reset seen on one side does. ``--slow-heal S[:N]``: a group that heals
waits S seconds before it reads its peer's state (a loaded machine, a slow link), while the peer goes
on: at every heal, or at its N-th only.
Every rank appends one JSON line per optimizer step to ``OUT/group<g>-rank<r>.jsonl`` (the steps so
far, torchft's committed steps, a hash of the parameters and of the optimizer state, the time) and saves
its parameters, optimizer state and cross-group traffic (``CrossGroupTraffic``) at the end to
``OUT/group<g>-rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import lit_dp
from tests.helpers.ft_lightning_replica import Classifier, dataset
from tests.helpers.ft_replica import BATCH

INJECTED = "injected transient fault: connection reset by peer, seen on this side only"


class _FailedWork(dist.Work):
    """A collective that completed for the peers and failed here."""

    def __init__(self) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_exception(RuntimeError(INJECTED))

    def wait(self, timeout=None) -> bool:
        raise RuntimeError(INJECTED)

    def get_future(self) -> torch.futures.Future:
        return self._future


COLLECTIVES = {"allreduce": "all-reduce", "alltoall_base": "all-to-all", "allgather_into_tensor_coalesced": "all-gather"}


def inject(process_group, failing: set[int]) -> None:
    """Make the listed collectives (1-based, in this process) of torchft's ``process_group`` fail on this side only."""
    count = [0]

    def failing_on_this_side(method: str):
        real = getattr(process_group, method)

        def collective(*args):
            count[0] += 1
            work = real(*args)
            if count[0] not in failing:
                return work
            work.wait()  # issued and completed: the peers see nothing wrong
            print(f"test: {COLLECTIVES[method]} {count[0]} across groups fails here", flush=True)
            return _FailedWork()

        return collective

    for method in COLLECTIVES:
        setattr(process_group, method, failing_on_this_side(method))


def digest(tensors) -> str:
    hashed = hashlib.sha256()
    for tensor in tensors:
        hashed.update(tensor.detach().contiguous().numpy().tobytes())
    return hashed.hexdigest()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--local-sgd", type=int, default=None, help="K")
    parser.add_argument("--sync-dtype", default=None, help="local_sgd_sync_dtype")
    parser.add_argument("--error-feedback", default=None, choices=["true", "false"], help="local_sgd_error_feedback")
    parser.add_argument("--hidden", type=int, default=16, help="the classifier's hidden width")
    parser.add_argument("--fail", default="", help="GROUP:RANK:N[,N...]")
    parser.add_argument("--slow-heal", default="", help="S[:N]: seconds before reading a peer's state (at the N-th heal)")
    parser.add_argument("--min-replicas", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    group, ranks = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(group * ranks + int(os.environ.get("RANK", "0")))  # every rank differs: they must start as one
    diloco = {"local_sgd_steps": args.local_sgd, "local_sgd_outer": "nesterov"} if args.local_sgd else {}
    if args.sync_dtype:
        diloco["local_sgd_sync_dtype"] = args.sync_dtype
    if args.error_feedback:
        diloco["local_sgd_error_feedback"] = args.error_feedback == "true"
    strategy = lit_dp.fabric.PaddleDPStrategy(
        fault_tolerance="torchft", ft_timeout=20, ft_min_replicas=args.min_replicas, **diloco
    )
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=ranks)
    fabric.launch()
    net = Classifier(args.hidden).net
    inner = torch.optim.Adam(net.parameters(), lr=0.01)
    model, optimizer = fabric.setup(net, inner)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    ft = fabric.strategy.fault_tolerance
    rank = fabric.global_rank
    if args.fail:
        victim, victim_rank, counts = args.fail.split(":")
        if int(victim) == group and int(victim_rank) == rank:
            inject(ft.manager._pg, {int(n) for n in counts.split(",")})

    if args.slow_heal:
        seconds, _, which = args.slow_heal.partition(":")
        transport = ft.manager._checkpoint_transport
        read = transport.recv_checkpoint
        reads = [0]

        def slow_read(*args_, **kwargs):
            reads[0] += 1
            if not which or reads[0] == int(which):
                time.sleep(float(seconds))
            return read(*args_, **kwargs)

        transport.recv_checkpoint = slow_read

    def progress() -> int:
        return fabric.strategy.local_sgd.step_count if args.local_sgd else ft.committed_steps

    path = args.out / f"group{group}-rank{rank}.jsonl"
    while progress() < args.steps:
        for inputs, targets, _ in loader:
            fabric.backward(F.cross_entropy(model(inputs), targets))
            optimizer.step()  # applied only if the step commits
            optimizer.zero_grad()
            line = {
                "steps": progress(),
                "count": ft.committed_steps,
                "time": time.monotonic(),
                "params": digest(net.parameters()),
                "optimizer": digest(optimizer_tensors(inner)),
            }
            with path.open("a") as record:
                record.write(json.dumps(line) + "\n")
            if progress() >= args.steps:
                break
    watched = ft.traffic  # the model's process group's: the teardown lets go of it
    fabric.strategy.teardown()  # LocalSGD's last sync, when the run did not end on one
    traffic = dataclasses.asdict(watched) if watched is not None else None
    state = {"model": net.state_dict(), "optimizer": [t.clone() for t in optimizer_tensors(inner)], "traffic": traffic}
    torch.save(state, args.out / f"group{group}-rank{rank}.pt")


if __name__ == "__main__":
    main()
