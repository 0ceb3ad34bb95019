"""The GPT recipe against the bare loop it wraps, and against itself with one thing changed (an A/B).

    python -m benchmarks.gpt_recipe                                  # CPU, one process: the recipe's small GPT
    python -m benchmarks.gpt_recipe experiment=gpt2_small trainer.max_steps=300 trainer.val_check_interval=150
    python -m benchmarks.gpt_recipe rounds=5                         # alternate 5 times, report medians
    python -m benchmarks.gpt_recipe experiment=gpt_host_time variants=[ddp,recipe,bare]  # lit_dp's host time
    python -m benchmarks.gpt_recipe experiment=gpt_host_time trainer.devices=2 variants=[ddp,recipe]

The config (``benchmarks/conf/gpt_recipe.yaml``) is the recipe's own, ``conf/gpt.yaml``: every
key of ``recipes/gpt.py`` applies, with ``experiment=gpt_bench_cpu`` unless another is named.
Every variant is built from it, in one process, on one device, on the same random-token shard
(llm.c format, in a temporary folder), so model, batch, precision, compilation, optimizer,
schedule and clipping are the same unless the variant changes one (``VARIANTS``):

- **bare**: the loop nanoGPT's ``train.py`` writes, without its globals (``BareLoop``):
  ``torch.compile`` of the model, fused AdamW with the same groups, the learning rate set each
  step, autocast, clipping, random windows read from the memory-mapped shard, pinned and copied
  without blocking, the next batch fetched while the step runs; an evaluation before training and
  every ``trainer.val_check_interval`` steps, as the recipe validates.
- **recipe**: ``lit_dp_recipes.train.train(cfg)``, the Lightning recipe with ``paddle_dp`` on a
  group of one rank, validation inside the run; **no_clip** without clipping; **unwatched** with
  nothing of lit_dp's watching (no statistics, so no step clock and no monitor callbacks);
  **multi_rank** on the path of many ranks forced at one rank (every bucket's collective, the
  per-parameter hooks' launches, graph breaks at bucket boundaries: what each of 8 ranks pays,
  measured on one device, ``lit_dp.gradients.group.as_if_many_ranks``); **multi_rank_no_breaks**
  the same without the graph breaks (dynamo's ``optimize_ddp`` off); **ddp**, the recipe under
  ``strategy=ddp``, Lightning's ``DDPStrategy`` (torch DDP): against **recipe**, lit_dp's own
  share beyond what Lightning costs anyway.

Each variant's meter counts every training step after the first ``callbacks.throughput.warmup``
(recompilation included) and stops for validations, reading the clock after a device
synchronisation; the recipe's is its own ``TokenThroughput`` callback. Besides tokens/s, ms per
step and MFU, the host's CPU time per step (``time.process_time``: the work of the host, which a
loaded machine does not inflate as it does the wall clock) and, on CUDA, over ``profile_steps``
steps after the warm-up, the GPU's busy time (kernels and copies, overlaps counted once), its idle
time and its activities (kernels, copies) per step, from torch's profiler (``StepProfile``).
Each step's wall time is kept too (``StepTimes``), and the fastest tenth of the steps is
reported with its ratio to the first variant's: on a shared machine whole seconds run slower,
and the mean over a run swings with them where that figure repeats. At several CPU devices each
rank is pinned to a core of its own (``pin_to_one_core``), every variant alike.
The checkpoint callbacks are left out (the bare loop saves nothing) and so is the progress bar;
everything else runs as ``recipes/gpt.py`` runs it. With ``rounds=N`` the variants alternate N
times and medians are reported.

At more than one device (``trainer.devices=2``) Lightning starts the other ranks by running the
command again, so each variant of each round runs as a command of its own (``variants=[name]
rounds=1``), and ``bare`` is refused: it runs on one device.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import numpy as np
import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from benchmarks.common import CONFIGS
from lit_dp.gradients.group import as_if_many_ranks
from lit_dp_recipes.callbacks import BF16_PRECISIONS, dynamo_graphs_compiled, peak_bf16_flops
from lit_dp_recipes.config import register_configs
from lit_dp_recipes.gpt import adamw, lr_at
from lit_dp_recipes.shards import inspect_shard, write_llmc_shard
from lit_dp_recipes.shards import tokens as shard_tokens
from lit_dp_recipes.train import train

PRECISIONS = ("32-true", "32", "bf16-mixed")
CHECKPOINT_CALLBACKS = ("model_checkpoint", "step_checkpoint")
RESULT = "[gpt_recipe] result "  # a variant's figures, one JSON line, as a command of its own prints them
ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.gpt_recipe"  # run with -m, this module is __main__


@dataclass(frozen=True)
class Variant:
    """One run of the A/B: the recipe config's ``overrides`` (Hydra's, composed again), and the
    ``context`` it runs in."""

    description: str
    overrides: tuple[str, ...] = ()
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def _without_graph_breaks() -> contextlib.AbstractContextManager:
    """Many ranks' path, without dynamo's split of compiled graphs at bucket boundaries (``DDPOptimizer``)."""
    stack = contextlib.ExitStack()
    stack.enter_context(as_if_many_ranks())
    stack.enter_context(torch._dynamo.config.patch(optimize_ddp=False))
    return stack


BARE = "bare"
VARIANTS = {
    BARE: Variant("bare loop (nanoGPT's)"),
    "recipe": Variant("recipe (Lightning, paddle_dp)"),
    "no_clip": Variant("recipe without clipping", ("trainer.gradient_clip_val=null",)),
    "unwatched": Variant("recipe with nothing of lit_dp's watching", ("strategy.comm_stats=false",)),
    "multi_rank": Variant("recipe on many ranks' path, at one rank", context=as_if_many_ranks),
    "multi_rank_no_breaks": Variant("recipe on many ranks' path, no graph breaks", context=_without_graph_breaks),
    "ddp": Variant("recipe (Lightning, torch DDP)", ("strategy=ddp",)),
}


@dataclass
class Measured:
    tokens_per_sec: float
    ms_per_step: float
    mfu: float | None = None
    recompiles: int | None = None  # None: nothing compiled
    fast_ms: float | None = None  # the fastest tenth of the steps' wall time (StepTimes; rank 0)
    host_cpu_ms: float | None = None  # the host's CPU time per step (rank 0)
    gpu_busy_ms: float | None = None  # CUDA: per profiled step
    gpu_idle_ms: float | None = None
    gpu_activities: float | None = None  # CUDA: kernels and copies per profiled step


def check_config(cfg: DictConfig) -> None:
    """What the variants must agree on, checked before any starts; a ``ValueError`` naming the key."""
    if cfg.rounds < 1:
        raise ValueError(f"rounds={cfg.rounds} is invalid: expected an integer >= 1.")
    unknown = [name for name in cfg.variants if name not in VARIANTS]
    if unknown or not cfg.variants:
        raise ValueError(f"variants={list(cfg.variants)} is invalid: expected some of {', '.join(VARIANTS)}.")
    if cfg.trainer.devices != 1 and BARE in cfg.variants:
        raise ValueError(
            f"trainer.devices={cfg.trainer.devices!r} with variants containing {BARE} is invalid: the bare loop runs on "
            f"one device; expected trainer.devices=1, or variants without {BARE} (e.g. variants=[recipe,ddp])."
        )
    if cfg.trainer.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={cfg.trainer.precision!r} is invalid here: expected one of {', '.join(PRECISIONS)}.")
    warmup = cfg.callbacks.throughput.warmup
    profiled = cfg.profile_steps if device_of(cfg).type == "cuda" else 0  # the profiler runs on CUDA only
    if not isinstance(cfg.trainer.max_steps, int) or cfg.trainer.max_steps <= warmup + profiled:
        raise ValueError(
            f"trainer.max_steps={cfg.trainer.max_steps} is invalid here: expected more steps than "
            f"callbacks.throughput.warmup={warmup}" + (f" and profile_steps={profiled} together." if profiled else ".")
        )
    for option in ("val_check_interval", "limit_val_batches"):
        value = cfg.trainer[option]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"trainer.{option}={value!r} is invalid here: expected a number of steps or batches.")
    if profiled and cfg.trainer.val_check_interval <= warmup + profiled:
        raise ValueError(
            f"trainer.val_check_interval={cfg.trainer.val_check_interval} is invalid here: the profiled steps, "
            f"{warmup + 1} to {warmup + profiled}, must come before the first validation."
        )


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


class StepTimes:
    """Each training step's wall time, from one step's start to the next's, after the warm-up; a
    step that spans a validation is left out. On a shared machine whole seconds run slower, the
    steps in them too: the fastest tenth of the steps (``fast_ms``, their 10th percentile) is the
    figure that repeats, where the mean over the run swings with the machine."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._since: float | None = None

    def step_started(self) -> None:
        now = time.perf_counter()
        if self._since is not None:
            self.ms.append((now - self._since) * 1e3)
        self._since = now

    def pause(self) -> None:
        self._since = None

    def figures(self) -> dict[str, float]:
        if len(self.ms) < 2:
            return {}
        deciles = statistics.quantiles(self.ms, n=10, method="inclusive")
        return {"fast_ms": deciles[0]}


class _GpuWindow:
    """torch's profiler over some steps: the GPU's busy time (its activities' union), idle time and activities per step."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._profiler: torch.profiler.profile | None = None
        self._started = 0.0

    def start(self) -> None:
        torch.cuda.synchronize(self._device)
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self._profiler.__enter__()
        self._started = time.perf_counter()

    def stop(self, steps: int) -> dict[str, float]:
        assert self._profiler is not None
        torch.cuda.synchronize(self._device)
        wall_ms = (time.perf_counter() - self._started) * 1e3
        self._profiler.__exit__(None, None, None)
        spans = sorted(
            (event.start_ns(), event.start_ns() + event.duration_ns())
            for event in self._profiler.profiler.kineto_results.events()
            if event.device_type() == torch.autograd.DeviceType.CUDA
        )
        self._profiler = None
        busy_ns, run_start, run_end = 0, None, None
        for start, end in spans:
            if run_end is None or start > run_end:
                busy_ns += (run_end - run_start) if run_end is not None else 0
                run_start, run_end = start, end
            else:
                run_end = max(run_end, end)
        busy_ns += (run_end - run_start) if run_end is not None else 0
        busy_ms = busy_ns / 1e6 / steps
        return {"gpu_busy_ms": busy_ms, "gpu_idle_ms": max(0.0, wall_ms / steps - busy_ms), "gpu_activities": len(spans) / steps}


def pin_to_one_core(local_rank: int) -> None:
    """Every thread of this process (Gloo's included) on core ``local_rank``: ranks left to the
    scheduler share cores unevenly from one run to the next, which swung two-rank runs by 1.6x."""
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[local_rank % len(cores)]}
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), core)


class StepProfile(pl.Callback):
    """The recipe's host CPU time per step after the warm-up (validations left out) and, on CUDA,
    the GPU's busy and idle time and its activities per step over ``profile_steps`` steps after
    the warm-up; logged at the epoch's end (``host_cpu_ms``, ``gpu_busy_ms``, ``gpu_idle_ms``,
    ``gpu_activities``). The bare loop takes the same readings at the same steps."""

    def __init__(self, warmup: int, profile_steps: int) -> None:
        self.warmup, self.profile_steps = warmup, profile_steps
        self._steps = 0
        self._times = StepTimes()
        self._cpu = 0.0
        self._cpu_since: float | None = None
        self._gpu: _GpuWindow | None = None
        self._gpu_figures: dict[str, float] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1 and trainer.strategy.root_device.type == "cpu":
            pin_to_one_core(trainer.local_rank)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._steps >= self.warmup:
            self._times.step_started()
            if self._cpu_since is None:
                self._cpu_since = time.process_time()
        if self._steps == self.warmup and trainer.strategy.root_device.type == "cuda" and self.profile_steps:
            self._gpu = _GpuWindow(trainer.strategy.root_device)
            self._gpu.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._steps += 1
        if self._gpu is not None and self._steps == self.warmup + self.profile_steps:
            self._gpu_figures = self._gpu.stop(self.profile_steps)
            self._gpu = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._times.pause()
        if self._cpu_since is not None:
            self._cpu += time.process_time() - self._cpu_since
            self._cpu_since = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_validation_start(trainer, pl_module)
        measured = self._steps - self.warmup
        if measured > 0:
            figures = {"host_cpu_ms": self._cpu * 1e3 / measured, **self._times.figures(), **self._gpu_figures}
            pl_module.log_dict(figures, rank_zero_only=True)


class BareLoop:
    """nanoGPT's loop on the recipe's config (see the module docstring): ``step(index)`` trains one
    step on the batch fetched during the step before; ``evaluate(batches)`` validates."""

    def __init__(self, cfg: DictConfig, train_path: str, val_path: str) -> None:
        self.device = device = device_of(cfg)
        pl.seed_everything(cfg.seed)
        self.model = instantiate(cfg.model, _convert_="all").to(device)
        # Plain values for the loop: reading a DictConfig costs tens of microseconds a key.
        self.hp = hp = OmegaConf.to_container(cfg.model, resolve=True)
        self.block, self.batch = cfg.data.block_size, cfg.data.batch_size
        self.accumulate, self.clip = cfg.trainer.accumulate_grad_batches, cfg.trainer.gradient_clip_val
        self.decay_steps = hp["lr_decay_steps"] if hp["lr_decay_steps"] is not None else cfg.trainer.max_steps
        self.optimizer = adamw(self.model, hp["lr"], hp["weight_decay"], tuple(hp["betas"]), device)
        self.compiled = torch.compile(self.model, backend=cfg.compile_backend) if cfg.compile else self.model
        self.autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if cfg.trainer.precision == "bf16-mixed" else contextlib.nullcontext()
        )
        self.train_data, self.val_data = shard_tokens(inspect_shard(train_path)), shard_tokens(inspect_shard(val_path))
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.compiles = cfg.compile
        self.recompiles = 0
        self._evaluated = False
        self._next = self.get_batch(self.train_data)

    def get_batch(self, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        block, device = self.block, self.device
        starts = torch.randint(len(tokens) - block, (self.batch,), generator=self.generator).tolist()
        x = torch.stack([torch.from_numpy(tokens[i : i + block].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(tokens[i + 1 : i + 1 + block].astype(np.int64)) for i in starts])
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    def evaluate(self, batches: int) -> None:
        self.model.eval()
        with torch.no_grad(), self.autocast:
            for _ in range(batches):
                before = dynamo_graphs_compiled()
                self.compiled(*self.get_batch(self.val_data))
                self.recompiles += (dynamo_graphs_compiled() - before) if self._evaluated else 0
                self._evaluated = True
        self.model.train()

    def step(self, index: int, fetch: bool = True) -> None:
        """Optimizer step ``index``; ``fetch``: the next batch is read while the device runs the forward."""
        hp = self.hp
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(index, hp["lr"], hp["min_lr"], hp["warmup_steps"], self.decay_steps)
        for _ in range(self.accumulate):
            with self.autocast:
                loss = self.compiled(*self._next) / self.accumulate
            if fetch:
                self._next = self.get_batch(self.train_data)
            loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def run_bare(cfg: DictConfig, train_path: str, val_path: str) -> Measured:
    torch._dynamo.reset()  # each run compiles afresh (every variant compiles the same GPT.forward)
    loop = BareLoop(cfg, train_path, val_path)
    device = loop.device
    warmup, val_every, val_batches = cfg.callbacks.throughput.warmup, cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches
    gpu = _GpuWindow(device) if device.type == "cuda" and cfg.profile_steps else None
    gpu_figures: dict[str, float] = {}
    meter = _Meter(device)
    times = StepTimes()
    cpu_seconds, cpu_since = 0.0, None
    loop.evaluate(2)  # Lightning's sanity check: 2 validation batches before training
    for step in range(cfg.trainer.max_steps):
        before = dynamo_graphs_compiled()
        if step >= warmup:
            times.step_started()
            if cpu_since is None:
                cpu_since = time.process_time()
        if gpu is not None and step == warmup:
            gpu.start()
        loop.step(step)
        done = step + 1
        if gpu is not None and done == warmup + cfg.profile_steps:
            gpu_figures = gpu.stop(cfg.profile_steps)
        if done == warmup:
            meter.start()
        elif done > warmup:
            meter.tokens += loop.accumulate * loop.batch * loop.block
            loop.recompiles += dynamo_graphs_compiled() - before
        if done % val_every == 0:
            meter.stop()
            times.pause()
            if cpu_since is not None:
                cpu_seconds, cpu_since = cpu_seconds + time.process_time() - cpu_since, None
            loop.evaluate(val_batches)
            if done >= warmup:
                meter.start()
    meter.stop()
    if cpu_since is not None:
        cpu_seconds += time.process_time() - cpu_since
    tokens_per_sec = meter.tokens / meter.seconds
    peak = peak_flops(cfg, device)
    return Measured(
        tokens_per_sec,
        ms_per_step(cfg, tokens_per_sec),
        loop.model.flops_per_token(loop.block) * tokens_per_sec / peak if peak else None,
        loop.recompiles if loop.compiles else None,
        host_cpu_ms=cpu_seconds * 1e3 / (cfg.trainer.max_steps - warmup),
        **times.figures(),
        **gpu_figures,
    )


def ms_per_step(cfg: DictConfig, tokens_per_sec: float) -> float:
    """One optimizer step's time at ``tokens_per_sec`` (every rank's tokens)."""
    tokens = cfg.data.batch_size * cfg.data.block_size * cfg.trainer.accumulate_grad_batches * cfg.trainer.devices
    return tokens / tokens_per_sec * 1e3


def run_recipe(cfg: DictConfig, variant: Variant) -> Measured:
    """``train(cfg)`` as ``variant`` changes it, in this process (one device), with ``StepProfile`` watching."""
    torch._dynamo.reset()
    with open_dict(cfg):
        cfg.callbacks.step_profile = {
            "_target_": f"{MODULE}.StepProfile",
            "warmup": cfg.callbacks.throughput.warmup,
            "profile_steps": cfg.profile_steps,
        }
    with variant.context():
        metrics = train(cfg)
    recompiles = metrics.get("dynamo_recompiles")  # logged by the recipe only when it compiles
    logged = ("host_cpu_ms", "fast_ms", "gpu_busy_ms", "gpu_idle_ms", "gpu_activities")
    figures = {name: metrics.get(name) for name in logged}
    tokens_per_sec = metrics["tokens_per_sec"]
    return Measured(
        tokens_per_sec, ms_per_step(cfg, tokens_per_sec), metrics.get("mfu"), None if recompiles is None else int(recompiles), **figures
    )


def run_as_command(name: str, round_folder: Path) -> Measured:
    """Variant ``name`` as a command of its own (``variants=[name] rounds=1``): several ranks start
    by running their command again, which must then be this variant's alone."""
    given = [o for o in HydraConfig.get().overrides.task if not o.startswith(("variants=", "rounds=", "hydra.run.dir="))]
    command = [sys.executable, "-m", MODULE, *given, f"variants=[{name}]", "rounds=1", f"hydra.run.dir={round_folder}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    results = [line[len(RESULT) :] for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not results:
        raise RuntimeError(f"variant {name} failed ({done.returncode}): {' '.join(command)}\n{(done.stdout + done.stderr)[-3000:]}")
    return Measured(**json.loads(results[-1]))


def _variant_config(cfg: DictConfig, variant: Variant, train_path: str, val_path: str) -> DictConfig:
    """The benchmark's config as composed for this run, with the variant's overrides, on the shards."""
    if variant.overrides:
        changed = {override.split("=", 1)[0] for override in variant.overrides}
        given = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") not in changed]
        cfg = compose("gpt_recipe", overrides=[*given, *variant.overrides])
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.data.train_shards, cfg.data.val_shards = train_path, val_path
        for name in CHECKPOINT_CALLBACKS:
            cfg.callbacks.pop(name, None)
    return cfg


def report(cfg: DictConfig, results: dict[str, list[Measured]]) -> str:
    device = device_of(cfg)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    params = instantiate(cfg.model, _convert_="all").parameters()
    sizes = [p.numel() for p in params]
    rounds = len(next(iter(results.values())))
    lines = [
        f"GPT {cfg.model.n_layer} x {cfg.model.n_embd}, {sum(sizes) / 1e6:.1f} M parameters in {len(sizes)} tensors, "
        f"vocab {cfg.data.vocab_size}, batch {cfg.data.batch_size} x {cfg.data.block_size}, {cfg.trainer.precision}, "
        f"compile={cfg.compile} ({cfg.compile_backend}), {cfg.trainer.devices} device(s), {cfg.trainer.max_steps} steps "
        f"(warm-up {cfg.callbacks.throughput.warmup}), validation every {cfg.trainer.val_check_interval}; {name}; "
        f"torch {torch.__version__}; {rounds} round(s), medians",
        "",
        "| variant | what | ms/step | tokens/s | / first | fastest tenth ms/step | its time / first's | MFU "
        "| host CPU ms/step | GPU busy ms/step | GPU idle ms/step | GPU kernels/step | recompiles after warm-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first_rate = statistics.median(m.tokens_per_sec for m in next(iter(results.values())))

    def median_of(runs: list[Measured], field: str) -> float | None:
        values = [getattr(m, field) for m in runs if getattr(m, field) is not None]
        return statistics.median(values) if values else None

    def median(runs: list[Measured], field: str, spec: str) -> str:
        value = median_of(runs, field)
        return "n/a" if value is None else format(value, spec)

    first_fast = median_of(next(iter(results.values())), "fast_ms")

    def fast_ratio(runs: list[Measured]) -> str:
        fast = median_of(runs, "fast_ms")
        return "n/a" if fast is None or not first_fast else f"{fast / first_fast:.3f}"

    for variant, runs in results.items():
        rate = statistics.median(m.tokens_per_sec for m in runs)
        recompiles = [m.recompiles for m in runs if m.recompiles is not None]
        lines.append(
            f"| {variant} | {VARIANTS[variant].description} | {median(runs, 'ms_per_step', '.2f')} | {rate:,.0f} | "
            f"{rate / first_rate:.3f} | {median(runs, 'fast_ms', '.2f')} | {fast_ratio(runs)} | "
            f"{median(runs, 'mfu', '.3f')} | {median(runs, 'host_cpu_ms', '.2f')} | "
            f"{median(runs, 'gpu_busy_ms', '.2f')} | {median(runs, 'gpu_idle_ms', '.2f')} | "
            f"{median(runs, 'gpu_activities', '.0f')} | {max(recompiles) if recompiles else 'n/a'} |"
        )
    if rounds > 1:
        first, *others = results
        for variant in others:
            ratios = ", ".join(f"{r.tokens_per_sec / f.tokens_per_sec:.3f}" for f, r in zip(results[first], results[variant]))
            lines.append(f"\n{variant} / {first} per round: {ratios}")
            fast = [f"{r.fast_ms / f.fast_ms:.3f}" for f, r in zip(results[first], results[variant]) if r.fast_ms and f.fast_ms]
            if fast:
                lines.append(f"{variant}'s fastest-tenth step time / {first}'s per round: {', '.join(fast)}")
    return "\n".join(lines)


def run(cfg: DictConfig) -> dict[str, list[Measured]]:
    """Write the shards, run the variants ``cfg.rounds`` times, alternating; their figures by variant."""
    check_config(cfg)
    results: dict[str, list[Measured]] = {name: [] for name in cfg.variants}
    in_process = cfg.trainer.devices == 1 or (len(cfg.variants) == 1 and cfg.rounds == 1)
    with tempfile.TemporaryDirectory() as folder:
        train_path, val_path = write_random_shards(cfg, Path(folder))
        if cfg.trainer.accelerator in ("gpu", "cuda"):
            torch.set_float32_matmul_precision("high")  # TF32 for what autocast leaves in fp32, in every variant
        for round_index in range(cfg.rounds):
            for name in cfg.variants:
                variant = VARIANTS[name]
                if not in_process:
                    results[name].append(run_as_command(name, Path(folder) / f"{name}_{round_index}"))
                elif name == BARE:
                    results[name].append(run_bare(_variant_config(cfg, variant, train_path, val_path), train_path, val_path))
                else:
                    results[name].append(run_recipe(_variant_config(cfg, variant, train_path, val_path), variant))
    return results


register_configs()


@hydra.main(config_path=str(CONFIGS), config_name="gpt_recipe", version_base="1.3")
def main(cfg: DictConfig) -> None:
    results = run(cfg)
    if rank_zero_only.rank == 0:  # at several devices, every rank runs this
        if len(cfg.variants) == 1 and cfg.rounds == 1:
            print(RESULT + json.dumps(dataclasses.asdict(results[cfg.variants[0]][0])), flush=True)
        print(report(cfg, results), flush=True)


if __name__ == "__main__":
    main()
