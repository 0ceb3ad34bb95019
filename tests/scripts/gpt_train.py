"""A small GPT trained the way scripts written for torch DDP train (nanoGPT's ``train.py`` idioms).

On 2 CPU processes, with torch DDP and then with lit_dp::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/gpt_train.py --wrapper ddp --out ddp.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/gpt_train.py --wrapper lit_dp --out lit_dp.json

The runs differ in the two lines a migration changes, marked ``MIGRATION``: how the process
group comes up (``--init torch``: torch's ``init_process_group`` in both) and which class wraps
the model. Everything else is the DDP idiom: ranks seeded differently (the wrapper's
construction makes them equal), the optimizer built before wrapping, gradient accumulation
through ``model.require_backward_grad_sync``, ``raw_model = model.module``, gradient clipping,
an optional ``torch.compile``, ``destroy_process_group`` at the end. Rank 0 writes the loss of
every iteration and the number of synchronised backwards (counted by a communication hook that
is torch's all-reduce hook plus a counter, registered in both runs) to ``--out``.
``tests/test_migration.py`` compares the two runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, BLOCK, LAYERS, HEADS, WIDTH = 64, 16, 2, 2, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (t.view(batch, time, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, WIDTH))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT's

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def get_batch(data: torch.Tensor, iteration: int, micro: int, rank: int, batch_size: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(10_000 * iteration + 100 * micro + rank)
    starts = torch.randint(len(data) - BLOCK - 1, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + BLOCK] for i in starts])
    y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in starts])
    return x, y


def get_lr(iteration: int, iterations: int, lr: float = 1e-2, warmup: int = 3) -> float:
    if iteration < warmup:
        return lr * (iteration + 1) / warmup
    ratio = (iteration - warmup) / max(1, iterations - warmup)
    return lr * 0.1 + 0.5 * (1 + math.cos(math.pi * ratio)) * lr * 0.9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", choices=("ddp", "lit_dp"), required=True)
    parser.add_argument("--init", choices=("torch", "lit_dp"), default="torch")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    ddp = int(os.environ.get("RANK", -1)) != -1
    assert ddp, "run under torchrun (python -m torch.distributed.run)"
    torch.set_num_threads(1)
    if args.init == "torch":
        init_process_group(backend="gloo")  # MIGRATION 1 (--init lit_dp: lit_dp.init_parallel_env())
    else:
        import lit_dp

        lit_dp.init_parallel_env()
    rank = int(os.environ["RANK"])
    master_process = rank == 0
    torch.manual_seed(1337 + rank)  # different on every rank: the wrapper must broadcast rank 0's model
    data = torch.randint(VOCAB, (4096,), generator=torch.Generator().manual_seed(0))

    model = GPT()
    optimizer = model.configure_optimizers(weight_decay=0.1, lr=get_lr(0, args.iterations))
    if args.compile:
        model = torch.compile(model)
    if args.wrapper == "ddp":
        model = DDP(model)  # CPU: no device_ids
    else:
        import lit_dp

        model = lit_dp.DataParallel(model)  # MIGRATION 2
    raw_model = model.module
    # Measurement, the same in both runs: torch's all-reduce hook, counting the synchronised
    # backwards (each calls the hook once per bucket; bucket 0 once).
    synchronised = [0]

    def counting_allreduce(state, bucket):  # unannotated: DDP refuses string annotations (this module's)
        synchronised[0] += bucket.index() == 0
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_allreduce)

    losses = []
    for iteration in range(args.iterations):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iteration, args.iterations)
        for micro_step in range(args.accumulation):
            model.require_backward_grad_sync = micro_step == args.accumulation - 1
            x, y = get_batch(data, iteration, micro_step, rank, batch_size=4)
            _, loss = model(x, y)
            loss = loss / args.accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * args.accumulation)

    weights = sum(p.double().sum().item() for p in raw_model.parameters())
    if master_process:
        with open(args.out, "w") as out:
            json.dump({"losses": losses, "synchronised": synchronised[0], "weights": weights}, out)
    # torch DDP sits in a reference cycle, so its process group outlives destroy_process_group()
    # until a collection, at the latest the interpreter's exit, while Gloo's threads are still
    # alive. A rank of this script then aborted after its work was done ("terminate called without
    # an active exception", in CI and in 1 of 11 runs on an idle 2-core machine, torch 2.13):
    # the group goes while the interpreter is whole.
    del model, raw_model
    gc.collect()
    destroy_process_group()


if __name__ == "__main__":
    main()
