"""``lit_dp.fabric``: the Fabric front door, as ``lightning.fabric.strategies`` is Lightning's.

``Fabric(strategy="paddle_dp")`` or ``Fabric(strategy=lit_dp.fabric.PaddleDPStrategy(...))``;
a config names it ``class_path: lit_dp.fabric.PaddleDPStrategy``. The strategy itself lives with
the Trainer's in ``lit_dp.strategies`` (``lit_dp.strategies.fabric``), which share its base.
``Preempted`` is what ``optimizer.step()`` raises on every rank when a rank got SIGTERM or SIGUSR1.
"""

from lit_dp.strategies.fabric import PaddleDPStrategy
from lit_dp.strategies.preemption import Preempted

__all__ = ["PaddleDPStrategy", "Preempted"]
