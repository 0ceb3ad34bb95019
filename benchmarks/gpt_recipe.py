"""The GPT recipe against the bare loop it wraps: tokens/s, their ratio, MFU and dynamo recompiles.

    python -m benchmarks.gpt_recipe                                  # CPU, one process: the recipe's small GPT
    python -m benchmarks.gpt_recipe experiment=gpt2_small trainer.max_steps=300 trainer.val_check_interval=150
    python -m benchmarks.gpt_recipe rounds=5                         # alternate 5 times, report medians

The config (``benchmarks/conf/gpt_recipe.yaml``) is the recipe's own, ``conf/gpt.yaml``: every
key of ``recipes/gpt.py`` applies, with ``experiment=gpt_bench_cpu`` unless another is named.
Both runs are built from it, in one process, on one device, on the same random-token shard
(llm.c format, in a temporary folder), so model, batch, precision, compilation, optimizer,
schedule and clipping are the same:

1. **bare**: the loop nanoGPT's ``train.py`` writes, without its globals: ``torch.compile``
   of the model, fused AdamW with the same groups, the learning rate set each step, autocast,
   clipping, random windows read from the memory-mapped shard, pinned and copied without
   blocking, the next batch fetched while the step runs; an evaluation before training and
   every ``trainer.val_check_interval`` steps, as the recipe validates.
2. **recipe**: ``lit_dp_recipes.train.train(cfg)``, the Lightning recipe with ``paddle_dp``
   on a group of one rank, validation inside the run.

Each meter counts every training step after the first ``callbacks.throughput.warmup``
(recompilation included) and stops for validations, reading the clock after a device
synchronisation. The recipe's is its own ``TokenThroughput`` callback. The checkpoint
callbacks are left out (the bare loop saves nothing) and so is the progress bar; everything
else runs as ``recipes/gpt.py`` runs it. With ``rounds=N`` the two alternate N times and
medians are reported.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import lightning.pytorch as pl
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from benchmarks.common import CONFIGS
from lit_dp_recipes.callbacks import BF16_PRECISIONS, dynamo_graphs_compiled, peak_bf16_flops
from lit_dp_recipes.config import register_configs
from lit_dp_recipes.gpt import adamw, lr_at
from lit_dp_recipes.shards import tokens as shard_tokens
from lit_dp_recipes.shards import inspect_shard, write_llmc_shard
from lit_dp_recipes.train import train

PRECISIONS = ("32-true", "32", "bf16-mixed")
CHECKPOINT_CALLBACKS = ("model_checkpoint", "step_checkpoint")


@dataclass
class Measured:
    tokens_per_sec: float
    mfu: float | None
    recompiles: int


def check_config(cfg: DictConfig) -> None:
    """What the two loops must agree on, checked before either starts; a ``ValueError`` naming the key."""
    if cfg.rounds < 1:
        raise ValueError(f"rounds={cfg.rounds} is invalid: expected an integer >= 1.")
    if cfg.trainer.devices != 1:
        raise ValueError(f"trainer.devices={cfg.trainer.devices!r} is invalid here: the bare loop runs on one device.")
    if cfg.trainer.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={cfg.trainer.precision!r} is invalid here: expected one of {', '.join(PRECISIONS)}.")
    if not isinstance(cfg.trainer.max_steps, int) or cfg.trainer.max_steps <= cfg.callbacks.throughput.warmup:
        raise ValueError(
            f"trainer.max_steps={cfg.trainer.max_steps} is invalid here: expected more steps than "
            f"callbacks.throughput.warmup={cfg.callbacks.throughput.warmup}."
        )
    for option in ("val_check_interval", "limit_val_batches"):
        value = cfg.trainer[option]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"trainer.{option}={value!r} is invalid here: expected a number of steps or batches.")


def write_random_shards(cfg: DictConfig, folder: Path) -> tuple[str, str]:
    """A training shard that one epoch of the run does not exhaust, and a validation shard."""
    data, trainer = cfg.data, cfg.trainer
    train_windows = (trainer.max_steps * trainer.accumulate_grad_batches + 1) * data.batch_size
    val_windows = max(trainer.limit_val_batches, 2) * data.batch_size
    generator = np.random.default_rng(cfg.seed)
    paths = []
    for name, windows in (("train", train_windows), ("val", val_windows)):
        paths.append(str(folder / f"random_{name}_000000.bin"))
        write_llmc_shard(paths[-1], generator.integers(data.vocab_size, size=windows * data.block_size + 1, dtype=np.uint16))
    return paths[0], paths[1]


def device_of(cfg: DictConfig) -> torch.device:
    return torch.device("cuda", 0) if cfg.trainer.accelerator in ("gpu", "cuda") else torch.device("cpu")


def peak_flops(cfg: DictConfig, device: torch.device) -> float | None:
    """The peak the recipe's throughput meter uses: ``callbacks.throughput.peak_flops``, else a known GPU's bf16 peak."""
    if cfg.callbacks.throughput.peak_flops is not None:
        return float(cfg.callbacks.throughput.peak_flops)
    if device.type == "cuda" and cfg.trainer.precision in BF16_PRECISIONS:
        return peak_bf16_flops(torch.cuda.get_device_name(device))
    return None


class _Meter:
    """Tokens per second over the steps after the warm-up, stopped around evaluations (the recipe's rules)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0
        self.tokens = 0
        self._since: float | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._since = self._now()

    def stop(self) -> None:
        if self._since is not None:
            self.seconds += self._now() - self._since
            self._since = None


def run_bare(cfg: DictConfig, train_path: str, val_path: str) -> Measured:
    """nanoGPT's loop on the recipe's config (see the module docstring)."""
    device = device_of(cfg)
    torch._dynamo.reset()  # each run compiles afresh (both runs compile the same GPT.forward)
    pl.seed_everything(cfg.seed)
    model = instantiate(cfg.model, _convert_="all").to(device)
    # Plain values for the loop: reading a DictConfig costs tens of microseconds a key.
    hp = OmegaConf.to_container(cfg.model, resolve=True)
    block, batch = cfg.data.block_size, cfg.data.batch_size
    max_steps, accumulate, clip = cfg.trainer.max_steps, cfg.trainer.accumulate_grad_batches, cfg.trainer.gradient_clip_val
    val_every, val_batches, warmup = cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches, cfg.callbacks.throughput.warmup
    decay_steps = hp["lr_decay_steps"] if hp["lr_decay_steps"] is not None else max_steps
    optimizer = adamw(model, hp["lr"], hp["weight_decay"], tuple(hp["betas"]), device)
    compiled = torch.compile(model, backend=cfg.compile_backend) if cfg.compile else model
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if cfg.trainer.precision == "bf16-mixed"
        else contextlib.nullcontext()
    )
    train_data, val_data = shard_tokens(inspect_shard(train_path)), shard_tokens(inspect_shard(val_path))
    generator = torch.Generator().manual_seed(cfg.seed)

    def get_batch(tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(tokens) - block, (batch,), generator=generator).tolist()
        x = torch.stack([torch.from_numpy(tokens[i : i + block].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(tokens[i + 1 : i + 1 + block].astype(np.int64)) for i in starts])
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    evaluated = False
    recompiles = 0

    def evaluate(batches: int) -> None:
        nonlocal evaluated, recompiles
        model.eval()
        with torch.no_grad(), autocast:
            for _ in range(batches):
                before = dynamo_graphs_compiled()
                compiled(*get_batch(val_data))
                recompiles += (dynamo_graphs_compiled() - before) if evaluated else 0
                evaluated = True
        model.train()

    meter = _Meter(device)
    evaluate(2)  # Lightning's sanity check: 2 validation batches before training
    x, y = get_batch(train_data)
    for step in range(max_steps):
        before = dynamo_graphs_compiled()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, hp["lr"], hp["min_lr"], hp["warmup_steps"], decay_steps)
        for _ in range(accumulate):
            with autocast:
                loss = compiled(x, y) / accumulate
            x, y = get_batch(train_data)  # while the device still runs the forward
            loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done == warmup:
            meter.start()
        elif done > warmup:
            meter.tokens += accumulate * batch * block
            recompiles += dynamo_graphs_compiled() - before
        if done % val_every == 0:
            meter.stop()
            evaluate(val_batches)
            if done >= warmup:
                meter.start()
    meter.stop()
    tokens_per_sec = meter.tokens / meter.seconds
    peak = peak_flops(cfg, device)
    mfu = model.flops_per_token(block) * tokens_per_sec / peak if peak else None
    return Measured(tokens_per_sec, mfu, recompiles)


def run_recipe(cfg: DictConfig) -> Measured:
    torch._dynamo.reset()
    metrics = train(cfg)
    return Measured(metrics["tokens_per_sec"], metrics.get("mfu"), int(metrics["dynamo_recompiles"]))


def report(cfg: DictConfig, bare: list[Measured], recipe: list[Measured]) -> str:
    device = device_of(cfg)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    params = sum(p.numel() for p in instantiate(cfg.model, _convert_="all").parameters())
    lines = [
        f"GPT {cfg.model.n_layer} x {cfg.model.n_embd}, {params / 1e6:.1f} M parameters, vocab {cfg.data.vocab_size}, "
        f"batch {cfg.data.batch_size} x {cfg.data.block_size}, {cfg.trainer.precision}, "
        f"compile={cfg.compile} ({cfg.compile_backend}), {cfg.trainer.max_steps} steps (warm-up "
        f"{cfg.callbacks.throughput.warmup}), validation every {cfg.trainer.val_check_interval}; {name}; "
        f"torch {torch.__version__}; {len(bare)} round(s), medians",
        "",
        "| run | tokens/s | ratio | MFU | dynamo recompiles after warm-up |",
        "|---|---|---|---|---|",
    ]
    bare_rate = statistics.median(m.tokens_per_sec for m in bare)
    for label, runs in (("bare loop (nanoGPT's)", bare), ("recipe (Lightning, paddle_dp)", recipe)):
        rate = statistics.median(m.tokens_per_sec for m in runs)
        mfus = [m.mfu for m in runs if m.mfu is not None]
        mfu = f"{statistics.median(mfus):.3f}" if mfus else "n/a"
        lines.append(f"| {label} | {rate:,.0f} | {rate / bare_rate:.3f} | {mfu} | {max(m.recompiles for m in runs)} |")
    if len(bare) > 1:
        ratios = ", ".join(f"{r.tokens_per_sec / b.tokens_per_sec:.3f}" for b, r in zip(bare, recipe))
        lines.append(f"\nper-round ratios: {ratios}")
    return "\n".join(lines)


def run(cfg: DictConfig) -> str:
    """Write the shards, run both loops ``cfg.rounds`` times, and report."""
    check_config(cfg)
    with tempfile.TemporaryDirectory() as folder:
        train_path, val_path = write_random_shards(cfg, Path(folder))
        with open_dict(cfg):
            cfg.data.train_shards, cfg.data.val_shards = train_path, val_path
            for name in CHECKPOINT_CALLBACKS:
                cfg.callbacks.pop(name, None)
        if cfg.trainer.accelerator in ("gpu", "cuda"):
            torch.set_float32_matmul_precision("high")  # TF32 for what autocast leaves in fp32, in both runs
        bare, recipe = [], []
        for _ in range(cfg.rounds):
            bare.append(run_bare(cfg, train_path, val_path))
            recipe.append(run_recipe(cfg))
    return report(cfg, bare, recipe)


register_configs()


@hydra.main(config_path=str(CONFIGS), config_name="gpt_recipe", version_base="1.3")
def main(cfg: DictConfig) -> None:
    print(run(cfg), flush=True)


if __name__ == "__main__":
    main()
