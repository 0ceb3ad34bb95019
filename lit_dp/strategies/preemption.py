"""Preemption: SIGTERM or SIGUSR1 stops every rank at the same step, with a checkpoint, exit status non-zero.

Schedulers warn a job before they stop it: Kubernetes and torchrun's agent send SIGTERM, SLURM
``--signal=SIGUSR1@90`` sends SIGUSR1 (or the signal ``SLURMEnvironment(requeue_signal=...)``
names). What ``PaddleDPStrategy`` does during ``trainer.fit``:

1. A signal is only recorded by the rank that receives it (and forwarded to the ranks this
   process started, as Lightning does): nothing runs inside the handler. Lightning's own
   handler broadcasts a flag from inside the handler, at whatever point the rank was, and the
   other ranks, who did not get the signal, never join that broadcast: a signal to one worker
   stalled the job until the hang watchdog or the group's timeout.
2. At each optimizer-step boundary (``on_train_batch_end`` after a step) each rank starts an
   all-reduce of ``world_size`` integers on the host, its slot holding the signal it got (0:
   none), and reads the one it started at the boundary before, which has long completed: no
   rank waits for it. Every rank reads the same vector at the same boundary, so all stop there,
   one step after the exchange began (on one rank, at once); no timing assumption is involved.
   Its cost is one small collective per optimizer step that overlaps the next step (Gloo: the
   default group when it is Gloo, a Gloo group of its own under NCCL). Lightning's own per-batch
   broadcast of its SIGTERM flag, blocking (and on CUDA a host synchronisation), is skipped
   during the fit: its flag is never set here.
3. At the agreed boundary every rank takes part in saving a checkpoint: Lightning's SLURM
   requeue (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, then ``scontrol requeue``, Lightning's
   own handler called at the boundary instead of inside the signal) when the signal is SLURM's
   requeue signal with auto-requeue on; otherwise ``last.ckpt`` in the first ``ModelCheckpoint``'s
   folder (``default_root_dir`` without one). Rank 0 says which rank got which signal, the step
   and the file; then every rank raises ``Preempted``, a ``SystemExit`` with status 128 + the
   signal number (143 for SIGTERM), as a process killed by that signal reports it: a scheduler
   sees a failure, and torchrun restarts the job if it may.

Under ``start_method="spawn"`` or ``"fork"`` the launching process runs no rank: while the ranks
run, ``ForwardingMultiProcessingLauncher`` (Lightning's launcher for those) passes SIGTERM and
SIGUSR1 on to them, and exits with their status 128 + signal once they have stopped, where
Lightning's would die at once and leave the ranks to their parent-death signal, unsaved.

Under ``start_method="popen"`` (the default) the launching process is rank 0, and
``BoundScriptLauncher`` (Lightning's script launcher) makes sure no rank outlives it: each rank
it starts is bound to it (``lit_dp.job.orphans``: the kernel kills the rank when rank 0 exits,
however it exits), and outside the fit's run stage (start-up, the rendezvous, teardown), where
there is no step to stop at and the default would end rank 0 silently, SIGTERM or SIGUSR1 makes
rank 0 say so in one line, end the ranks it started and exit with 128 + the signal
(``StoppedOutsideTraining``); a second signal while it does ends it at once. Ctrl-C (SIGINT) is
Lightning's: a ``KeyboardInterrupt``, on which it kills the ranks it started.

A signal received after the last optimizer step of the fit changes nothing: the fit has
completed and saved what its callbacks save. Lightning's connector is replaced where the
Trainer keeps it (the one place Lightning reads it; ``lit_dp.strategies.lightning_private``), by a
subclass of its own, so its bookkeeping is reused: handlers in place from the start of the fit's
run stage to its teardown, the previous handlers restored afterwards, its SLURM detection and
requeue.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lit_dp import join
from lit_dp.job import in_flight
from lit_dp.job.orphans import binding_started_ranks
from lit_dp.strategies.feature import Feature, Run
from lit_dp.strategies.lightning_private import (
    SignalConnector,
    TrainerMultiProcessingLauncher,
    TrainerScriptLauncher,
    cluster_environment,
    replace_saved_signal_handlers,
    replace_signal_connector,
    restore_sigterm_broadcast,
    signal_connector,
    skip_sigterm_broadcast,
    slurm_requeue,
    start_script_ranks,
)

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """The run stopped for a signal, every rank after the same optimizer step: a Trainer's fit saved
    ``checkpoint`` there; a Fabric loop (``checkpoint`` None) saves in ``except Preempted``. ``code`` is
    128 + the signal number."""

    def __init__(self, signum: int, ranks: list[int], step: int, checkpoint: str | None, requeued: str | None) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.ranks = ranks
        self.step = step
        self.checkpoint = checkpoint
        self.requeued = requeued

    @property
    def reason(self) -> str:
        """One line: which signal, on which ranks, where every rank stopped and what was saved."""
        name = signal.Signals(self.signum).name
        ranks = ("ranks " if len(self.ranks) > 1 else "rank ") + ", ".join(map(str, self.ranks))
        requeued = f"; {self.requeued}" if self.requeued else ""
        stopped = f"every rank stopped after step {self.step}"
        saved = f", checkpoint {self.checkpoint}" if self.checkpoint is not None else ""
        return f"{name} received by {ranks}: {stopped}{saved}{requeued}"

    def __str__(self) -> str:
        return self.reason


class StoppedOutsideTraining(Preempted):
    """A stop signal to the launching process outside the fit's run stage: the ranks it started are
    ended and nothing is saved (no step to stop at); ``code`` is 128 + the signal number."""

    def __init__(self, signum: int, rank: int, started: int) -> None:
        super().__init__(signum, [rank], 0, None, None)
        self.started = started

    @property
    def reason(self) -> str:
        name = signal.Signals(self.signum).name
        ended = f"the {self.started} rank{'s' * (self.started != 1)} it started ended" if self.started else "no rank started yet"
        return (
            f"{name} received by rank {self.ranks[0]}, the launching process, outside the training loop (start-up, "
            f"rendezvous or teardown): nothing saved, {ended}"
        )


class _Agreement:
    """Which rank got which stop signal, agreed at optimizer-step boundaries without waiting (see the
    module docstring, step 2): ``at_boundary`` returns the same list on every rank, one boundary after
    the exchange that carried a signal began (at once on one rank)."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.received: int | None = None  # the first stop signal this rank got
        self.world_size, self.rank = world_size, rank
        self._exchange: tuple[Any, torch.Tensor] | None = None  # started at the last boundary: (work, signals)
        self._group: Any = None  # where the ranks agree; None: the default group
        # The agreement is a host-side exchange: under NCCL on a Gloo group of its own.
        if world_size > 1 and dist.is_initialized() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")

    def record(self, signum: int) -> None:
        """From the signal handler: remember the first stop signal, nothing else."""
        if self.received is None:
            self.received = signum

    def at_boundary(self) -> list[int]:
        """Every rank's signal as of the exchange started at the last boundary (0: none); starts the next
        exchange when none is set."""
        signals = self.agreed()
        if not any(signals):
            self._start_exchange()
        return signals

    def _alone(self) -> bool:
        return self.world_size == 1 or not dist.is_initialized()

    def _start_exchange(self) -> None:
        """Send this rank's received signal (0: none) to every rank, without waiting."""
        if self._alone():
            return
        signals = torch.zeros(self.world_size, dtype=torch.int32)
        signals[self.rank] = self.received or 0
        self._exchange = (dist.all_reduce(signals, group=self._group, async_op=True), signals)
        in_flight.keep(signals)  # the last one may be read as the run ends, or dropped unread

    def agreed(self) -> list[int]:
        """Every rank's signal as of the exchange started at the last boundary, the same list on
        every rank (zeros before the first); on one rank, its signal now."""
        if self._alone():
            return [self.received or 0]
        if self._exchange is None:
            return [0] * self.world_size
        (work, signals), self._exchange = self._exchange, None
        work.wait()
        return signals.tolist()

    @property
    def pending(self) -> bool:
        """An exchange started at the last boundary, not read yet."""
        return self._exchange is not None


class Preemption(Feature):
    """Signals while fitting, a feature of the Trainer's strategy (see the module docstring).

    ``setup`` takes over a fit's signals and ``teardown`` ends that; the rest happens in
    Lightning's signal connector and in a callback this adds.
    """

    def __init__(self) -> None:
        self._agreement: _Agreement | None = None  # from setup to teardown
        self._last_step: int | None = None
        self._epoch_loop: Any = None

    @property
    def received(self) -> int | None:
        """The stop signal this rank received during the current fit, if any."""
        return self._agreement.received if self._agreement is not None else None

    @override
    def setup(self, run: Run) -> None:
        """Take over the fit's signal handling and add the step-boundary callback (every rank,
        collectively under NCCL)."""
        trainer = run.trainer
        if trainer is None or not run.fitting:
            return
        self._agreement = _Agreement(run.strategy.world_size, run.strategy.global_rank)
        self._last_step = trainer.global_step
        if not isinstance(signal_connector(trainer), _PreemptionSignals):
            replace_signal_connector(trainer, _PreemptionSignals(trainer, self))
        self._epoch_loop = trainer.fit_loop.epoch_loop
        skip_sigterm_broadcast(self._epoch_loop)
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, _StopAtStepBoundary)]
        trainer.callbacks.append(_StopAtStepBoundary(self))
        log.debug("lit_dp preemption: SIGTERM and SIGUSR1 stop the fit at the next optimizer step all ranks agree on")

    @override
    def teardown(self) -> None:
        # A fit that raised may leave an exchange unfinished: the group's end ends it; the agreement's own
        # group is destroyed with the others when the strategy ends the process group.
        self._agreement = None
        if self._epoch_loop is not None:
            restore_sigterm_broadcast(self._epoch_loop)
            self._epoch_loop = None

    def at_train_end(self) -> None:
        agreement = self._agreement
        if agreement is None:
            return
        if agreement.pending:
            agreement.agreed()  # every rank started it at the last boundary; nothing stops after the last step
        if agreement.received is not None:
            log.info(
                "lit_dp: %s arrived on rank %d after the fit's last optimizer step: the fit completed",
                signal.Signals(agreement.received).name,
                dist.get_rank() if dist.is_initialized() else 0,
            )

    def record(self, signum: int) -> None:
        """From the signal handler: remember the first stop signal, nothing else."""
        if self._agreement is not None:
            self._agreement.record(signum)

    def at_step_boundary(self, trainer: pl.Trainer) -> None:
        """After an optimizer step: agree with the other ranks; if any got a signal, save and stop."""
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-batch: no step taken, no boundary
        self._last_step = trainer.global_step
        assert self._agreement is not None
        signals = self._agreement.at_boundary()
        if not any(signals):
            return
        ranks = [rank for rank, signum in enumerate(signals) if signum]
        signum = signals[ranks[0]]
        requeue_signal = _slurm_requeue_signal(trainer)
        requeue = requeue_signal is not None and requeue_signal in signals
        if requeue:
            # Lightning's own SLURM handler, at the boundary: hpc_ckpt_<n>.ckpt, then scontrol requeue.
            checkpoint = slurm_requeue(trainer, requeue_signal)
            signum = requeue_signal
        else:
            checkpoint = str(stop_checkpoint_path(trainer))
            trainer.save_checkpoint(checkpoint, weights_only=False)
        requeued = "requeue asked of SLURM (scontrol requeue; Lightning logs its answer)" if requeue else None
        stop = Preempted(signum, ranks, trainer.global_step, checkpoint, requeued)
        if trainer.is_global_zero:
            print(f"[lit_dp] {stop.reason}; exiting with status {stop.code}", flush=True)
        self._agreement.received = None
        raise stop


class FabricPreemption(Feature):
    """Signals in a Fabric loop: SIGTERM or SIGUSR1 to any rank raises ``Preempted`` on every rank, from
    the same ``optimizer.step()``, which is not taken; the ranks agree as under the Trainer (``_Agreement``),
    at the entry of each step.

    Fabric's checkpoint is the loop's own dict, so the strategy writes none: the loop saves in
    ``except Preempted:`` (every rank is there, so ``fabric.save`` meets its collectives) and re-raises,
    and every rank exits with 128 + the signal number; a loop that does not catch it exits the same,
    unsaved. The handlers are this process's from the first ``fabric.setup`` to
    ``fabric.strategy.teardown()`` (the main thread only: Python delivers signals there).
    """

    def __init__(self) -> None:
        self._agreement: _Agreement | None = None
        self._previous: dict[int, Any] = {}  # the handlers replaced, given back at teardown
        self._models: list[Any] = []  # the models set up, whose Join contexts suspend the agreement
        self._steps = 0

    @override
    def setup(self, run: Run) -> None:
        if run.model is not None:
            self._models.append(run.model)
        if self._agreement is not None or threading.current_thread() is not threading.main_thread():
            return
        self._agreement = agreement = _Agreement(run.strategy.world_size, run.strategy.global_rank)
        self._steps = 0
        self._previous = {signum: signal.signal(signum, lambda signum, frame: agreement.record(signum)) for signum in STOP_SIGNALS}
        log.debug("lit_dp preemption: SIGTERM and SIGUSR1 stop the loop after the next optimizer step all ranks agree on")

    @override
    def optimizer_step(self, step: Callable[[Any], Any], optimizer: Any, closure: Any) -> Any:
        """The boundary is the entry of each ``optimizer.step()``: a stop raises there, before the step
        is taken (and before the features inside count it, LocalSGD's among them)."""
        if self._agreement is None or any(join.active(model) for model in self._models):
            # Inside fabric.strategy.join(model) a rank that ran out takes no optimizer step to agree at:
            # a signal waits for the first step after the context.
            return step(closure)
        signals = self._agreement.at_boundary()
        if any(signals):
            ranks = [rank for rank, signum in enumerate(signals) if signum]
            stop = Preempted(signals[ranks[0]], ranks, self._steps, None, None)
            if self._agreement.rank == 0:
                print(f"[lit_dp] {stop.reason} (optimizer steps of this run); exiting with status {stop.code}", flush=True)
            self._agreement.received = None
            raise stop
        output = step(closure)
        self._steps += 1
        return output

    @override
    def teardown(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        self._models = []
        self._agreement = None


def stop_checkpoint_path(trainer: pl.Trainer) -> Path:
    """Where a stop saves: ``last.ckpt`` (the callback's own name for it) in the first
    ``ModelCheckpoint``'s folder, where ``ckpt_path="last"`` finds it; else ``default_root_dir``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        metrics = {**trainer.callback_metrics, "epoch": torch.tensor(trainer.current_epoch),
                   "step": torch.tensor(trainer.global_step)}
        return Path(callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST))
    return Path(trainer.default_root_dir) / f"last{ModelCheckpoint.FILE_EXTENSION}"


def _slurm_requeue_signal(trainer: pl.Trainer) -> int | None:
    environment = cluster_environment(trainer)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return int(environment.requeue_signal)
    return None


class _PreemptionSignals(SignalConnector):
    """Lightning's signal connector whose handlers only record the signal (see the module docstring)."""

    def __init__(self, trainer: pl.Trainer, preemption: Preemption) -> None:
        super().__init__(trainer)
        self._preemption = preemption

    @override
    def register_signal_handlers(self) -> None:
        if self.trainer.state.fn != TrainerFn.FITTING:
            super().register_signal_handlers()  # validate, test, predict: Lightning's own handling
            return
        self.received_sigterm = False  # Lightning's loops act on it rank by rank: never set here
        self._original_handlers = self._get_current_signal_handlers()
        requeue_signal = _slurm_requeue_signal(self.trainer)
        for signum in {*STOP_SIGNALS, *([requeue_signal] if requeue_signal else [])}:
            self._register_signal(signum, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._preemption.received is None:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the ranks this process started (Lightning's script launcher)
        self._preemption.record(signum)


class _StopAtStepBoundary(pl.Callback):
    """Calls ``Preemption.at_step_boundary`` after every training batch (it skips batches with no
    step), and tells it when training has ended."""

    def __init__(self, preemption: Preemption) -> None:
        self._preemption = preemption

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._preemption.at_step_boundary(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._preemption.at_train_end()


class BoundScriptLauncher(TrainerScriptLauncher):
    """Lightning's script launcher (``start_method="popen"``), whose ranks never outlive it (see the
    module docstring): the ranks it starts are bound to it, and outside the fit a stop signal is
    answered with ``StoppedOutsideTraining`` rather than a silent death.

    ``stops_outside_the_fit``: whether it answers stop signals outside the fit; a launcher that
    stands in for Lightning's own under another strategy (the recipes' ``strategy=ddp``) leaves them
    to that strategy, as Lightning does.
    """

    stops_outside_the_fit = True

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        starts_ranks = not self.cluster_environment.creates_processes_externally
        if not (starts_ranks and self.stops_outside_the_fit) or threading.current_thread() is not threading.main_thread():
            return super().launch(function, *args, trainer=trainer, **kwargs)
        stopping: list[int] = []

        def stop(signum: int, frame: FrameType | None) -> None:
            if stopping:  # a second signal while the first unwinds (a teardown that waits): at once
                self.kill(signal.SIGKILL)
                os._exit(128 + signum)
            stopping.append(signum)
            self.kill(signal.SIGKILL)  # the ranks started so far: without rank 0 they cannot go on
            stopped = StoppedOutsideTraining(signum, self.cluster_environment.global_rank(), len(self.procs))
            print(f"[lit_dp] {stopped.reason}; exiting with status {stopped.code}", flush=True)
            raise stopped

        # In place until the fit's run stage, whose signal connector saves them and puts them back after it.
        previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if trainer is not None:
                # After a fit that raised, Lightning tears the Trainer down once this returns, and its signal
                # connector would put back what it saved as the run stage began: this handler, for good.
                replace_saved_signal_handlers(trainer, lambda signum, handler: previous[signum] if handler is stop else handler)

    @override
    def _call_children_scripts(self) -> None:
        with binding_started_ranks():
            start_script_ranks(self, TrainerScriptLauncher)


class ForwardingMultiProcessingLauncher(TrainerMultiProcessingLauncher):
    """Lightning's launcher for ``start_method="spawn"``/``"fork"``, whose launching process passes
    SIGTERM and SIGUSR1 on to the ranks and exits with their 128 + signal once they have stopped."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return super().launch(function, *args, trainer=trainer, **kwargs)
        forwarded: list[int] = []

        def forward(signum: int, frame: FrameType | None) -> None:
            forwarded.append(signum)
            self.kill(signum)  # the ranks started so far (`self.procs`); each stops at the agreed step

        previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except torch.multiprocessing.ProcessExitedException as exited:
            if forwarded and exited.exit_code == 128 + forwarded[0]:
                raise SystemExit(exited.exit_code) from exited  # the ranks stopped as asked, and saved
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
