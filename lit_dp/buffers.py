"""``DataParallel``'s buffers: torch DDP's ``broadcast_buffers``, the first broadcast, and the source under Join.

Before each forward that follows a synchronising one, the buffers (BatchNorm's running statistics)
of the group's first rank are broadcast, as on DDP; under torch's ``Join`` only synchronising
forwards broadcast, from the highest rank still in, which a joined rank matches
(``shadow_buffer_broadcast``). A mixin of ``DataParallel``, whose state it reads: the model, its
ignore list, the groups, the waiter and the observers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import lit_dp.gradients.group as groups
from lit_dp.gradients.broadcast import _check_same_structure, synced_buffers, synced_parameters, sync_params_buffers
from lit_dp.gradients.coalesced import broadcast_coalesced
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.waiting import UNWATCHED
from lit_dp.join import active as in_join_context


class BufferBroadcasts:
    """The buffer half of ``DataParallel``: what its forwards broadcast, and from which rank."""

    def _broadcast_initial_state(self, group: dist.ProcessGroup, with_buffers: bool) -> None:
        """The group's first rank's parameters (and buffers) to every rank, once the ranks agree
        on the model's structure (torch's own groups; a group written in Python is trusted)."""
        if with_buffers and groups.is_registered(group):
            sync_params_buffers(
                self.module,
                group=group,
                src_rank=dist.get_global_rank(group, 0),
                params_and_buffers_to_ignore=self.parameters_to_ignore,
            )
            return
        named = [(name, p.data) for name, p in synced_parameters(self.module, self.parameters_to_ignore)]
        if with_buffers:
            named += list(synced_buffers(self.module, self.parameters_to_ignore))
        if groups.is_registered(group):
            ranks = dist.get_process_group_ranks(group)
            _check_same_structure(named, group, ranks, ranks[0])
        broadcast_coalesced([t for _, t in named], group, 0, UNWATCHED, "the initial broadcast of the model")

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast before forwards (torch DDP's attribute; ``forward_sync_buffers``)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (torch DDP's method of that name)."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and self._has_buffers
            and self._buffer_group is not None
            and not groups.trivially_alone(self._buffer_group)
        )

    def _forward_communication(self, plan: StepPlan | None) -> None:
        """A forward's own collective, the buffer broadcast (``broadcast_buffers``), and the flag
        that says whether the next forward takes one: this forward's backward synchronises.

        Under torch's ``Join`` only synchronising forwards broadcast, from the highest rank still
        in (agreed in one all-reduce that a joined rank matches, ``shadow_buffer_broadcast``):
        a joined rank hears of those forwards only.
        """
        if in_join_context(self):
            if plan is not None and plan.participation is Participation.SYNC and self._joins_buffers():
                self._broadcast_buffers(self._agree_on_buffer_source(self._rings[0].rank()))
                self._buffers_synced()
        elif self.will_sync_module_buffers():
            self._broadcast_buffers(self._buffer_source)  # the group's first rank, as on DDP, by default
            self._buffers_synced()
        self.require_forward_param_sync = torch.is_grad_enabled() and self._syncs_gradients()

    def _buffers_synced(self) -> None:
        """The buffers as every rank holds them now, before the forward updates them: the consistency
        check fingerprints them, when the coming step is one it checks."""
        if self._observers.consistency is not None:
            self._observers.consistency.buffers_synced(self._reducer.step + 1)

    def buffers_from(self, group_rank: int) -> None:
        """Which rank of the group the following forwards broadcast buffers from (``broadcast_buffers``):
        the group's first, as on DDP, unless the Trainer's ``uneven_inputs`` names the lowest rank
        that took the last step with a batch of its own (a rank without one updated no buffer).
        Every rank must name the same, as they do from the batch plans they agreed."""
        self._buffer_source = group_rank

    def shadow_buffer_broadcast(self) -> None:
        """On a rank that joined (``lit_dp.join``): take part in the buffer broadcast of a
        synchronising forward of the ranks still in, and adopt the buffers it sends."""
        if self._joins_buffers():
            self._broadcast_buffers(self._agree_on_buffer_source(-1))

    def _joins_buffers(self) -> bool:
        return self.forward_sync_buffers and self._has_buffers and not groups.trivially_alone(self._rings[0])

    def _agree_on_buffer_source(self, candidate: int) -> int:
        """The highest candidate rank of the group (a joined rank offers -1), as DDP's ``_find_common_rank``."""
        agreed = torch.tensor([candidate], device=self.join_device)
        group = self._rings[0]
        work = dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True)
        groups.wait(self._waiter, work, group, "the choice of the rank whose buffers are broadcast")
        return int(agreed.item())

    def _broadcast_buffers(self, source: int) -> None:
        # Collected at each broadcast: a module may have replaced a buffer since (DDP does the same).
        buffers = [buffer for _, buffer in synced_buffers(self.module, self.parameters_to_ignore)]
        broadcast_coalesced(buffers, self._buffer_group, source, self._waiter, "the broadcast of the module's buffers")
