"""One replica group of the fault-tolerance tests: a plain PyTorch loop, ``lit_dp.DataParallel`` under a torchft Manager.

    python -m tests.helpers.ft_replica OUT STEPS [--kill GROUP:STEP] [--async-quorum] [--min-replicas N] [--alone-seconds S]

Its replica group comes from ``REPLICA_GROUP_ID``, the lighthouse from ``TORCHFT_LIGHTHOUSE``.
Every step attempt appends one JSON line to ``OUT/replica<group>.jsonl``: the Manager's step,
whether it committed, the quorum's rank and size, the sample indices it read, and a hash of every
parameter's bytes (so tests compare replicas bitwise) after backward (``before``), after
``should_commit`` (``voted``: a replica recovering under the asynchronous quorum loads its peer's
state there) and after the optimizer (``after``).

``--kill GROUP:STEP``: replica group GROUP, at the first step from STEP on that it shares with
another group (the groups start at different times), SIGKILLs itself before its backward (the
others' all-reduce fails), on its first run only (``OUT/replica<group>.died`` marks it).
``--alone-seconds``: a pause per step while it trains alone, so that a killed peer's restart
comes back before it finishes. At the end the
parameters go to ``OUT/replica<group>.pt``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torchft import Manager, ProcessGroupGloo

import lit_dp

DATASET_SIZE, FEATURES, CLASSES, BATCH = 96, 8, 3, 4


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(DATASET_SIZE, FEATURES, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (DATASET_SIZE,), generator=generator))


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # a different start per replica: torchft's init_sync must make them equal
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def parameters_hash(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill", default="-1:-1", help="GROUP:STEP")
    parser.add_argument("--async-quorum", action="store_true")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--alone-seconds", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])
    died = args.out / f"replica{group}.died"
    victim, die_at = (int(part) for part in args.kill.split(":"))

    net = model(seed=group)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    batches = lit_dp.ReplicaBatches(dataset(), BATCH, seed=0)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=lambda state: (net.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])),
        state_dict=lambda: {"model": net.state_dict(), "optimizer": optimizer.state_dict()},
        min_replica_size=args.min_replicas,
        use_async_quorum=args.async_quorum,
        timeout=timedelta(seconds=10),
        replica_id=str(group),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
    )
    manager.register_state_dict_fn("data", batches.load_state_dict, batches.state_dict)
    wrapped = lit_dp.DataParallel(net, manager=manager, comm_buffer_size=0.0005)  # a few buckets
    with (args.out / f"replica{group}.jsonl").open("a") as record:
        while manager.current_step() < args.steps:
            manager.start_quorum()  # what torchft.optim.OptimizerWrapper.zero_grad does
            optimizer.zero_grad()
            manager.wait_quorum()  # then the step count is the quorum's (a recovering replica's jumps)
            step, rank, participants = manager.current_step(), manager.participating_rank(), manager.num_participants()
            batches.start_step(step, rank, participants)
            plan_start = batches.position
            inputs, targets = batches.next_batch()
            loss = F.cross_entropy(wrapped(inputs), targets)
            if group == victim and step >= die_at and participants > 1 and not died.exists():
                died.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            before = parameters_hash(net)
            committed = manager.should_commit()  # and OptimizerWrapper.step: the optimizer only if committed
            voted = parameters_hash(net)
            if committed:
                optimizer.step()
            first = plan_start + (rank or 0) * BATCH
            line = {
                "step": step, "committed": committed, "rank": rank, "participants": participants,
                "indices": batches.indices(first, BATCH).tolist() if rank is not None else None,
                "before": before, "voted": voted, "after": parameters_hash(net),
            }  # fmt: skip
            record.write(json.dumps(line) + "\n")
            record.flush()
            if participants == 1:
                time.sleep(args.alone_seconds)
    torch.save(net.state_dict(), args.out / f"replica{group}.pt")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
