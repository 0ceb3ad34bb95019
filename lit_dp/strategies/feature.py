"""The strategies' features: one protocol, for the Trainer's strategy and Fabric's alike.

A feature is what a strategy does beside wrapping the model: uneven inputs, the hang
watchdog's wiring, preemption, resuming inside an epoch, LocalSGD's schedule, the tuned bucket
size, fault tolerance, the monitors. Each is one ``Feature``: hooks named after Lightning's
lifecycle (its ``Callback`` and ``Strategy``), every one doing nothing by default, and a
``state_dict``/``load_state_dict`` pair (torchtitan's ``Stateful``) stored under the feature's own
``key`` in the strategy's checkpoint entry. What a feature offers reads as the strategy's own
attribute where it names it in ``exposes`` (``strategy.local_sgd``), with no strategy edit: each
strategy class it serves gets the attribute as it is defined (``lit_dp.strategies.exposed``).
``lit_dp.strategies.registry`` builds them from the options, in an order that is part of the
contract; the strategies call ``Features``, which calls every feature in that order, and name
none of them.

Hooks that pass a value on (``process_dataloader``, ``batch_to_device``, the arguments of the
wrapper) chain it through the features in order; hooks that wrap a call (``training_step``,
``validation_step``, ``optimizer_step``, ``collective``, ``saving``) nest, the first feature
outermost; ``teardown`` runs in the reverse order, as contexts exit. A feature keeps what its
``setup`` hands it (``Run``) and owns its state: it reads the strategy and the model, and writes
neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from lit_dp.options import Options

# The strategies' own entry in a checkpoint, the Trainer's and ``fabric.save``'s alike: each feature's
# state under its ``key`` inside it.
CHECKPOINT_KEY = "lit_dp"

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lit_dp.data_parallel import DataParallel


@dataclass(frozen=True)
class Run:
    """What a strategy hands its features at ``setup``.

    Attributes:
        strategy: the strategy (its options, ranks and device), read, never written.
        model: the wrapped model (the one set up last under Fabric); None outside a fit.
        trainer: the Trainer running it; None under Fabric.
        features: the strategy's features (fault tolerance hands a recovering replica group theirs).
    """

    strategy: Any
    model: DataParallel | None
    trainer: pl.Trainer | None = None
    features: Features | None = None

    @property
    def fitting(self) -> bool:
        """A Trainer's ``fit`` (validate, test and predict set features up too), or any Fabric run."""
        from lightning.pytorch.trainer.states import TrainerFn

        return self.trainer is None or self.trainer.state.fn == TrainerFn.FITTING


class Feature:
    """One of the strategy's features: override the hooks it needs (see the module docstring).

    ``key``: its entry in the strategy's checkpoint state (``checkpoint["lit_dp"][key]`` in a
    Lightning checkpoint); None when it keeps nothing there. ``build`` makes it from the options
    (None: off for them).
    """

    key: ClassVar[str | None] = None
    # Properties and methods of the feature (each with a docstring and a return annotation) that are attributes of
    # the strategy classes it serves too (``strategy.local_sgd``; ``lit_dp.strategies.exposed``), with no strategy
    # edit: each name with what the strategy gives while the options leave the feature off (a value; for a method,
    # the function called in its place, or None where ``build`` never leaves the feature off).
    exposes: ClassVar[dict[str, Any]] = {}
    # Whether a replica group that recovers under fault tolerance takes this feature's state from a peer
    # (``Features.replica_state``): state that must be the same on every group, as LocalSGD's schedule.
    shared_by_replicas: ClassVar[bool] = False

    @classmethod
    def build(cls, options: Options) -> Feature | None:
        return cls()

    def setup_environment(self, strategy: Any) -> None:
        """This process's rank is started (its launcher, ranks and device known), before the process group."""

    def wrapper_arguments(self, run: Run, arguments: dict[str, Any]) -> dict[str, Any]:
        """Before the model is wrapped (``run.model`` is None): ``lit_dp.DataParallel``'s keyword
        ``arguments`` (``options`` and torch DDP's), changed (another ``options``, a torchft
        ``manager``) after starting what they need."""
        return arguments

    def setup(self, run: Run) -> None:
        """The model is wrapped, its optimizers set up: the run starts (under Fabric, at each model set up)."""

    def setup_optimizer(self, optimizer: Any) -> Any:
        """Each optimizer, after the strategy's own changes (e.g. sharding): the one to use. Fabric: at
        ``fabric.setup``, after ``setup``; the Trainer: those ``configure_optimizers`` built, after ``setup``."""
        return optimizer

    def process_dataloader(self, dataloader: Any) -> Any:
        """Each loader, before its first batch is fetched: the loader to use instead."""
        return dataloader

    def batch_to_device(self, batch: Any) -> Any:
        """Each batch, just before its step: the batch to use instead."""
        return batch

    def training_step(self, step: Callable[[], Any]) -> Any:
        """Around the user's ``training_step`` (``step()`` runs it, and the features inside)."""
        return step()

    def validation_step(self, step: Callable[[], Any]) -> Any:
        """Around the user's ``validation_step``."""
        return step()

    def optimizer_step(self, step: Callable[[Any], Any], optimizer: Any, closure: Any) -> Any:
        """Around the step of ``optimizer``: ``step(closure)`` takes it (the Trainer's closure runs
        forward and backward; Fabric's is None); what it returns is the step's output."""
        return step(closure)

    @property
    def joined(self) -> bool:
        """This rank has no batch of its own for the current step and takes the others'
        collectives without one (torch's ``Join``)."""
        return False

    @contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Around each of the strategy's own collectives (``barrier``, ``broadcast``, ``reduce``, ...)."""
        yield

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around this rank's part of a checkpoint's write (every rank takes part: rank 0 writes the full format,
        the others send it their own entries; every rank writes its part of the sharded one)."""
        yield

    def on_validation_start(self) -> None:
        """Validation starts (every rank)."""

    def on_validation_end(self) -> None:
        """Validation ended."""

    def on_train_end(self) -> None:
        """Training ended, on every rank: the Trainer's, after the callbacks' ``on_train_end`` (a last
        checkpoint); Fabric's at ``fabric.strategy.teardown()``, before ``teardown``."""

    def on_exception(self, exception: BaseException, strategy: Any) -> None:
        """The run failed with ``exception`` (add notes to it; end what cannot finish). The strategy is
        passed in: a run may fail before any other hook, even before ``setup_environment`` ends."""

    def teardown(self) -> None:
        """The run is over: release what ``setup`` took (threads, groups, callbacks' references)."""

    def state_dict(self) -> Any:
        """What a checkpoint keeps under ``key``; None: nothing (no entry is written). Called on every rank
        (``fabric.save`` and the Trainer's save alike) with no collective: what only this rank holds goes in a
        ``lit_dp.checkpoint.RankEntries`` under the key ``ranks``, keyed by rank, and the checkpoint's writer
        keeps every rank's."""
        return None

    @property
    def replicas_differ(self) -> bool:
        """This rank's model and optimizer states are its own, not rank 0's (LocalSGD between syncs): its
        ``state_dict`` keeps them, and the checkpoint keeps rank 0's as Lightning's."""
        return False

    def own_replica(self, state: Any) -> dict[str, Any] | None:
        """From this feature's entry ``state`` of a checkpoint being resumed: this rank's own model and optimizer
        states (``{"model": ..., "optimizers": [...]}``) where the checkpoint holds them apart from rank 0's, which
        the strategy then restores instead (and never reads rank 0's)."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """From a checkpoint (None: it has no entry): a Trainer's resume loads it before ``setup``,
        ``fabric.load`` usually after (once the model and optimizer it restores are set up), then
        before the next step. Keep it until ``setup``, or apply it at once when already set up."""


class Features(Sequence[Feature]):
    """The strategy's features in the registry's order, each hook called on all of them (see the module docstring)."""

    def __init__(self, features: list[Feature]) -> None:
        self._features = features

    def __getitem__(self, index: Any) -> Any:
        return self._features[index]

    def __len__(self) -> int:
        return len(self._features)

    def find(self, kind: type[Feature]) -> Any:
        """The feature of type ``kind``, if built (``strategy.feature(kind)``)."""
        return next((feature for feature in self._features if isinstance(feature, kind)), None)

    def wrapper_arguments(self, run: Run, arguments: dict[str, Any]) -> dict[str, Any]:
        for feature in self._features:
            arguments = feature.wrapper_arguments(run, arguments)
        return arguments

    def setup_environment(self, strategy: Any) -> None:
        for feature in self._features:
            feature.setup_environment(strategy)

    def setup(self, run: Run) -> None:
        for feature in self._features:
            feature.setup(run)

    def setup_optimizer(self, optimizer: Any) -> Any:
        for feature in self._features:
            optimizer = feature.setup_optimizer(optimizer)
        return optimizer

    def process_dataloader(self, dataloader: Any) -> Any:
        for feature in self._features:
            dataloader = feature.process_dataloader(dataloader)
        return dataloader

    def batch_to_device(self, batch: Any) -> Any:
        for feature in self._features:
            batch = feature.batch_to_device(batch)
        return batch

    def training_step(self, step: Callable[[], Any]) -> Any:
        return self._nest("training_step", step)()

    def validation_step(self, step: Callable[[], Any]) -> Any:
        return self._nest("validation_step", step)()

    def optimizer_step(self, step: Callable[[Any], Any], optimizer: Any, closure: Any) -> Any:
        for feature in reversed(self._features):
            step = partial(_nested_step, feature, step, optimizer)
        return step(closure)

    def _nest(self, hook: str, step: Callable[[], Any]) -> Callable[[], Any]:
        for feature in reversed(self._features):
            step = partial(getattr(feature, hook), step)
        return step

    @property
    def joined(self) -> bool:
        return any(feature.joined for feature in self._features)

    @contextmanager
    def collective(self, name: str) -> Iterator[None]:
        with ExitStack() as stack:
            for feature in self._features:
                stack.enter_context(feature.collective(name))
            yield

    @contextmanager
    def saving(self) -> Iterator[None]:
        with ExitStack() as stack:
            for feature in self._features:
                stack.enter_context(feature.saving())
            yield

    def on_validation_start(self) -> None:
        for feature in self._features:
            feature.on_validation_start()

    def on_validation_end(self) -> None:
        for feature in self._features:
            feature.on_validation_end()

    def on_train_end(self) -> None:
        for feature in self._features:
            feature.on_train_end()

    def on_exception(self, exception: BaseException, strategy: Any) -> None:
        for feature in self._features:
            feature.on_exception(exception, strategy)

    def teardown(self) -> None:
        for feature in reversed(self._features):
            feature.teardown()

    def state_dict(self) -> dict[str, Any]:
        """Each feature's state under its key (features with nothing to keep left out)."""
        state = {}
        for feature in self._features:
            if feature.key is not None and (own := feature.state_dict()) is not None:
                state[feature.key] = own
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each feature with a key gets its entry of ``state`` (None where there is none)."""
        for feature in self._features:
            if feature.key is not None:
                feature.load_state_dict(state.get(feature.key))

    @property
    def replicas_differ(self) -> bool:
        return any(feature.replicas_differ for feature in self._features)

    def own_replica(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's own model and optimizer states in the features' entry ``state`` of a checkpoint, if any."""
        for feature in self._features:
            if feature.key is not None and (own := feature.own_replica(state.get(feature.key))) is not None:
                return own
        return None

    def replica_state(self) -> dict[str, Any]:
        """The state a recovering replica group takes from a peer: the features ``shared_by_replicas``."""
        return {f.key: f.state_dict() for f in self._features if f.shared_by_replicas and f.key is not None}

    def load_replica_state(self, state: dict[str, Any]) -> None:
        """A peer's ``replica_state``, taken in between steps of a run under way."""
        for feature in self._features:
            if feature.shared_by_replicas and feature.key in state:
                feature.load_state_dict(state[feature.key])


def _nested_step(feature: Feature, step: Callable[[Any], Any], optimizer: Any, closure: Any) -> Any:
    return feature.optimizer_step(step, optimizer, closure)
