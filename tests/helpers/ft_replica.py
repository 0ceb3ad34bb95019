"""One replica group of the fault-tolerance tests: a plain PyTorch loop, ``lit_dp.DataParallel`` under a torchft Manager.

    python -m tests.helpers.ft_replica OUT STEPS [--kill GROUP:STEP] [--async-quorum] [--min-replicas N] [--alone-seconds S]
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 -m tests.helpers.ft_replica OUT STEPS ...

Its replica group comes from ``REPLICA_GROUP_ID``, the lighthouse from ``TORCHFT_LIGHTHOUSE``. Under
torchrun the group has the job's ranks (Gloo), which share the Manager's store
(``lit_dp.fault_tolerance.manager.group_store``), and rank ``r`` of a group records to
``OUT/replica<group>-rank<r>.jsonl`` (rank 0 to ``OUT/replica<group>.jsonl``).
Every step attempt appends one JSON line to ``OUT/replica<group>.jsonl``: the Manager's step,
whether it committed, the quorum's rank and size, the sample indices it read, and a hash of every
parameter's bytes (so tests compare replicas bitwise) after backward (``before``), after
``should_commit`` (``voted``: a replica recovering under the asynchronous quorum loads its peer's
state there) and after the optimizer (``after``).

``--kill GROUP:STEP``: replica group GROUP, at the first step from STEP on that it shares with
another group (the groups start at different times), SIGKILLs itself before its backward (the
others' all-reduce fails), on its first run only (``OUT/replica<group>.died`` marks it); in a
group of several ranks only its last rank does (``--kill-rank`` chooses another).
``--alone-seconds``: a pause per step while it trains alone, and before its last two steps a wait
for a killed group that has not come back (``OUT/replica<group>.back``, which a restarted group's
rank 0 writes just before its first quorum), so that the restart meets the others however slowly
the machine imports and rendezvouses; ``--restart-seconds``: under torchrun, a pause before a restarted
group starts, so that the others go on without it first. At the end the
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
from lit_dp.fault_tolerance.manager import group_store

DATASET_SIZE, FEATURES, CLASSES, BATCH = 96, 8, 3, 4


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(DATASET_SIZE, FEATURES, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (DATASET_SIZE,), generator=generator))


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # a different start per replica: torchft's init_sync must make them equal
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def trained_on(seed: int, steps: list[list[int]]) -> nn.Module:
    """One process from ``model(seed)``, with the replicas' optimizer, each step on the samples of
    ``steps`` (the ranks' batches concatenated: equal sizes, so the mean loss's gradient is the
    mean of their gradients): the reference the replicas must equal."""
    reference = model(seed)
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    data = dataset()
    for indices in steps:
        inputs, targets = data[torch.tensor(indices)]
        F.cross_entropy(reference(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return reference


def parameters_hash(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().numpy().tobytes())
    return digest.hexdigest()


def wait_for_restarting_groups(out: Path, timeout: float = 120.0) -> None:
    """Waits while a killed group has not come back; past ``timeout`` the run goes on (and the test's
    checks say the restarted group missed the others)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        not died.with_suffix(".back").exists() for died in out.glob("replica*.died")
    ):
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill", default="-1:-1", help="GROUP:STEP")
    parser.add_argument("--async-quorum", action="store_true")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--alone-seconds", type=float, default=0.0)
    parser.add_argument("--kill-rank", type=int, default=-1, help="the rank of the group that dies (its last)")
    parser.add_argument("--restart-seconds", type=float, default=0.0, help="a pause before a restarted group starts")
    args = parser.parse_args()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        time.sleep(args.restart_seconds)  # what a real restart costs: the others go on without this group meanwhile
    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:  # a replica group of several ranks: its launcher's job (lit_dp's rendezvous survives its restarts)
        lit_dp.init_parallel_env("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank() if ranks > 1 else 0
    died = args.out / f"replica{group}.died"
    victim, die_at = (int(part) for part in args.kill.split(":"))
    victim_rank = args.kill_rank % ranks
    suffix = f"-rank{rank}" if rank else ""

    net = model(seed=group * ranks + rank)  # every rank differs: the group's broadcast and init_sync equalise them
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    batches = lit_dp.ReplicaBatches(dataset(), BATCH, seed=0)
    store, host, port = group_store(ranks)  # held to the end: rank 0 hosts the group's store
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=lambda state: (net.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])),
        state_dict=lambda: {"model": net.state_dict(), "optimizer": optimizer.state_dict()},
        min_replica_size=args.min_replicas,
        use_async_quorum=args.async_quorum,
        timeout=timedelta(seconds=10),
        replica_id=str(group),
        store_addr=host,
        store_port=port,
        rank=rank,
        world_size=ranks,
    )
    manager.register_state_dict_fn("data", batches.load_state_dict, batches.state_dict)
    wrapped = lit_dp.DataParallel(net, manager=manager, comm_buffer_size=0.0005)  # a few buckets
    traffic = wrapped.process_group.traffic
    if rank == 0 and died.exists():  # a killed group's restart, just before its first quorum
        died.with_suffix(".back").touch()
    with (args.out / f"replica{group}{suffix}.jsonl").open("a") as record:
        while manager.current_step() < args.steps:
            manager.start_quorum()  # what torchft.optim.OptimizerWrapper.zero_grad does
            optimizer.zero_grad()
            manager.wait_quorum()  # then the step count is the quorum's (a recovering replica's jumps)
            step, quorum_rank, participants = manager.current_step(), manager.participating_rank(), manager.num_participants()
            replica_rank = None if quorum_rank is None else quorum_rank * ranks + rank  # among every group's ranks
            batches.start_step(step, replica_rank, participants * ranks)
            plan_start = batches.position
            inputs, targets = batches.next_batch()
            loss = F.cross_entropy(wrapped(inputs), targets)
            dies = group == victim and rank == victim_rank and step >= die_at and participants > 1
            if dies and not died.exists():
                died.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            before = parameters_hash(net)
            committed = manager.should_commit()  # and OptimizerWrapper.step: the optimizer only if committed
            voted = parameters_hash(net)
            if committed:
                optimizer.step()
            first = plan_start + (replica_rank or 0) * BATCH
            line = {
                "step": step, "committed": committed, "rank": replica_rank, "participants": participants,
                "indices": batches.indices(first, BATCH).tolist() if replica_rank is not None else None,
                "before": before, "voted": voted, "after": parameters_hash(net),
                "reduced_bytes": traffic.reduced_bytes, "across_bytes": traffic.across_bytes,
                "allreduces": traffic.allreduces,
            }  # fmt: skip
            record.write(json.dumps(line) + "\n")
            record.flush()
            if participants == 1 and args.alone_seconds:
                time.sleep(args.alone_seconds)
                if args.steps - manager.current_step() <= 2:  # the last two steps are left for the restart to share
                    wait_for_restarting_groups(args.out)
    torch.save(net.state_dict(), args.out / f"replica{group}{suffix}.pt")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
