"""Callbacks the recipes share: a start-up summary line, throughput meters, compilation, the GPT's progress bar."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lit_dp.options import TRAINER
from lit_dp.strategies.lightning_private import ddp_comm_hook, ddp_kwargs
from lit_dp.strategies.trainer import PaddleDPStrategy
from lit_dp_recipes.report import metric, say


def describe_strategy(strategy: Strategy, world_size: int) -> str:
    """One line with the strategy, backend, world size, devices and, for lit_dp's strategy, the
    options set away from their defaults (every option in effect: the run folder's ``.hydra/config.yaml``)."""
    devices = [str(d) for d in getattr(strategy, "parallel_devices", None) or [strategy.root_device]]
    if isinstance(strategy, PaddleDPStrategy):
        changed = strategy.options.describe(TRAINER, skip=("backend",), changed_only=True)
        line = f"strategy=paddle_dp backend={strategy.process_group_backend} world_size={world_size} devices={devices}"
        return f"{line} {changed}" if changed else line
    line = f"strategy={type(strategy).__name__} world_size={world_size} devices={devices}"
    if isinstance(strategy, DDPStrategy):
        cap = ddp_kwargs(strategy).get("bucket_cap_mb", 25)
        line += f" backend={strategy.process_group_backend} bucket_cap_mb={cap}MB"
        line += "".join(f" {name}={value}" for name, value in ddp_kwargs(strategy).items() if name != "bucket_cap_mb")
        hook = ddp_comm_hook(strategy)
        if hook is not None:
            line += f" ddp_comm_hook={getattr(hook, '__qualname__', hook)}"
    return line


class RunSummary(pl.Callback):
    """Prints, on rank 0 once the processes are up, the parallel settings in effect (``describe_strategy``)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            say(describe_strategy(trainer.strategy, trainer.world_size))


def draws_a_bar(stream: Any = None) -> bool:
    """Whether a progress bar written to ``stream`` (default standard output, where Lightning's bar
    writes) is seen: only on a terminal that reports its width. A file or a pipe keeps each redraw
    (a digits run piped to a file wrote 136 KB of carriage returns), and on a terminal of width 0
    (a pseudo-terminal nobody sized: ``script`` started without a terminal, some containers and CI
    consoles) tqdm draws nothing at all, so that a run showed no progress from start to end."""
    stream = sys.stdout if stream is None else stream
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor, or a closed one
        return False


class ProgressLines(pl.Callback):
    """Where no bar is seen (``draws_a_bar``), one line per validation instead of a progress bar.

    ``train`` puts this callback in the bar's place: rank 0 prints ``[lit_dp] epoch E, step S:
    name=value ... (R steps/s)`` after each validation (the sanity check's aside): the metrics
    logged so far but the ``comm/*`` statistics (those go to the loggers), and the optimizer steps
    per second since the previous line, validation and checkpoints included: the pace a reader of
    the log sees. One line per epoch for the digits, per ``trainer.val_check_interval`` for the GPT.
    """

    def __init__(self) -> None:
        self._since: float | None = None  # when the previous line was printed (the fit's start)
        self._step = 0  # the optimizer step it reported

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._since, self._step = time.perf_counter(), trainer.global_step

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = " ".join(
            f"{name}={metric(float(value))}" for name, value in sorted(trainer.callback_metrics.items()) if "/" not in name
        )
        now, steps = time.perf_counter(), trainer.global_step - self._step
        pace = ""
        if self._since is not None and steps > 0 and now > self._since:
            rate = steps / (now - self._since)
            pace = f" ({rate:.1f} steps/s)" if rate >= 10 else f" ({rate:.2f} steps/s)"
        self._since, self._step = now, trainer.global_step
        say(f"epoch {trainer.current_epoch}, step {trainer.global_step}: {metrics}".rstrip(": ") + pace)


class StepThroughput(pl.Callback):
    """Logs ``samples_per_sec`` (all ranks together) over the steps so far, after ``warmup`` steps.

    Validation and epoch boundaries are excluded: only training steps are timed.
    """

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self._started: float | None = None
        self._samples = 0
        self._seconds = 0.0
        self._steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._samples, self._seconds, self._steps = 0, 0.0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._steps += 1
        if self._steps > self.warmup and self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._samples += len(batch[0]) * trainer.world_size

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._seconds > 0:
            pl_module.log("samples_per_sec", self._samples / self._seconds, rank_zero_only=True)


# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from the vendor's data sheets; the first
# name contained in torch.cuda.get_device_name() wins, so the PCIe H100 precedes the SXM one.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
}
BF16_PRECISIONS = ("bf16-mixed", "bf16-true", "bf16")


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a known GPU, by the name CUDA reports; None for others."""
    return next((peak for name, peak in PEAK_BF16_FLOPS.items() if name in device_name), None)


class TokenThroughput(pl.Callback):
    """Logs ``tokens_per_sec`` (all ranks together) and, when the peak is known, ``mfu``.

    The meter counts every training step after the first ``warmup`` ones (compilation happens
    in those), whatever happens inside it, a recompilation included. Its clock runs from the
    end of step ``warmup`` and stops for validation, from its start to the next training
    step (so the checkpoint saved after a validation is left out too); it is read after a
    device synchronisation, only at logging intervals (``log_every_n_steps``), around
    validations and at the epoch's end. Tokens per step come from the batch's input shape.
    MFU (model FLOPs utilisation, PaLM's appendix B) is
    ``flops_per_token * tokens_per_sec / (peak * world_size)`` where the LightningModule has
    ``flops_per_token(length)`` (``GPT`` has nanoGPT's estimate) and the peak is
    ``peak_flops`` or, in bf16 precision on a GPU of ``PEAK_BF16_FLOPS``, its data-sheet value.
    Elsewhere (CPU, unknown GPU, fp32) only tokens/s is logged.
    """

    def __init__(self, warmup: int = 10, peak_flops: float | None = None) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"callbacks.throughput.warmup={warmup!r} is invalid: expected an integer >= 1.")
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float)) or peak_flops <= 0):
            raise ValueError(
                f"callbacks.throughput.peak_flops={peak_flops!r} is invalid: expected a positive FLOP/s figure "
                "(e.g. 989e12) or null."
            )
        self.warmup = warmup
        self.peak_flops = peak_flops
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._tokens = 0
        self._length = 0
        self._seconds = 0.0
        self._since: float | None = None  # wall clock the meter last (re)started; None while stopped
        self._counting = False  # past the warm-up

    @property
    def tokens_per_sec(self) -> float | None:
        """All ranks' tokens per second over the measured steps so far (as of the last reading)."""
        return self._tokens / self._seconds if self._seconds > 0 else None

    def _peak(self, trainer: pl.Trainer) -> float | None:
        if self.peak_flops is not None:
            return float(self.peak_flops)
        device = trainer.strategy.root_device
        if device.type != "cuda" or str(trainer.precision) not in BF16_PRECISIONS:
            return None
        return peak_bf16_flops(torch.cuda.get_device_name(device))

    def _now(self, trainer: pl.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)  # the host runs ahead of the GPU
        return time.perf_counter()

    def _stop(self, trainer: pl.Trainer) -> None:
        if self._since is not None:
            self._seconds += self._now(trainer) - self._since
            self._since = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._counting and self._since is None:
            self._since = self._now(trainer)  # the first step after a validation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._steps += 1
        if self._steps == self.warmup:
            self._counting = True
            self._since = self._now(trainer)
            return
        if not self._counting:
            return
        inputs = batch[0]
        self._tokens += inputs.numel() * trainer.world_size
        self._length = inputs.shape[-1]
        if trainer.global_step % trainer.log_every_n_steps == 0:
            self._stop(trainer)
            self._since = time.perf_counter()  # just synchronised: no need to wait again
            self._log(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._since is not None:
            self._stop(trainer)
            self._since = time.perf_counter()
        if self._tokens:
            self._log(trainer, pl_module)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tokens_per_sec = self.tokens_per_sec
        if tokens_per_sec is None:
            return
        # Every rank measures the same steps (all ranks' tokens over its own clock): the logged
        # value is their mean, an all-reduce at logging intervals only.
        pl_module.log("tokens_per_sec", tokens_per_sec, sync_dist=True)
        peak = self._peak(trainer)
        flops_per_token = getattr(pl_module, "flops_per_token", None)
        if peak is not None and flops_per_token is not None:
            mfu = flops_per_token(self._length) * tokens_per_sec / (peak * trainer.world_size)
            pl_module.log("mfu", mfu, sync_dist=True)


def dynamo_graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far, recompilations included."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class DynamoRecompiles(pl.Callback):
    """Counts what ``torch.compile`` compiles after the warm-up; logs ``dynamo_recompiles``.

    Every graph dynamo compiles inside a training step after the first ``warmup`` steps, or
    inside a validation batch other than the run's first, is a recompilation (a guard that
    failed: a new shape, a new grad mode, a changed attribute, or a graph break reached for the
    first time) and costs its step a compilation. The first validation batch compiles the no-grad graph once; that is its
    warm-up. ``dynamo_recompiles`` (the most of any rank: one rank's recompilation stalls all)
    is logged at every epoch's end, and rank 0 prints its count when training ends. Without
    ``compile=true`` nothing is compiled, and the callback neither logs nor prints.
    """

    def __init__(self, warmup: int = 10) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"callbacks.recompiles.warmup={warmup!r} is invalid: expected an integer >= 0.")
        self.warmup = warmup
        self.recompiles = 0
        self._steps = 0
        self._validated = False
        self._before = 0
        self._at_fit_start = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.recompiles, self._steps, self._validated = 0, 0, False
        self._at_fit_start = dynamo_graphs_compiled()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = dynamo_graphs_compiled()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._steps += 1
        if self._steps > self.warmup:
            self.recompiles += dynamo_graphs_compiled() - self._before

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._before = dynamo_graphs_compiled()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._validated:
            self.recompiles += dynamo_graphs_compiled() - self._before
        self._validated = True

    @property
    def compiled(self) -> int:
        """Graphs dynamo compiled in this process since the fit started."""
        return dynamo_graphs_compiled() - self._at_fit_start

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.compiled:
            pl_module.log("dynamo_recompiles", float(self.recompiles), sync_dist=True, reduce_fx="max")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.compiled and trainer.is_global_zero:
            say(
                f"dynamo: {self.compiled} graphs compiled, {self.recompiles} after the warm-up "
                f"({self.warmup} training steps, the first validation batch)"
            )


class CompileModel(pl.Callback):
    """Compiles the LightningModule's ``forward`` with ``torch.compile`` in every rank (``compile=true``).

    Only ``forward``, as an instance attribute, never ``training_step``: under a data-parallel
    strategy Lightning runs ``training_step`` and ``validation_step`` through the wrapper by
    swapping them in for ``forward`` for the call (``_ForwardRedirection``), so compiling the
    module's ``__call__`` (``nn.Module.compile``) would compile the step, ``self.log``
    included, and recompile whenever the grad mode or what is logged changes. The model stays
    a LightningModule: Lightning refuses the ``OptimizedModule`` of ``torch.compile(model)``
    with any strategy but its own DDP, FSDP and single-device ones. It runs in ``setup``, after
    the ranks are launched and before the strategy wraps the model, because a compiled function
    does not survive pickling to spawned ranks. The strategy then wraps a module whose forward
    is compiled: torch DDP's graph splitting at bucket boundaries applies (``lit_dp.gradients.compile``).
    """

    def __init__(self, backend: str = "inductor") -> None:
        backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in backends:
            raise ValueError(f"compile_backend={backend!r} is invalid: expected a torch.compile backend, one of {backends}.")
        self.backend = backend

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.forward = torch.compile(pl_module.forward, backend=self.backend)


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar, counting optimizer steps out of ``trainer.max_steps`` across epochs, with the loss and tokens/s.

    A GPT run is measured in steps, not epochs (an epoch of FineWeb is 70,000 steps, of the
    stdlib bytes 200). The loss (``train_loss``) and ``tokens_per_sec`` are read from the
    logged metrics only when the bar refreshes, every ``refresh_rate`` steps: the loss is a
    tensor on the device, and reading it waits for the step to finish (the recipe logs it
    without ``prog_bar=True`` so that Lightning does not read it after every batch). Without
    ``max_steps`` the bar counts the epoch's batches, as Lightning's does.
    """

    LOSS = "train_loss"
    THROUGHPUT = "tokens_per_sec"

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if trainer.max_steps > 0:
            bar = self.train_progress_bar
            bar.total = trainer.max_steps
            bar.initial = 0
            bar.n = trainer.global_step
            bar.set_description(f"epoch {trainer.current_epoch}, step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar, step = self.train_progress_bar, trainer.global_step
        if bar is not None and not bar.disable and self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        logged = trainer.callback_metrics
        if self.LOSS in logged:
            metrics["loss"] = f"{float(logged[self.LOSS]):.3f}"
        if self.THROUGHPUT in logged and math.isfinite(float(logged[self.THROUGHPUT])):
            metrics["tokens/s"] = f"{float(logged[self.THROUGHPUT]):,.0f}"
        return metrics
