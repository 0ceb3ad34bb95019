"""The bucket size in effect and, with ``comm_buffer_size="auto"``, the tuned size kept: a feature of both strategies.

It answers ``strategy.comm_buffer_size`` (the fixed size, or under ``"auto"`` what the model uses)
and ``strategy.tuned_comm_buffer_size``, so it is built whatever the options. With ``"auto"`` the
model's autotuner (``DataParallel.autotuner``) chooses the size in the first steps, and this
feature is its one owner above the model: it reads the size chosen, keeps it when the run ends
(a later fit or ``fabric.setup`` in the process starts with it), stores it in the Trainer's
checkpoints (``tuned_comm_buffer_size``) and takes it back from one being resumed. A size kept
or restored replaces "auto" when the next model is wrapped: no step is spent tuning again.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.options import AUTO, Options
from lit_dp.strategies.feature import Feature, Run


class TunedBufferSize(Feature):
    """The size in effect (``comm_buffer_size``) and, under ``"auto"``, the one chosen by the autotuner or restored
    (``size``, ``tuned_comm_buffer_size``)."""

    key = "tuned_comm_buffer_size"
    exposes = {"comm_buffer_size": AUTO, "tuned_comm_buffer_size": None}  # built for every option: never off

    def __init__(self, configured: float | str = AUTO) -> None:
        self._configured = configured  # the option: a size in MB, or "auto"
        self._kept: float | None = None  # restored from a checkpoint, or chosen by a finished run
        self._model: DataParallel | None = None  # the model set up last, from setup to teardown

    @classmethod
    @override
    def build(cls, options: Options) -> TunedBufferSize:
        return cls(options.comm_buffer_size)

    @property
    def comm_buffer_size(self) -> float | str:
        """The bucket size in MB: the fixed size; with ``"auto"``, the tuned size once chosen or kept (restored
        from a checkpoint, or chosen by an earlier run), the default while the first steps tune
        (``DataParallel.comm_buffer_size``), and ``"auto"`` before a model is wrapped."""
        if self.size is not None:
            return self.size
        return self._model.comm_buffer_size if self._model is not None else self._configured

    @property
    def tuned_comm_buffer_size(self) -> float | None:
        """With ``comm_buffer_size="auto"``: the size chosen in this run, or kept from an earlier run or a checkpoint;
        None otherwise."""
        return self.size

    @property
    def size(self) -> float | None:
        """The size in MB kept or restored, else the one the running model's autotuner chose; None before."""
        if self._kept is not None:
            return self._kept
        tuner = self._model.autotuner if self._model is not None else None
        return tuner.chosen_mb if tuner is not None else None

    @override
    def wrapper_arguments(self, run: Run, arguments: dict[str, Any]) -> dict[str, Any]:
        if self._kept is None:
            return arguments
        rank_zero_info(f"[lit_dp] comm_buffer_size=auto: {self._kept:g} MB, tuned before (checkpoint or earlier fit)")
        return {**arguments, "options": arguments["options"].replace(comm_buffer_size=self._kept)}

    @override
    def setup(self, run: Run) -> None:
        if run.model is not None:
            self._model = run.model

    @override
    def teardown(self) -> None:
        self._kept = self.size
        self._model = None

    @override
    def state_dict(self) -> float | None:
        return self.size

    @override
    def load_state_dict(self, state: float | None) -> None:
        """A Trainer's resume: the size replaces "auto" as the model is wrapped. ``fabric.load`` after
        ``fabric.setup``: the running model stops tuning and takes it at its next step. A fixed size stays."""
        if state is None or self._configured != AUTO:
            return
        self._kept = state
        tuner = self._model.autotuner if self._model is not None else None
        if tuner is not None and tuner.chosen_mb is None:
            rank_zero_info(f"[lit_dp] comm_buffer_size=auto: {state:g} MB from the checkpoint, tuned before")
            tuner.adopt(state)
