"""lit_dp's options: each declared once, with its default, help, check, front doors and names.

The lowest layer of the library: it imports torch only, and the layers above read their
defaults and checks from here. One module per feature:

- ``declare``: how an option is declared (``option``, ``group``) and the checks options share;
- ``core``: ``Options``, the core options composed with the groups, ``Options.build``;
- ``trace``, ``local_sgd``, ``sharding``: the groups ``trace.*``, ``local_sgd.*``, ``sharding.*``;
- ``straggler``, ``consistency``: the health checks' groups ``straggler.*`` and ``consistency.*``;
- ``forecast``: the end-of-run forecast's group ``forecast.*``, and how bandwidths and latencies are written;
- ``fault_tolerance``: ``fault_tolerance`` and its group ``ft.*`` (torchft), with what they refuse;
- ``comm_hooks``: the registry of named communication hooks; ``compress`` (``fp16``, ``bf16``)
  and ``powersgd`` are lit_dp's own;
- ``backends``: which torch.distributed backends a job may name;
- ``docs``: docs/options.md and the front doors' docstrings, generated.

Adding an option: one ``option(...)`` field, in ``Options`` or in its feature's group, plus the
code that reads it (docs/options.md says how, step by step).
"""

from lit_dp.options import compress, powersgd  # noqa: F401 - importing them registers lit_dp's named hooks
from lit_dp.options.comm_hooks import NamedHook, describe_comm_hook, register_named_hook, resolve_comm_hook
from lit_dp.options.core import AUTO, DEFAULT_BUCKET_MB, Declared, Options, declared_options
from lit_dp.options.consistency import ConsistencyOptions
from lit_dp.options.declare import EVERYWHERE, FABRIC, MODULE, STRATEGIES, TRAINER, option
from lit_dp.options.fault_tolerance import FaultToleranceOptions
from lit_dp.options.forecast import ForecastOptions
from lit_dp.options.local_sgd import LocalSGDOptions
from lit_dp.options.powersgd import PowerSGDOptions
from lit_dp.options.sharding import ShardingOptions
from lit_dp.options.straggler import StragglerOptions
from lit_dp.options.trace import TraceOptions

__all__ = [
    "AUTO",
    "ConsistencyOptions",
    "DEFAULT_BUCKET_MB",
    "EVERYWHERE",
    "FABRIC",
    "MODULE",
    "STRATEGIES",
    "TRAINER",
    "Declared",
    "FaultToleranceOptions",
    "ForecastOptions",
    "LocalSGDOptions",
    "NamedHook",
    "Options",
    "PowerSGDOptions",
    "ShardingOptions",
    "StragglerOptions",
    "TraceOptions",
    "declared_options",
    "describe_comm_hook",
    "option",
    "register_named_hook",
    "resolve_comm_hook",
]
