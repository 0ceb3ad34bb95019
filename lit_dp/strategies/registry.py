"""The strategies' features, in order: one registry for the Trainer and for Fabric.

Each line is a feature class (``lit_dp.strategies.feature.Feature``) and the front doors it
serves. ``build_features`` makes those that the options turn on (``Feature.build``), once per
strategy, when it is built: a checkpoint is loaded before the run is set up. What a feature
exposes (``Feature.exposes``) becomes an attribute of the strategy classes of the doors it
serves as they are defined (``lit_dp.strategies.exposed``).

The order is part of the contract. Hooks that pass a value on go down the list, hooks that wrap
a call nest with the first outermost, teardown goes up it:

- sharding first: it rebuilds each optimizer over this rank's parameters, and every other feature
  keeps the optimizer it returns;
- fault tolerance next: it replaces the training loader (batches dealt step by step to the
  replica groups present) and gates the optimizer step around every other feature's;
- the loader's resume next: it continues the loader fault tolerance left alone;
- then uneven inputs, which wraps the loader the others produced and checks the strategy's
  collectives before the watchdog watches them (Fabric's: ``fabric.strategy.join(model)``);
- LocalSGD's schedule and the tuned bucket size, which the ranks agree on;
- preemption (the Trainer's saves; Fabric's raises for the loop to save) and lost ranks, which end a run;
- the hang watchdog, then the monitors last: they observe what the others did.
"""

from __future__ import annotations

from lit_dp.options import FABRIC, TRAINER, Options
from lit_dp.strategies.fault_tolerance import FabricFaultTolerance, TrainerFaultTolerance
from lit_dp.strategies.feature import Feature, Features
from lit_dp.strategies.local_sgd import LocalSGDSchedule
from lit_dp.strategies.lost_ranks import LostRanks
from lit_dp.strategies.monitoring import Monitors
from lit_dp.strategies.preemption import FabricPreemption, Preemption
from lit_dp.strategies.resume import EpochContinuation
from lit_dp.strategies.sharding import ShardedOptimizers
from lit_dp.strategies.tuned_size import TunedBufferSize
from lit_dp.strategies.uneven import FabricUnevenInputs, UnevenInputs
from lit_dp.strategies.watchdog import StrategyWatchdog

BOTH = (TRAINER, FABRIC)

FEATURES: tuple[tuple[type[Feature], tuple[str, ...]], ...] = (
    (ShardedOptimizers, BOTH),
    (TrainerFaultTolerance, (TRAINER,)),
    (FabricFaultTolerance, (FABRIC,)),
    (EpochContinuation, (TRAINER,)),
    (UnevenInputs, (TRAINER,)),
    (FabricUnevenInputs, (FABRIC,)),
    (LocalSGDSchedule, BOTH),
    (TunedBufferSize, BOTH),
    (Preemption, (TRAINER,)),
    (FabricPreemption, (FABRIC,)),
    (LostRanks, (TRAINER,)),
    (StrategyWatchdog, BOTH),
    (Monitors, BOTH),
)


def serving(door: str) -> list[type[Feature]]:
    """The features of ``FEATURES`` that serve ``door`` (``TRAINER`` or ``FABRIC``), in order: those its strategy
    builds, and whose exposed attributes its class has (``lit_dp.strategies.exposed``)."""
    return [feature for feature, doors in FEATURES if door in doors]


def build_features(options: Options, door: str) -> Features:
    """The features that serve ``door`` and that ``options`` turn on."""
    built = (feature.build(options) for feature in serving(door))
    return Features([feature for feature in built if feature is not None])
