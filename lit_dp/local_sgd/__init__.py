"""``lit_dp.LocalSGD``: ranks step on their own gradients and average their models periodically.

Paddle's collective ``LocalSGD`` mode (fleet's ``localsgd`` and ``adaptive_localsgd`` meta
optimizers) for torch modules, usable without Lightning::

    model = lit_dp.DataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local_sgd = lit_dp.LocalSGD(model, local_steps=8, warmup_steps=100)
    for inputs, targets in loader:
        loss = criterion(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        local_sgd.step(loss)          # one call after each optimizer step
    local_sgd.finish()                # every rank now holds the same model

Schedule: the first ``warmup_steps`` (W) optimizer steps are ordinary data-parallel steps.
After that ``DataParallel`` stops all-reducing gradients (no ``no_sync`` needed), each rank
steps on its own gradients, and the models are averaged after every ``local_steps``-th (K-th)
local step counted from the end of warm-up: after optimizer steps W+K, W+2K, ... ``finish()``
averages once more unless the last step just did. Optimizer state is never communicated.

Averaging, as Paddle does it: each rank keeps a snapshot ``s`` of the last averaged parameters
and all-reduces the delta ``s - p`` (small numbers, so the sum rounds less than a sum of the
parameters themselves), then sets ``p = s - mean(delta)``, which is the mean of the ranks'
parameters, and takes it as the next snapshot. Floating-point buffers (BatchNorm's running
statistics) are averaged directly; other buffers (BatchNorm's ``num_batches_tracked``) are
taken from the group's first rank. Tensors travel coalesced in buckets of ``comm_buffer_size``
MB (``lit_dp.assign_group_by_size``), the buckets spread over the reducer's rings and all
launched before any is awaited.

Adaptive (``adaptive=True``, Paddle's ``AdaptiveLocalSGDOptimizer``, after Wang & Joshi,
"Adaptive Communication Strategies to Achieve the Best Error-Runtime Trade-off in Local-Update
SGD", 2019): at each average the next period becomes
``clip(ceil(sqrt(lr_0 * loss / (lr * loss_0) * K)), min_local_steps, max_local_steps)``
where ``loss_0`` and ``lr_0`` are the mean training loss and the learning rate at the first
step and ``loss``/``lr`` those at the average. Loss and learning rate are averaged over the
ranks by one all-reduce before the rule is applied, so every rank computes the same period.

Outer optimizer (``outer="nesterov"``, DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication
Training of Language Models", 2023): the mean delta ``mean(s - p)`` is a pseudo-gradient, and
``torch.optim.SGD(nesterov=True, lr=outer_lr, momentum=outer_momentum)`` steps the snapshot ``s``
with it (as torchft's DiLoCo does); every rank then takes the new snapshot as its parameters.
Momentum 0 is plain outer SGD (torch's SGD refuses Nesterov without momentum), and with
``outer_lr=1`` averaging; ``outer="average"`` is exactly the averaging above.
``sync_dtype`` (``"bf16"``, ``"int8"``, ``"int4"``, ``"fp8"``): the deltas travel in that format (int8,
int4 and fp8 with an fp32 scale per block of 128 values, int4 two codes a byte) and are summed in fp32
(an all-to-all of encoded chunks, their sum in fp32, an all-gather of the encoded sums: the bytes of
an all-reduce in the format), then turned back into the parameters' dtype before they are applied.
``error_feedback`` (on by default at 8 bits and below): what the format dropped on a rank, at either
of the two roundings, is added to that rank's next delta; the residuals are each rank's own state.

Under Join a rank counts in a sync if it took a step of its own since its fragment's last sync:
a rank that ran out of batches brings the work it did before at its fragments' next syncs, then
takes part without counting (it sends zeros); the sum is divided by the ranks that counted
(all-reduced with the sync).

Memory (``offload=True``, the default): the snapshot and the outer momentum of CUDA parameters
live in pinned CPU memory; the flat payload (the pseudo-gradient) exists only while its fragment
syncs.

Streaming (``fragments=F``, Douillard et al., "Streaming DiLoCo with overlapping communication",
2025): the trainable tensors are cut into F fragments of about equal bytes, contiguous in
parameter order (``assign_fragments``), each bucketed on its own. Fragment f is synced after the
steps ``W + (f+1) * K/F + n*K`` (K a multiple of F), so a sync carries 1/F of the model and the
last fragment keeps the unfragmented schedule (``W + K``, ``W + 2K``, ...); the bytes per step
are unchanged. Each fragment has its own snapshot (its parameters at its last sync) and its own
outer momentum: the outer optimizer steps only the snapshots given a pseudo-gradient. Buffers
travel with the last fragment. ``finish()`` syncs every fragment stepped since its last sync.
``F=1`` is the unfragmented sync, bit for bit.

Overlapped (``sync_delay=tau``, ``mixing=alpha``; Streaming DiLoCo's overlap, torchft's
``fragment_sync_delay`` and ``fragment_update_alpha``): a sync's collectives are all launched at
its step and the result is applied tau steps later, each parameter becoming
``alpha * local + (1 - alpha) * synced``; tau < K/F keeps one sync in flight at a time.

The package, one concept a module: ``local_sgd`` (``LocalSGD``, which a loop steps: each sync and
its outcome), ``schedule`` (when each fragment syncs, the adaptive rule), ``outer`` (what is kept
between syncs: the snapshots and the outer optimizer), ``transport`` (the buckets on the wire
and the one reduction over them, with error feedback) and ``wire`` (the formats of ``sync_dtype``).
"""

from lit_dp.local_sgd.local_sgd import LocalSGD
from lit_dp.local_sgd.schedule import ADAPTIVE_MAX_LOCAL_STEPS, ADAPTIVE_MIN_LOCAL_STEPS

__all__ = ["ADAPTIVE_MAX_LOCAL_STEPS", "ADAPTIVE_MIN_LOCAL_STEPS", "LocalSGD"]
