"""The Trainer strategy's side of docs/reliability.md: uneven inputs and the hang watchdog.

``PaddleDPStrategy`` takes this mixin first in its bases. With ``uneven_inputs=True`` the
training and validation loaders are wrapped (``lit_dp.strategies.uneven``), a batch this rank
replays skips the user's step and takes the synchronisation without a backward, and the
collectives a user's step issues while a rank is out are refused at once. Without the option,
training loaders of known, different lengths are an error at the start of ``fit``. The hang
watchdog gets the run's log directory, validation and rank 0's checkpoint writes as known
phases (the others' waits meanwhile get its long deadline), and a watch over the strategy's own
collectives (whose waits have no deadline of lit_dp's).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.observability.phases import enter_phase, leave_phase
from lit_dp.strategies.uneven import UnevenInputs, UnevenMetricsCallback, check_equal_lengths, gather_lengths


class ReliabilityMixin:
    """Uneven inputs and the hang watchdog's wiring, for ``lit_dp.PaddleDPStrategy`` (see the module docstring)."""

    _uneven: UnevenInputs | None = None  # uneven_inputs=True, while fitting
    _validating = False  # inside the hang watchdog's validation phase (issue 27)

    @property
    def _replaying(self) -> bool:
        """This rank has no batch of its own for the current step (it takes the step with the others)."""
        return self._uneven is not None and self._uneven.replaying

    def _setup_reliability(self, trainer: pl.Trainer) -> None:
        if not isinstance(self.model, DataParallel):
            return
        if self.model.watchdog is not None:
            self.model.watchdog.directory = trainer.log_dir or trainer.default_root_dir
        if self._options.uneven_inputs:
            self._uneven = self._setup_uneven_inputs(trainer, self.model)

    def _teardown_reliability(self) -> None:
        if self._uneven is not None:
            self._uneven.close()
            self._uneven = None
        self._leave_validation_phase()  # a validation that raised
        if isinstance(self.model, DataParallel) and self.model.watchdog is not None:
            self.model.watchdog.close()

    # issue 27: validation and rank 0's checkpoint writes are known phases of the hang watchdog.
    def _known_phase(self, name: str) -> AbstractContextManager:
        """``name`` as a known phase of the hang watchdog (when on), for what only this rank does."""
        watchdog = self.model.watchdog if isinstance(self.model, DataParallel) else None
        return watchdog.phase(name) if watchdog is not None else nullcontext()

    @override
    def on_validation_start(self) -> None:
        if isinstance(self.model, DataParallel) and self.model.watchdog is not None and not self._validating:
            enter_phase("validation")
            self._validating = True

    def _leave_validation_phase(self) -> None:
        if self._validating:
            leave_phase()
        self._validating = False

    def _setup_uneven_inputs(self, trainer: pl.Trainer, model: DataParallel) -> UnevenInputs | None:
        if model.reducer is None or self.world_size < 2:
            return None
        if self._layer_sync is not None:
            raise ValueError(
                "uneven_inputs=True with Trainer(sync_batchnorm=True) is invalid: SyncBatchNorm all-reduces inside "
                "the forward, which a rank that has run out of batches does not run; expected one of them."
            )
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            raise ValueError(
                "uneven_inputs=True needs automatic optimization: under manual optimization the strategy cannot "
                "know how many synchronised backwards a training_step takes, so a rank without a batch could not "
                "take them with the others."
            )
        # The exchange runs on the host: under NCCL on a Gloo group of its own.
        group = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
        uneven = UnevenInputs(group, model.waiter)
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, UnevenMetricsCallback)]
        trainer.callbacks.append(UnevenMetricsCallback(uneven, trainer))
        return uneven

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training: with different lengths on the ranks, an error now (or, with ``uneven_inputs``, a
        loader that replays until every rank is out); validation under ``uneven_inputs``: the same."""
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or self.world_size < 2 or not dist.is_initialized():
            return dataloader
        training = trainer.state.stage == RunningStage.TRAINING
        if not training and self._uneven is None:
            return dataloader
        lengths = gather_lengths(dataloader)
        if self._uneven is None:
            check_equal_lengths(lengths, trainer.limit_train_batches)
            return dataloader
        known = None if None in lengths else max(lengths)  # type: ignore[type-var]
        return self._uneven.wrap(dataloader, "train" if training else "val", known)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self._uneven is not None and self.lightning_module is not None:
            trainer = self.lightning_module.trainer
            if trainer.training:
                self._uneven.start_batch("train")
            elif trainer.validating or trainer.sanity_checking:
                self._uneven.start_batch("val")
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        uneven = self._uneven
        if uneven is None:
            return super().training_step(*args, **kwargs)
        if uneven.replaying:
            # No batch of this rank's: Lightning backpropagates this, and `backward` below takes
            # the step's collectives with the others instead.
            return torch.zeros((), device=self.root_device, requires_grad=True)
        with uneven.user_step("training_step"):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        uneven = self._uneven
        if uneven is None:
            return super().validation_step(*args, **kwargs)
        if uneven.replaying:
            return None
        with uneven.user_step("validation_step"):
            return super().validation_step(*args, **kwargs)

    @override
    def on_validation_end(self) -> None:
        self._leave_validation_phase()
        if self._uneven is not None:
            self._uneven.reset("val")

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._replaying and isinstance(self.model, DataParallel):
            self.model.replay_step()
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    def _collective(self, name: str) -> Generator[None, None, None]:
        """One of the strategy's collectives: refused where uneven inputs cannot match it, and
        watched by the hang watchdog (its thread: the wait itself has no deadline)."""
        if self._uneven is not None:
            self._uneven.check_collective(name)
        watchdog = self.model.watchdog if isinstance(self.model, DataParallel) else None
        with watchdog.watching(f"strategy.{name}") if watchdog is not None else nullcontext():
            yield

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        with self._collective("all_gather"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
