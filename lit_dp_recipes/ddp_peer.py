"""``strategy=ddp``: Lightning's ``DDPStrategy`` beside ``paddle_dp``, configured with lit_dp's option names.

Apart from ``lit_dp_recipes.config`` because it is Lightning's class: the config's schemas and
checks run before Lightning loads (``lit_dp_recipes.cli``), the peer only once a run starts.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

from lit_dp.ddp_arguments import ddp_strategy_arguments
from lit_dp.strategies.precision import for_data_parallel


class DDPPeer(DDPStrategy):
    """Lightning's ``DDPStrategy``, as ``strategy=ddp`` runs it beside ``paddle_dp``: the same
    model, optimizer, precision and clipping, the gradients reduced by torch DDP.

    Two differences from Lightning's class keep what the recipes run comparable:

    - the precision plugin is lit_dp's (``lit_dp.strategies.precision``), which differs from
      Lightning's in clipping only: a fused AdamW (the GPT recipe's) can be clipped under
      ``bf16-mixed``, where Lightning's refuses at the first step; its checkpoints keep
      Lightning's names;
    - the communication hook is registered on every device, as torch DDP allows; Lightning
      registers it on CUDA only, and would run ``strategy.comm_hook=bf16`` uncompressed on CPU.
    """

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Where Lightning hands the strategy the plugin it made for `precision=` (or the user's).
        self._precision_plugin = for_data_parallel(plugin)

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:  # torch's own registration, as Lightning's on CUDA
            wrapper = self._ddp_comm_wrapper
            hook = self._ddp_comm_hook if wrapper is None else wrapper(self._ddp_comm_hook)
            self.model.register_comm_hook(state=self._ddp_comm_state, hook=hook)


def ddp_strategy(**values: Any) -> DDPPeer:
    """``strategy=ddp``: torch DDP configured from lit_dp's option names, each mapped to DDP's own or
    refused by name (``lit_dp.ddp_arguments.ddp_strategy_arguments``)."""
    return ddp_peer(values)


def ddp_peer(values: dict[str, Any], prefix: str = "", nested: bool = False) -> DDPPeer:
    """``DDPPeer`` from lit_dp's options ``values``; errors name each option ``prefix`` + as given."""
    return DDPPeer(**ddp_strategy_arguments(values, prefix, nested=nested))
