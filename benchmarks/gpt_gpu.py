"""GPT step times on one GPU: the bare model, torch DDP and lit_dp, eager and compiled.

    python -m benchmarks.gpt_gpu                                  # GPT-2 small on cuda:0
    python -m benchmarks.gpt_gpu rounds=6 compile_shapes=[]
    python -m benchmarks.gpt_gpu device=cpu n_layer=2 ...           # a smoke test of this code

Two parts, each a Markdown table (medians, the lit_dp / DDP ratio):

1. One process, a process group of one rank (NCCL on CUDA, Gloo on CPU): a GPT-2-small-shaped
   model under bf16 autocast, per batch shape; eager and under ``torch.compile``. A group of one
   rank still runs every reducer: buckets are filled, all-reduced and copied back, so the table
   shows what the reducer costs where no communication hides it. Host-device synchronisations
   per step are counted with ``torch.cuda.set_sync_debug_mode("warn")``.
2. Two Gloo ranks sharing the device, a smaller GPT (one GPU cannot hold two NCCL ranks; Gloo
   stages CUDA tensors through the host, so the streams and events of the multi-rank path run,
   not NCCL's overlap).

The modes run interleaved in rounds whose order rotates, so drift hits them alike; on CUDA each
block of steps is timed with CUDA events after a warm-up (docs/benchmarks.md says how the
figures there were taken).
"""

from __future__ import annotations

import copy
import gc
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common import MODES, benchmark_main, init_gloo_rank, rotated, run_ranks, wrap
from lit_dp_recipes.gpt import GPT

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda")

# What torch.cuda.set_sync_debug_mode("warn") says for each synchronising call.
SYNC_REPORT = "called a synchronizing CUDA operation"


@dataclass
class GPTBenchmarkConfig:
    """What to measure (``benchmarks/conf/gpt_gpu.yaml``)."""

    device: str = "cuda"  # cuda (cuda:0) or cpu, a smoke test of this code
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 64, as nanoGPT does
    shapes: list[list[int]] = field(default_factory=lambda: [[16, 1024], [8, 512]])  # [batch, length], eager rows
    compile_shapes: list[list[int]] = field(default_factory=lambda: [[8, 512]])  # compiled rows
    compile_backend: str = "inductor"
    warmup: int = 5  # untimed steps per mode (the first ones rebuild buckets or compile)
    steps: int = 5  # timed steps per mode and round
    rounds: int = 12
    compile_rounds: int = 6
    sync_steps: int = 3  # steps per mode counted under set_sync_debug_mode("warn"); 0 skips
    comm_buffer_size: float = 25
    last_comm_buffer_size: float = 1
    shared_ranks: int = 2  # part 2: ranks sharing the device on Gloo; 0 skips it
    shared_n_layer: int = 6
    shared_n_head: int = 6
    shared_n_embd: int = 384  # with vocab 50304: ~30M parameters
    shared_shape: list[int] = field(default_factory=lambda: [8, 256])
    shared_rounds: int = 6

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is invalid: expected one of {', '.join(DEVICES)}.")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "steps", "rounds"):
            _require_positive(name, getattr(self, name))
        for name in ("warmup", "compile_rounds", "sync_steps", "shared_ranks", "shared_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} is invalid: expected a non-negative integer.")
        for width, heads, prefix in ((self.n_embd, self.n_head, ""), (self.shared_n_embd, self.shared_n_head, "shared_")):
            if width % heads:
                raise ValueError(f"{prefix}n_embd={width} is invalid: expected a multiple of {prefix}n_head={heads}.")
        self.shapes = [_shape("shapes", shape, self.block_size) for shape in self.shapes]
        self.compile_shapes = [_shape("compile_shapes", shape, self.block_size) for shape in self.compile_shapes]
        self.shared_shape = _shape("shared_shape", self.shared_shape, self.block_size)
        if self.shared_ranks == 1:
            raise ValueError("shared_ranks=1 is invalid: expected 0 (skip part 2) or at least 2 ranks.")
        if not self.compile_backend:
            raise ValueError("compile_backend='' is invalid: expected a torch.compile backend such as inductor.")


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: expected a positive integer.")


def _shape(name: str, shape: object, block_size: int) -> list[int]:
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
        or shape[1] > block_size
    ):
        raise ValueError(
            f"{name} has {shape!r}: expected [batch, length] with positive integers and length <= "
            f"block_size={block_size}."
        )
    return list(shape)


@dataclass
class Row:
    """One table row: per-mode median milliseconds per step, per-round ratios, synchronisations."""

    label: str
    shape: list[int]
    ms: dict[str, float]
    round_ratios: list[float]
    syncs: dict[str, float] | None  # per step; None where not countable (CPU)

    @property
    def ratio(self) -> float:
        return self.ms["lit_dp"] / self.ms["ddp"]


@dataclass
class GPTResults:
    device_name: str
    backend: str
    params: int
    rows: list[Row]
    shared: Row | None = None
    shared_params: int = 0


def build_gpt(config: GPTBenchmarkConfig, shared: bool = False) -> GPT:
    """The GPT of part 1 (GPT-2 small by default), or the smaller one of part 2."""
    prefix = "shared_" if shared else ""
    return GPT(
        block_size=config.block_size,
        n_layer=getattr(config, f"{prefix}n_layer"),
        n_head=getattr(config, f"{prefix}n_head"),
        n_embd=getattr(config, f"{prefix}n_embd"),
        vocab_size=config.vocab_size,
    )


def _wrap(mode: str, model: nn.Module, config: GPTBenchmarkConfig, group: dist.ProcessGroup) -> nn.Module:
    if mode != "lit_dp":
        return wrap(mode, model, config.comm_buffer_size, group)
    return wrap(mode, model, config.comm_buffer_size, group, last_comm_buffer_size=config.last_comm_buffer_size)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()


def _block_ms(device: torch.device, run: Callable[[], None], steps: int) -> float:
    """Milliseconds per step over ``steps`` calls of ``run``: CUDA events on a GPU, the host clock on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    began = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - began) * 1e3 / steps


def count_syncs(run: Callable[[], None], steps: int) -> float:
    """Host-device synchronisations per call of ``run``, as CUDA's sync debug mode reports them.

    The autograd engine replays warnings raised on its device threads (where gradient hooks
    run) in the thread that called backward, so the reducer's synchronisations are counted too.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the debug mode's reports; not its one-time notice that it is a prototype.
    return sum(SYNC_REPORT in str(w.message) for w in caught) / steps


def _interleaved(
    models: dict[str, nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: GPTBenchmarkConfig,
    rounds: int,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[dict[str, float], list[float], dict[str, float] | None]:
    """Warm up, count synchronisations, then time the modes in rotating order; medians over rounds."""
    device = inputs.device
    optimizers = {mode: torch.optim.SGD(m.parameters(), lr=1e-4) for mode, m in models.items()}
    runs = {mode: (lambda m=m, o=optimizers[mode]: _step(m, o, inputs, targets)) for mode, m in models.items()}
    for mode in MODES:
        for _ in range(config.warmup):
            runs[mode]()
    syncs = None
    if device.type == "cuda" and config.sync_steps:
        syncs = {mode: count_syncs(runs[mode], config.sync_steps) for mode in MODES}
    per_round: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(rounds):
        for mode in rotated(MODES, round_index):
            barrier()  # ranks start a block together, so no rank's time is another's lag
            per_round[mode].append(_block_ms(device, runs[mode], config.steps))
    medians = {mode: statistics.median(times) for mode, times in per_round.items()}
    log.info("shape %s: median ms per step %s", list(inputs.shape), {m: round(t, 2) for m, t in medians.items()})
    ratios = [ours / ddp for ours, ddp in zip(per_round["lit_dp"], per_round["ddp"])]
    return medians, ratios, syncs


def _tokens(shape: list[int], vocab_size: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, length = shape
    data = torch.randint(vocab_size, (batch, length + 1), generator=generator).to(device)
    return data[:, :-1], data[:, 1:]


def _free_device_memory() -> None:
    """Return the memory of models just dropped, so the next row starts from the same state."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _one_rank_rows(config: GPTBenchmarkConfig, device: torch.device, group: dist.ProcessGroup) -> list[Row]:
    rows = []
    torch.manual_seed(0)
    base = build_gpt(config).to(device)
    for shape in config.shapes:
        models = {mode: _wrap(mode, copy.deepcopy(base), config, group) for mode in MODES}
        medians, ratios, syncs = _interleaved(models, *_tokens(shape, config.vocab_size, device, 0), config, config.rounds)
        rows.append(Row("eager", shape, medians, ratios, syncs))
        del models
        _free_device_memory()
    for shape in config.compile_shapes:
        # Fresh models per shape: a new shape would otherwise recompile (or go dynamic) mid-run.
        torch._dynamo.reset()
        models = {
            mode: _wrap(mode, torch.compile(copy.deepcopy(base), backend=config.compile_backend), config, group)
            for mode in MODES
        }
        medians, ratios, syncs = _interleaved(
            models, *_tokens(shape, config.vocab_size, device, 0), config, config.compile_rounds
        )
        rows.append(Row(f"torch.compile ({config.compile_backend})", shape, medians, ratios, syncs))
        del models
        _free_device_memory()
    return rows


def _shared_worker(rank: int, config: GPTBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    init_gloo_rank(rank, config.shared_ranks, port)
    device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    base = build_gpt(config, shared=True).to(device)
    group = dist.group.WORLD
    models = {mode: _wrap(mode, copy.deepcopy(base), config, group) for mode in MODES}
    inputs, targets = _tokens(config.shared_shape, config.vocab_size, device, seed=rank)
    medians, ratios, syncs = _interleaved(
        models, inputs, targets, config, config.shared_rounds, barrier=lambda: dist.barrier(group)
    )
    if rank == 0:
        label = f"{config.shared_ranks} Gloo ranks on one device"
        results["row"] = Row(label, config.shared_shape, medians, ratios, syncs)
        results["params"] = sum(p.numel() for p in base.parameters())
    lit_dp.destroy_parallel_env()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def run(config: GPTBenchmarkConfig) -> GPTResults:
    """Part 1 in this process (a one-rank group), then part 2 in ``config.shared_ranks`` spawned processes."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid here: torch.cuda.is_available() is False.")
    if dist.is_initialized():
        raise RuntimeError("the GPT benchmark creates its own process groups: destroy the existing one first.")
    device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A one-rank group needs no rendezvous: an in-process store is enough. (init_parallel_env
    # creates no group at world size 1, as Paddle does, so the group is made here.)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = _one_rank_rows(config, device, dist.group.WORLD)
        params = sum(p.numel() for p in build_gpt(config).parameters())
    finally:
        dist.destroy_process_group()
        _free_device_memory()  # the ranks of part 2 share the device
    results = GPTResults(_device_name(device), backend, params, rows)
    if config.shared_ranks:
        shared = run_ranks(_shared_worker, config.shared_ranks, config)
        results.shared, results.shared_params = shared["row"], shared["params"]
    return results


def _syncs_cell(syncs: dict[str, float] | None) -> str:
    if syncs is None:
        return "n/a"
    return " / ".join(f"{syncs[mode]:g}" for mode in MODES)


def _row_line(row: Row, label: str) -> str:
    batch, length = row.shape
    return (
        f"| {label} | {batch} x {length} | {row.ms['none']:.2f} | {row.ms['ddp']:.2f} | {row.ms['lit_dp']:.2f} "
        f"| {row.ratio:.3f} | {min(row.round_ratios):.3f}-{max(row.round_ratios):.3f} | {_syncs_cell(row.syncs)} |"
    )


def _count(params: int) -> str:
    return f"{params / 1e6:.1f}M parameters" if params >= 1e6 else f"{params} parameters"


def report(results: GPTResults, config: GPTBenchmarkConfig) -> str:
    header = [
        "| step | batch x length | bare (ms) | torch DDP (ms) | lit_dp (ms) | lit_dp / DDP | per-round lit_dp / DDP "
        "| host syncs per step (bare / DDP / lit_dp) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines = [
        f"GPT benchmark on {results.device_name}, torch {torch.__version__}, bf16 autocast, SGD; "
        f"medians of interleaved rounds of {config.steps} steps.",
        "",
        f"Part 1: one process, {results.backend.upper()} group of one rank, GPT {_count(results.params)} "
        f"({config.n_layer} layers, width {config.n_embd}, vocab {config.vocab_size}).",
        "",
        *header,
        *(_row_line(row, row.label) for row in results.rows),
    ]
    if results.shared is not None:
        lines += [
            "",
            f"Part 2: {config.shared_ranks} Gloo ranks sharing {results.device_name}, GPT "
            f"{_count(results.shared_params)} ({config.shared_n_layer} layers, width {config.shared_n_embd}), "
            "batch per rank.",
            "",
            *header,
            _row_line(results.shared, "eager"),
        ]
    return "\n".join(lines)


main = benchmark_main("gpt_gpu", GPTBenchmarkConfig, lambda config: report(run(config), config))


if __name__ == "__main__":
    main()
