"""Streaming DiLoCo's overlapped syncs on a simulated slow link: exposed sync time and accuracy per delay.

    python -m benchmarks.local_sgd_overlap
    python -m benchmarks.local_sgd_overlap link_mbit=100 delays=[0,1,2,3]

Every mode trains the same 3 x 1024 MLP (``benchmarks.common.digits_mlp``, 8.3 MB) with Adam on
the same digits shards in the same 2 gloo processes, with DiLoCo in ``fragments`` fragments every
``local_steps`` steps (``lit_dp.LocalSGD(outer="nesterov")``), one mode per ``sync_delay`` in
``delays`` (tau: a fragment's sync is applied tau steps after it starts), all with ``mixing``.

The slow link is the benchmark's own: LocalSGD's collectives are handed to gloo as usual, and
each one is reported complete no sooner than the link, shared by all of them in turn, would
have carried its bytes at ``link_mbit`` Mbit/s (a ring all-reduce's ``2(n-1)/n`` of the payload
per rank; a wire format's all-to-all and all-gather ``(n-1)/n`` of theirs each); a wait before
that sleeps. (``SlowSyncLink(gradients=True)`` puts the reducer's gradient all-reduces on the
same link, for ``benchmarks.forecast``.) So the sync's time in flight is set by the bandwidth, and
what the delay hides of it is what the inner steps in between take. Reported per mode: the sync
time exposed per local step (``LocalSGD.traffic``: the wait when a sync is applied, and applying
it), the mean step time, and the final model's validation loss and accuracy.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import benchmark_main, digits_mlp, init_gloo_rank, run_ranks
from lit_dp_recipes.digits import DigitsDataModule


@dataclass
class OverlapBenchmarkConfig:
    """What to measure."""

    world_size: int = 2
    local_steps: int = 8
    fragments: int = 2
    delays: tuple[int, ...] = (0, 1, 2)
    mixing: float = 0.0
    link_mbit: float = 200.0
    epochs: int = 4
    batch_size: int = 32  # per rank
    lr: float = 1e-3
    threads_per_rank: int = 1


class _SlowWork:
    """A collective's work, complete no sooner than ``ready`` (``time.monotonic``).

    What lit_dp asks of a work, as torch's own: ``is_completed``, ``wait()`` and ``wait(timeout)``
    (the hang watchdog's bounded slices, a ``RuntimeError`` when one runs out first), and a future
    (the reducer's observers time a bucket by it) that completes when the link has carried it.
    """

    def __init__(self, work: dist.Work, ready: float) -> None:
        self._work, self._ready = work, ready
        self._future: torch.futures.Future | None = None

    def is_completed(self) -> bool:
        return time.monotonic() >= self._ready and self._work.is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        remaining = self._ready - time.monotonic()
        if timeout is not None and timeout.total_seconds() > 0 and remaining > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("the simulated link is still carrying this collective (wait timed out)")
        time.sleep(max(0.0, remaining))
        return self._work.wait() if timeout is None else self._work.wait(timeout)

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = _CarriedFuture(self._work.get_future(), self._ready)
        return self._future


class _CarriedFuture(torch.futures.Future):
    """A collective's future, complete when the link has carried it (``time.monotonic() >= ready``)
    and the collective is done.

    Looking at it (``done()``, what the reducer's observers do on CPU) reads the clock on the
    looking thread; only a callback (``then``, ``add_done_callback``) starts a timer that completes
    it. A future of a real link runs no Python on another thread, and one that did (a callback on
    Gloo's thread per bucket, a timer thread per bucket) would take the interpreter from the
    training thread during backward: a cost of the simulation, not of the link.
    """

    def __init__(self, collective: torch.futures.Future, ready: float) -> None:
        super().__init__()
        self._collective, self._ready = collective, ready
        self._lock = threading.Lock()
        self._timer_set = False

    def _complete(self) -> None:
        with self._lock:
            if super().done():
                return
            try:
                value = self._collective.value()
            except Exception as error:  # noqa: BLE001 - the collective's own failure, passed on
                self.set_exception(error)
                return
            self.set_result(value)

    def done(self) -> bool:
        if not super().done() and time.monotonic() >= self._ready and self._collective.done():
            self._complete()
        return super().done()

    def wait(self) -> Any:
        time.sleep(max(0.0, self._ready - time.monotonic()))
        self._collective.wait()
        self._complete()
        return super().wait()

    def value(self) -> Any:
        self.done()
        return super().value()

    def then(self, callback: Any) -> torch.futures.Future:
        self._set_timer()
        return super().then(callback)

    def add_done_callback(self, callback: Any) -> None:
        self._set_timer()
        super().add_done_callback(callback)

    def _set_timer(self) -> None:
        with self._lock:
            if self._timer_set:
                return
            self._timer_set = True

        def carried(_: torch.futures.Future) -> None:
            threading.Timer(max(0.0, self._ready - time.monotonic()), self._complete).start()

        self._collective.add_done_callback(carried)


class SlowLink:
    """``torch.distributed`` as ``lit_dp.local_sgd.transport`` (and, with ``SlowSyncLink(gradients=True)``, the
    reducer's dense buckets) sees it, its collectives carried by one link in turn: each takes the link's
    latency per hop of a ring (``latency_s``) and its bytes at ``mbit``, and is complete no sooner than
    that after it started, nor before the real collective (on this machine's loopback) is."""

    def __init__(self, mbit: float, world_size: int, latency_s: float = 0.0) -> None:
        self._bytes_per_second = mbit * 1e6 / 8
        self._latency_s = latency_s
        self._ranks = world_size
        self._others = (world_size - 1) / world_size  # of a tensor an all-to-all or all-gather moves per rank
        self._free_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _slowed(self, work: dist.Work, tensor: torch.Tensor, share: float, rounds: int) -> _SlowWork:
        """``rounds``: the ring's passes around the ranks (an all-reduce's two), each ``ranks - 1`` hops."""
        start = max(time.monotonic(), self._free_at)
        hops = rounds * (self._ranks - 1)
        carried = tensor.numel() * tensor.element_size() * share / self._bytes_per_second
        self._free_at = start + hops * self._latency_s + carried
        return _SlowWork(work, self._free_at)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> _SlowWork:
        # A ring all-reduce: a reduce-scatter and an all-gather, (n-1)/n of the payload each.
        return self._slowed(dist.all_reduce(tensor, *args, **kwargs), tensor, 2 * self._others, 2)

    def broadcast(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> _SlowWork:
        return self._slowed(dist.broadcast(tensor, *args, **kwargs), tensor, 2 * self._others, 2)

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> _SlowWork:
        return self._slowed(dist.all_to_all_single(output, tensor, *args, **kwargs), tensor, self._others, 1)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> _SlowWork:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as the transport picks it
        return self._slowed(gather(output, tensor, *args, **kwargs), output, self._others, 1)

    all_gather_single = all_gather_into_tensor


class SlowSyncLink(pl.Callback):
    """A recipe's LocalSGD syncs carried by a ``SlowLink`` of ``mbit`` Mbit/s in every rank, from setup to
    teardown, for ``benchmarks.local_sgd_overlap_gpt``; with ``gradients=True`` the reducer's gradient
    all-reduces too (its dense buckets' and their in-place members'), on the same link, and with
    ``latency_us`` a latency per hop (``benchmarks.forecast``):

        python recipes/gpt.py ... +callbacks.slow_link._target_=benchmarks.local_sgd_overlap.SlowSyncLink
        python recipes/gpt.py ... +callbacks.slow_link._target_=benchmarks.local_sgd_overlap.SlowSyncLink +callbacks.slow_link.gradients=true

    Only these collectives are slowed; the Trainer's others (checkpoints, validation metrics, the
    buffer broadcast), a communication hook's and sharding's are not."""

    def __init__(self, mbit: float = 100.0, gradients: bool = False, latency_us: float = 0.0) -> None:
        if not mbit > 0:
            raise ValueError(f"SlowSyncLink(mbit={mbit!r}) is invalid: expected a bandwidth in Mbit/s above 0.")
        if not latency_us >= 0:
            raise ValueError(f"SlowSyncLink(latency_us={latency_us!r}) is invalid: expected microseconds per hop, 0 or more.")
        self.mbit = mbit
        self.gradients = gradients
        self.latency_us = latency_us
        self._real: list[tuple[Any, Any]] = []  # (module, its own dist) while slowed

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import lit_dp.gradients.dense
        import lit_dp.local_sgd.transport

        link = SlowLink(self.mbit, trainer.world_size, self.latency_us * 1e-6)
        modules = [lit_dp.local_sgd.transport] + ([lit_dp.gradients.dense] if self.gradients else [])
        for module in modules:
            self._real.append((module, module.dist))
            module.dist = link

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        while self._real:
            module, real = self._real.pop()
            module.dist = real


def _train(delay: int, config: OverlapBenchmarkConfig, data: DigitsDataModule, rank: int) -> dict[str, Any]:
    import lit_dp
    import lit_dp.local_sgd.transport

    torch.manual_seed(0)
    model = lit_dp.DataParallel(digits_mlp())
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    local_sgd = lit_dp.LocalSGD(
        model, config.local_steps, outer="nesterov", fragments=config.fragments, sync_delay=delay, mixing=config.mixing
    )
    images, labels = data.train_set.tensors
    images, labels = images[rank :: config.world_size], labels[rank :: config.world_size]
    times = []
    real_dist, lit_dp.local_sgd.transport.dist = lit_dp.local_sgd.transport.dist, SlowLink(config.link_mbit, config.world_size)
    try:
        for epoch in range(config.epochs):
            order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
            for start in range(0, len(order) - config.batch_size + 1, config.batch_size):
                batch = order[start : start + config.batch_size]
                began = time.perf_counter()
                F.cross_entropy(model(images[batch]), labels[batch]).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                local_sgd.step()
                times.append(time.perf_counter() - began)
        traffic = local_sgd.traffic()  # before finish(): the run's own syncs
        local_sgd.finish()
    finally:
        lit_dp.local_sgd.transport.dist = real_dist
    val_images, val_labels = data.val_set.tensors
    with torch.no_grad():
        logits = model(val_images)
    return {
        "exposed_ms_per_step": traffic["exposed_ms"] * traffic["syncs"] / len(times),
        "time_ms": traffic["time_ms"],
        "step_ms": statistics.fmean(times) * 1e3,
        "val_loss": F.cross_entropy(logits, val_labels).item(),
        "accuracy": (logits.argmax(dim=1) == val_labels).float().mean().item(),
    }


def _worker(rank: int, config: OverlapBenchmarkConfig, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(config.threads_per_rank)
    init_gloo_rank(rank, config.world_size, port)
    data = DigitsDataModule()
    data.setup()
    rows = {delay: _train(delay, config, data, rank) for delay in config.delays}
    if rank == 0:
        results.update(rows)
    lit_dp.destroy_parallel_env()


def run_and_report(config: OverlapBenchmarkConfig) -> str:
    results = run_ranks(_worker, config.world_size, config)
    lines = [
        f"DiLoCo K={config.local_steps}, F={config.fragments}, mixing={config.mixing}, {config.world_size} gloo ranks, "
        f"a {config.link_mbit:g} Mbit/s link for the syncs; rank 0's figures",
        "",
        "| sync_delay | exposed sync ms per step | sync in flight (ms, mean) | mean step (ms) | val loss | val accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for delay, row in sorted(results.items()):
        lines.append(
            f"| {delay} | {row['exposed_ms_per_step']:.2f} | {row['time_ms']:.1f} | {row['step_ms']:.1f} "
            f"| {row['val_loss']:.4f} | {row['accuracy']:.4f} |"
        )
    return "\n".join(lines)


main = benchmark_main("local_sgd_overlap", OverlapBenchmarkConfig, run_and_report)

if __name__ == "__main__":
    main()
