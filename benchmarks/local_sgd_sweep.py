"""DiLoCo's outer learning rate and momentum, swept in one process: where ``local_sgd.outer_*``'s defaults come from.

    python -m benchmarks.local_sgd_sweep
    python -m benchmarks.local_sgd_sweep local_steps=[16] outer='[[0.8,0.5]]' steps=100

A simulation, not the library: ``world_size`` workers in one process, each with its own copy of
the GPT recipe's default small GPT (``conf/model/gpt.yaml``: 2 x 128) and its own AdamW with the
recipe's schedule (warm-up, cosine over ``steps``) and clipping, each on its own
``DistributedSampler`` shard of the recipe's stdlib bytes, ``batch_size`` x ``block_size``
tokens per worker and step. Modes:

- ``dp``: data parallelism, every worker steps on the mean gradient;
- ``average K``: every K steps the workers' parameters are replaced by their mean (LocalSGD);
- ``nesterov K lr m``: every K steps the mean change since the last sync is the pseudo-gradient
  of an outer SGD with Nesterov momentum ``m`` and learning rate ``lr`` (DiLoCo), applied to the
  parameters of the last sync, which every worker then takes.

Reported: the validation loss of the final (synchronised) model on the recipe's validation
batches (``val_batches`` per worker, as ``trainer.limit_val_batches``); for LocalSGD the mean of
the workers' own losses just before the last sync; for DiLoCo, when data parallelism and
averaging at its K ran in the same command, the fraction of averaging's gap to data parallelism
it closes; with ``curve_batches``, the loss after every sync. At ``steps=320`` the data-parallel
and DiLoCo losses are ``benchmarks/local_sgd_gpt.py``'s to the fourth decimal (the same initial
weights, data order and schedule). What else can move: the inner schedule (``lr``, ``min_lr``,
``warmup_steps``, ``lr_decay_steps``), clipping (``clip``), data-parallel steps before the local
phase (``dp_steps``), an outer schedule (``outer_lr_end``, ``outer_momentum_end``: each moves from
the pair's value towards its end one as the inner lr falls below its peak so far; the library has
no such schedule) and a plain average for the last sync (``last_average``). Deterministic: the
same command prints the same table. Runs one mode after another on one thread per process; pass
``modes_from``/``modes_to`` to split the list over processes.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.common import benchmark_main
from lit_dp_recipes.gpt import GPT, adamw, lr_at
from lit_dp_recipes.token_data import TokenWindows, stdlib_text


@dataclass
class SweepConfig:
    """What to sweep (defaults: the GPT recipe's, ``conf/gpt.yaml``)."""

    world_size: int = 2
    steps: int = 300
    local_steps: tuple[int, ...] = (16, 64)
    outer: tuple[tuple[float, float], ...] = ((0.7, 0.5), (0.8, 0.5), (0.9, 0.5), (0.7, 0.6), (0.9, 0.6), (0.7, 0.9))
    batch_size: int = 32
    block_size: int = 64
    val_batches: int = 20
    seed: int = 7
    lr: float = 3e-3  # the inner AdamW's schedule: conf/model/gpt.yaml's (lr == min_lr, warmup_steps=0: constant)
    min_lr: float = 3e-4
    warmup_steps: int = 30
    lr_decay_steps: Optional[int] = None  # the step the inner cosine reaches min_lr; None: steps
    clip: Optional[float] = 1.0  # trainer.gradient_clip_val; None: no clipping
    dp_steps: int = 0  # local_sgd.warmup_steps: data-parallel steps before the local phase
    # An outer schedule the library does not have: from each pair's value towards these as the inner lr falls; None: constant.
    outer_lr_end: Optional[float] = None
    outer_momentum_end: Optional[float] = None
    last_average: bool = False  # the run's last sync a plain average rather than an outer step (nesterov modes)
    curve_batches: int = 0  # > 0: also the loss after every sync (K of the first local_steps), on this many batches per worker
    threads: int = 1
    modes_from: int = 0  # run modes[modes_from:modes_to] of the list (dp, then per K: average, nesterov...)
    modes_to: int | None = None


def _modes(config: SweepConfig) -> list[tuple]:
    modes: list[tuple] = [("dp",)]
    for k in config.local_steps:
        modes.append(("average", k))
        modes += [("nesterov", k, lr, momentum) for lr, momentum in config.outer]
    return modes[config.modes_from : config.modes_to]


def _loaders(config: SweepConfig) -> tuple[list[DataLoader], list[DataLoader]]:
    data = np.frombuffer(stdlib_text(1_000_000), dtype=np.uint8)
    split = int(len(data) * 0.9)
    train, val = TokenWindows([data[:split]], config.block_size), TokenWindows([data[split:]], config.block_size)

    def loader(windows: TokenWindows, rank: int, shuffle: bool) -> DataLoader:
        sampler = DistributedSampler(windows, config.world_size, rank, shuffle=shuffle, seed=config.seed, drop_last=True)
        return DataLoader(windows, batch_size=config.batch_size, sampler=sampler, drop_last=True)

    ranks = range(config.world_size)
    return [loader(train, r, True) for r in ranks], [loader(val, r, False) for r in ranks]


def _batches(loader: DataLoader):
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield from loader


def train(mode: tuple, config: SweepConfig) -> dict[str, float]:
    """One mode; returns the final model's validation loss (``val``), and for LocalSGD the mean of the
    workers' own losses just before the last sync (``local``)."""
    torch.manual_seed(config.seed)
    base = GPT(block_size=config.block_size, n_layer=2, n_head=4, n_embd=128, vocab_size=256, warmup_steps=config.warmup_steps)
    workers = [copy.deepcopy(base) for _ in range(config.world_size)]
    optimizers = [adamw(w, config.lr, 0.1, (0.9, 0.95), torch.device("cpu")) for w in workers]
    train_loaders, val_loaders = _loaders(config)
    streams = [_batches(loader) for loader in train_loaders]
    snapshot = [p.detach().clone() for p in base.parameters()]
    momentum = [torch.zeros_like(p) for p in snapshot]
    decay_steps = config.lr_decay_steps if config.lr_decay_steps is not None else config.steps
    result: dict[str, float] = {}
    peak_lr = 0.0
    for step in range(1, config.steps + 1):
        lr = lr_at(step - 1, config.lr, config.min_lr, config.warmup_steps, decay_steps)
        peak_lr = max(peak_lr, lr)
        synchronous = mode[0] == "dp" or step <= config.dp_steps
        for worker, optimizer, stream in zip(workers, optimizers, streams):
            inputs, targets = next(stream)
            worker(inputs, targets).backward()
        if synchronous:
            for params in zip(*(w.parameters() for w in workers)):
                mean = torch.stack([p.grad for p in params]).mean(dim=0)
                for p in params:
                    p.grad.copy_(mean)
        for worker, optimizer in zip(workers, optimizers):
            if config.clip is not None:
                torch.nn.utils.clip_grad_norm_(worker.parameters(), config.clip)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if mode[0] == "dp" and config.curve_batches and step % config.local_steps[0] == 0 and step < config.steps:
            result[f"step {step}"] = _validate(workers[0], val_loaders, config.curve_batches)
        if synchronous:
            if step == config.dp_steps:  # the local phase starts from here
                for index, p in enumerate(workers[0].parameters()):
                    snapshot[index].copy_(p.detach())
            continue
        if step == config.steps:
            result["local"] = float(np.mean([_validate(w, val_loaders, config.val_batches) for w in workers]))
        if (step - config.dp_steps) % mode[1] == 0 or step == config.steps:
            last = step == config.steps and config.last_average
            _sync(("average",) if last else _outer_at(mode, lr, peak_lr, config), workers, snapshot, momentum)
            if config.curve_batches and step < config.steps:
                result[f"step {step}"] = _validate(workers[0], val_loaders, config.curve_batches)
    result["val"] = _validate(workers[0], val_loaders, config.val_batches)
    return result


def _outer_at(mode: tuple, lr: float, peak_lr: float, config: SweepConfig) -> tuple:
    """The mode with its outer lr and momentum at a sync where the inner lr is ``lr`` and was at most
    ``peak_lr`` so far: each moves from the pair's value towards its ``_end`` one as the inner lr falls,
    ``end + (start - end) * lr / peak_lr``."""
    if mode[0] != "nesterov":
        return mode
    ratio = lr / peak_lr
    lr_out, momentum = mode[2], mode[3]
    if config.outer_lr_end is not None:
        lr_out = config.outer_lr_end + (lr_out - config.outer_lr_end) * ratio
    if config.outer_momentum_end is not None:
        momentum = config.outer_momentum_end + (momentum - config.outer_momentum_end) * ratio
    return (*mode[:2], lr_out, momentum)


@torch.no_grad()
def _sync(mode: tuple, workers: list[GPT], snapshot: list[torch.Tensor], momentum: list[torch.Tensor]) -> None:
    for index, params in enumerate(zip(*(w.parameters() for w in workers))):
        pseudo_gradient = torch.stack([snapshot[index] - p for p in params]).mean(dim=0)
        if mode[0] == "average":
            snapshot[index] -= pseudo_gradient
        else:  # torch.optim.SGD(nesterov=True, dampening=0): the buffer starts at the first gradient
            _, _, lr, mu = mode
            buffer = momentum[index].mul_(mu).add_(pseudo_gradient)
            snapshot[index] -= lr * (pseudo_gradient + mu * buffer)
        for p in params:
            p.copy_(snapshot[index])


@torch.no_grad()
def _validate(model: GPT, loaders: list[DataLoader], batches: int) -> float:
    losses = [model(*batch).item() for loader in loaders for batch in itertools.islice(loader, batches)]
    return float(np.mean(losses))


def _name(mode: tuple) -> str:
    if mode[0] == "dp":
        return "data parallel"
    if mode[0] == "average":
        return f"averaging K={mode[1]}"
    return f"nesterov K={mode[1]} lr={mode[2]:g} momentum={mode[3]:g}"


def run_and_report(config: SweepConfig) -> str:
    torch.set_num_threads(config.threads)
    lines = [
        f"| mode | val loss after {config.steps} steps | workers' own, before the last sync | of averaging's gap closed |",
        "|---|---|---|---|",
    ]
    losses: dict[tuple, float] = {}
    for mode in _modes(config):
        result = train(mode, config)
        losses[mode[:2]] = result["val"]
        gap = ""
        dp, average = losses.get(("dp",)), losses.get(("average", mode[1])) if mode[0] == "nesterov" else None
        if dp is not None and average is not None and average != dp:  # both ran in this command, and there is a gap
            gap = f"{(average - result['val']) / (average - dp):.2f}"
        local = f"{result['local']:.4f}" if "local" in result else ""
        lines.append(f"| {_name(mode)} | {result['val']:.4f} | {local} | {gap} |")
        print(lines[-1], flush=True)
        curve = {key: value for key, value in result.items() if key.startswith("step")}
        if curve:
            print("  after each sync: " + ", ".join(f"{key.split()[1]}: {value:.3f}" for key, value in curve.items()), flush=True)
    assert all(math.isfinite(float(line.split("|")[2])) for line in lines[2:])
    return "\n".join(lines)


main = benchmark_main("local_sgd_sweep", SweepConfig, run_and_report)


if __name__ == "__main__":
    main()
