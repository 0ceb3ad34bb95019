"""One rank's tensors to the rest of its group, coalesced: the per-forward buffer broadcast and its kin.

``DataParallel`` broadcasts its module's buffers before a forward (``broadcast_buffers``, torch
DDP's default), a joined rank shadows that broadcast, and after a Join every rank takes the
authoritative rank's parameters; each is one call here. Tensors travel flattened, one broadcast
per dtype and device (in chunks of at most 128 MB, as ``sync_params_buffers`` cuts them), all
started before any is awaited. The source is a rank of the group (``group_src``), so any
group works, a subgroup without global rank 0 or a group written in Python
(``lit_dp.gradients.group``).

The copies back leave autograd's version counters alone, as torch DDP's buffer broadcast does: a
buffer saved for backward by a forward before this one (two forwards, one backward) is not
"modified by an inplace operation" by being overwritten with the same values on another rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import lit_dp.gradients.group as groups
from lit_dp.gradients.broadcast import _coalesced_chunks
from lit_dp.gradients.waiting import Waiter


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, group_src: int, waiter: Waiter, what: str
) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with those of its rank ``group_src``.

    ``what`` names the broadcast for the hang watchdog's diagnosis.
    """
    if not tensors:
        return
    receives = group.rank() != group_src
    with torch.no_grad():
        launched = []
        for chunk in _coalesced_chunks(tensors):
            flat = _flatten_dense_tensors(chunk)
            launched.append((chunk, flat, dist.broadcast(flat, group=group, group_src=group_src, async_op=True)))
        for chunk, flat, work in launched:
            groups.wait(waiter, work, group, what)
            if receives:
                with torch.autograd._unsafe_preserve_version_counter(tuple(chunk)):
                    torch._foreach_copy_(chunk, _unflatten_dense_tensors(flat, chunk))

