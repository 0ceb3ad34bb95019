"""LocalSGD on real gloo processes against a single-process simulation of its rule.

The simulation (``simulate``) steps one model per rank on that rank's shard, averages
gradients during warm-up, averages the models after every K-th local step and once at the end.
Tolerances: torch.testing.assert_close's fp32 defaults. Averaging through snapshot deltas (and
the reducer's bucketed gradient average) only reorders floating-point sums, which those
defaults cover; a missed or extra average, or a synchronised local step, is off by O(lr).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dp import Options, PaddleDPStrategy
from lit_dp.options import LocalSGDOptions
from lit_dp_recipes.config import build_strategy
from tests.helpers.distributed import run_ranks
from tests.helpers.lightning import trainer as lightning_trainer
from tests.helpers.recipes import compose_config

FEATURES = 6
# A micro-batch per rank: (inputs, targets).
Batch = tuple[torch.Tensor, torch.Tensor]


class Net(nn.Module):
    """BatchNorm's float statistics are averaged; ``seen`` is an integer buffer that differs per rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(FEATURES, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += (x[:, 0] > 0).sum()
        # BatchNorm after the nonlinearity: before it, the stem bias would get a gradient of rounding
        # noise only, which Adam scales up to a step of size lr.
        return self.head(self.norm(torch.tanh(self.stem(x))))


def mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return ((model(inputs) - targets) ** 2).mean()


def adaptive_period(k0: int, loss_0: float, lr_0: float, loss: float, lr: float) -> int:
    """Paddle's AdaptiveLocalSGDOptimizer rule, written out independently of lit_dp.local_sgd."""
    return min(max(math.ceil(math.sqrt(lr_0 * loss / (lr * loss_0) * k0)), 1), 16)


def simulate(
    model: nn.Module,
    make_optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]],
    steps: Sequence[tuple[int, Sequence[Sequence[Batch]]]],
    local_steps: int,
    warmup_steps: int,
    adaptive: bool = False,
    reset_after: int | None = None,
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor] = mse,
    outer: tuple[float, float] | None = None,
    wire: torch.dtype | None = None,
    fragments: list[list[str]] | None = None,
) -> list[nn.Module]:
    """The rule on one process: ``steps[i] = (optimizer index, [rank][micro-batch])``; returns each rank's model.

    Buffers follow DataParallel's defaults: rank 0's before each forward that follows a
    data-parallel step (``broadcast_buffers``), averaged with the parameters after.

    ``reset_after=n``: after step n every rank takes rank 0's model and optimizer state, as a
    run resumed from a checkpoint written by rank 0 after step n does.

    ``outer=(lr, momentum)``: DiLoCo (``outer="nesterov"``) instead of the mean; ``wire``: the deltas
    are summed in that dtype (``sync_dtype``).

    ``fragments``: streaming DiLoCo, the parameter names of each fragment; fragment f is synced after
    the steps ``W + (f+1) * K/F + n*K`` and at the end, the buffers with the last fragment.
    """
    world_size = len(steps[0][1])
    models = [copy.deepcopy(model) for _ in range(world_size)]
    optimizers = [make_optimizers(m) for m in models]
    groups: list[list[str] | None] = list(fragments) if fragments is not None else [None]
    count = len(groups)
    last_syncs = [warmup_steps - local_steps + (f + 1) * local_steps // count for f in range(count)]
    period, first = local_steps, None
    synced_by_outer = outer is not None or wire is not None
    outer_state = OuterState(models[0], outer, wire) if warmup_steps == 0 and synced_by_outer else None

    def average(models: list[nn.Module], fragment: int) -> None:
        names, buffers = groups[fragment], fragment == count - 1
        if outer_state is None:
            average_models(models, names, buffers)
        else:
            outer_state.sync(models, names, buffers)

    for number, (which, micro_batches) in enumerate(steps, start=1):
        if 1 < number <= warmup_steps + 1:
            # DataParallel's broadcast_buffers (as DDP's): a forward after a synchronised step
            # starts from rank 0's buffers.
            for rank_model in models[1:]:
                for mine, rank0 in zip(rank_model.buffers(), models[0].buffers()):
                    mine.copy_(rank0)
        losses = []
        for rank_model, rank_batches in zip(models, micro_batches):
            for micro in rank_batches:
                loss = loss_fn(rank_model, micro) / len(rank_batches)
                loss.backward()
            losses.append(loss.item() * len(rank_batches))
        lr = optimizers[0][which].param_groups[0]["lr"]
        if adaptive and first is None:
            first = (sum(losses) / world_size, lr)
        if number <= warmup_steps:  # data parallel: every rank steps on the mean gradient
            for params in zip(*(m.parameters() for m in models)):
                mean = torch.stack([p.grad for p in params]).mean(dim=0)
                for p in params:
                    p.grad = mean.clone()
        for rank_optimizers in optimizers:
            rank_optimizers[which].step()
            rank_optimizers[which].zero_grad(set_to_none=True)
        if number == warmup_steps and synced_by_outer:
            outer_state = OuterState(models[0], outer, wire)  # the local phase starts: every rank holds these
        due = [f for f, last in enumerate(last_syncs) if number > warmup_steps and number - last == period]
        if due:
            average(models, due[0])
            last_syncs[due[0]] = number
            if adaptive:
                period = adaptive_period(local_steps, first[0], first[1], sum(losses) / world_size, lr)
        if number == reset_after:
            for rank in range(1, world_size):
                models[rank].load_state_dict(models[0].state_dict())
                for mine, rank0 in zip(optimizers[rank], optimizers[0]):
                    mine.load_state_dict(rank0.state_dict())
    for fragment, last in enumerate(last_syncs):
        if len(steps) > max(last, warmup_steps):
            average(models, fragment)
    return models


class OuterState:
    """The snapshot of the last sync and the outer momentum, per parameter; ``outer=None``: averaging."""

    def __init__(self, model: nn.Module, outer: tuple[float, float] | None, wire: torch.dtype | None) -> None:
        self.outer, self.wire = outer, wire
        self.snapshot = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.momentum: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def sync(self, models: list[nn.Module], names: list[str] | None = None, buffers: bool = True) -> None:
        """Parameters ``names`` (None: all), and the buffers as averaging treats them if ``buffers``."""
        average_models(models, [], buffers)
        for name, snapshot in self.snapshot.items():
            if names is not None and name not in names:
                continue
            params = [dict(m.named_parameters())[name] for m in models]
            deltas = [snapshot - p for p in params]
            if self.wire is not None:
                deltas = [d.to(self.wire) for d in deltas]
            total = deltas[0]
            for d in deltas[1:]:
                total = total + d
            mean = total.to(snapshot.dtype) / len(models)
            if self.outer is None:
                snapshot -= mean
            else:  # torch.optim.SGD(nesterov=True): the buffer starts at the first gradient
                lr, mu = self.outer
                buffer = self.momentum[name] = self.momentum[name] * mu + mean if name in self.momentum else mean.clone()
                snapshot -= lr * (mean + mu * buffer)
            for p in params:
                p.copy_(snapshot)


@torch.no_grad()
def average_models(models: list[nn.Module], names: list[str] | None = None, buffers: bool = True) -> None:
    """Parameters (only ``names`` unless None) and float buffers: the mean; other buffers: rank 0's
    (``buffers=False``: the buffers are left as they are)."""
    states = [m.state_dict() for m in models]
    parameters = {name for name, _ in models[0].named_parameters()}
    for name, value in states[0].items():
        if name in parameters and names is not None and name not in names:
            continue
        if name not in parameters and not buffers:
            continue
        result = torch.stack([s[name] for s in states]).mean(dim=0) if value.is_floating_point() else value.clone()
        for state in states:
            state[name].copy_(result)


def random_steps(count: int, world_size: int, seed: int = 0, per_rank: int = 4) -> list[tuple[int, list[list[Batch]]]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (0, [[(torch.randn(per_rank, FEATURES, generator=generator), torch.randn(per_rank, 3, generator=generator))] for _ in range(world_size)])
        for _ in range(count)
    ]


OPTIMIZERS = {
    "sgd": lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)],
    "adam": lambda m: [torch.optim.Adam(m.parameters(), lr=0.01)],
    "momentum": lambda m: [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)],
}


def assert_same_state(model: nn.Module, reference: nn.Module, label: str) -> None:
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, msg=lambda m: f"{label}: {name}: {m}")


def library_cases(rank: int, cases: list[tuple]) -> list[tuple[int, list[int]]]:
    """``lit_dp.LocalSGD`` driven by hand, one case after another in the same process group."""
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    averages = []
    for optimizer_name, local_steps, warmup_steps, adaptive, comm_mb, count in cases:
        label = f"{optimizer_name} K={local_steps} W={warmup_steps} adaptive={adaptive} rank {rank}"
        steps = random_steps(count, world_size, seed=local_steps)
        base = Net()
        if rank > 0:  # DataParallel's construction must broadcast rank 0's parameters
            with torch.no_grad():
                base.stem.weight.add_(1.0)
        model = lit_dp.DataParallel(base, comm_buffer_size=comm_mb, last_comm_buffer_size=comm_mb)
        (optimizer,) = OPTIMIZERS[optimizer_name](model)
        local_sgd = lit_dp.LocalSGD(model, local_steps, warmup_steps, adaptive=adaptive, comm_buffer_size=comm_mb)
        count_averages, periods = 0, {local_steps}
        for _, micro_batches in steps:
            loss = mse(model, micro_batches[rank][0])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            count_averages += local_sgd.step(loss.detach(), optimizer.param_groups[0]["lr"])
            periods.add(local_sgd.local_steps)
        local_sgd.finish()
        expected = simulate(Net(), OPTIMIZERS[optimizer_name], steps, local_steps, warmup_steps, adaptive=adaptive)
        assert_same_state(model.module, expected[rank], label)
        if local_steps == 1 and optimizer_name == "sgd" and warmup_steps == 0:
            # K=1 with plain SGD is data parallelism: the same parameters as DataParallel alone.
            plain = lit_dp.DataParallel(Net())
            plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
            for _, micro_batches in steps:
                mse(plain, micro_batches[rank][0]).backward()
                plain_optimizer.step()
                plain_optimizer.zero_grad(set_to_none=True)
            for (name, ours), theirs in zip(model.module.named_parameters(), plain.module.parameters()):
                torch.testing.assert_close(ours, theirs, msg=lambda m: f"{label} vs DataParallel: {name}: {m}")
        averages.append((count_averages, sorted(periods)))
    return averages


LIBRARY_CASES = [
    # (optimizer, K, W, adaptive, comm_buffer_size MB, steps)
    ("sgd", 1, 0, False, 25, 6),
    ("sgd", 4, 5, False, 25, 16),
    ("sgd", 3, 5, False, 64 / 2**20, 16),  # 64-byte buckets: one per tensor, spread over the rings
    ("adam", 4, 5, False, 25, 16),
    ("adam", 3, 5, False, 64 / 2**20, 16),
    ("momentum", 4, 3, True, 25, 20),
]


@pytest.mark.slow
def test_library_matches_the_simulation_per_rank():
    results = run_ranks(library_cases, 2, LIBRARY_CASES, timeout=180, FLAGS_nccl_nrings="2")
    assert results[0] == results[1]
    # Averages during the run (finish() excluded): K=1 every step; W=5, 11 local steps: K=4 -> 2, K=3 -> 3.
    assert [count for count, _ in results[0][:5]] == [6, 2, 3, 2, 3]
    adaptive_periods = results[0][5][1]
    assert len(adaptive_periods) > 1, f"the adaptive period never changed: {adaptive_periods}"


class Regressor(pl.LightningModule):
    """Two optimizers under manual optimization, each step with its own forward and backward."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return regression_loss(self.net, batch)
        for optimizer in self.optimizers():
            self.manual_backward(regression_loss(self.net, batch))
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        if self.automatic_optimization:
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.Adam(self.net[2].parameters(), lr=0.01)]

    def train_dataloader(self):
        x, y = regression_data()  # this rank's shard, as the simulation takes it
        return DataLoader(TensorDataset(x[self.global_rank :: 2], y[self.global_rank :: 2]), batch_size=4)


def regression_loss(net: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return ((net(x) - y) ** 2).mean()


def regression_data() -> Batch:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, FEATURES, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def lightning_steps(epochs: int, accumulate: int = 1, optimizers: int = 1) -> list[tuple[int, list[list[Batch]]]]:
    """The optimizer steps of a 2-rank fit: rank r trains on samples r, r+2, ... in order."""
    x, y = regression_data()
    shards = [(x[r::2], y[r::2]) for r in range(2)]
    batches = [[(xs[i : i + 4], ys[i : i + 4]) for i in range(0, len(xs), 4)] for xs, ys in shards]
    steps = []
    for _ in range(epochs):
        for start in range(0, len(batches[0]), accumulate):
            micro = [rank_batches[start : start + accumulate] for rank_batches in batches]
            steps += [(which, micro) for which in range(optimizers)]
    return steps


class RecordSchedule(Callback):
    def __init__(self) -> None:
        self.schedule: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        local_sgd = trainer.strategy.local_sgd  # (steps so far, step of the last average)
        self.schedule.append((local_sgd.step_count, local_sgd.last_average))


def fit(tmp_path, epochs, module=None, ckpt_path=None, callbacks=(), accumulate_grad_batches=1, **strategy_options):
    module = module or Regressor()
    record = RecordSchedule()
    trainer = pl.Trainer(
        strategy=PaddleDPStrategy(**strategy_options),
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        use_distributed_sampler=False,
        accumulate_grad_batches=accumulate_grad_batches,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=[record, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, record.schedule


def lightning_cases(rank: int, tmp_path: str) -> list[tuple[int, int]]:
    """Automatic with accumulation, manual with two optimizers, and a resume from mid-period."""

    def check(module: Regressor, expected: list[nn.Module], label: str) -> None:
        for (name, ours), theirs in zip(module.net.named_parameters(), expected[rank].parameters()):
            torch.testing.assert_close(ours, theirs, msg=lambda m: f"{label} rank {rank}: {name}: {m}")

    def net_optimizer(net: nn.Module) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(net.parameters(), lr=0.1)]

    def two_optimizers(net: nn.Module) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.Adam(net[2].parameters(), lr=0.01)]

    net = Regressor().net
    # 4 batches per rank and epoch, accumulated in pairs: 2 optimizer steps per epoch. Adaptive:
    # Lightning hands the strategy the last micro-batch's loss divided by 2, the simulation the
    # undivided one; the rule only uses loss ratios.
    module, schedule = fit(
        f"{tmp_path}/accumulate", 5, accumulate_grad_batches=2, model_averaging_period=3, local_sgd_warmup_steps=1,
        local_sgd_adaptive=True,
    )
    steps = lightning_steps(5, accumulate=2)
    check(module, simulate(net, net_optimizer, steps, 3, 1, adaptive=True, loss_fn=regression_loss), "accumulate")
    assert schedule[-1][0] == 10, f"10 optimizer steps expected, the averager counted {schedule[-1][0]}"

    module, _ = fit(f"{tmp_path}/manual", 3, Regressor(manual=True), local_sgd_steps=3, local_sgd_warmup_steps=3)
    check(module, simulate(net, two_optimizers, lightning_steps(3, optimizers=2), 3, 3, loss_fn=regression_loss), "manual")

    # 4 steps per epoch, W=1, K=3: averages after steps 4, 7, 10, ...; the checkpoint after step 8 is mid-period.
    options = dict(local_sgd_steps=3, local_sgd_warmup_steps=1)
    module, uninterrupted = fit(f"{tmp_path}/a", 4, **options)
    check(module, simulate(net, net_optimizer, lightning_steps(4), 3, 1, loss_fn=regression_loss), "uninterrupted")
    checkpoints = ModelCheckpoint(dirpath=f"{tmp_path}/ckpt", save_last=True)
    fit(f"{tmp_path}/b", 2, callbacks=[checkpoints], **options)
    resumed_module, resumed = fit(f"{tmp_path}/c", 4, ckpt_path=f"{tmp_path}/ckpt/last.ckpt", **options)
    assert resumed == uninterrupted[8:], f"rank {rank}: resumed schedule {resumed} != {uninterrupted[8:]}"
    assert_same_weights(resumed_module, module, f"rank {rank}: resumed between two averages")

    # A checkpoint without every rank's state (written before lit_dp kept them): every rank resumes
    # from rank 0's, with a warning on rank 0.
    checkpoint = torch.load(f"{tmp_path}/ckpt/last.ckpt", weights_only=False)
    del checkpoint["lit_dp"]["local_sgd"]["replicas"]
    torch.save(checkpoint, f"{tmp_path}/old{rank}.ckpt")  # each rank its own copy: no rank waits for another's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module, _ = fit(f"{tmp_path}/d", 4, ckpt_path=f"{tmp_path}/old{rank}.ckpt", **options)
    expected = simulate(net, net_optimizer, lightning_steps(4), 3, 1, reset_after=8, loss_fn=regression_loss)
    check(module, expected, "resumed from an old checkpoint")
    warned = any("every rank resumes from rank 0's" in str(w.message) for w in caught)
    assert warned == (rank == 0), f"rank {rank}: {[str(w.message) for w in caught]}"
    return resumed


def assert_same_weights(module: nn.Module, reference: nn.Module, label: str) -> None:
    """Bit for bit: a resumed run replays exactly the uninterrupted run's operations on the same values."""
    for (name, ours), theirs in zip(module.named_parameters(), reference.parameters()):
        assert torch.equal(ours, theirs), f"{label}: {name} differs from the uninterrupted run's by {(ours - theirs).abs().max()}"


@pytest.mark.slow
def test_lightning_strategy_matches_the_simulation_and_resumes_on_schedule(tmp_path):
    results = run_ranks(lightning_cases, 2, str(tmp_path), timeout=240)
    assert results[0] == results[1]
    assert results[0][0] == (9, 7) and results[0][-1] == (16, 16)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(local_sgd_steps=0), "local_sgd_steps=0 is invalid: expected an integer >= 1"),
        (dict(model_averaging_period=-2), "model_averaging_period=-2 is invalid"),
        (dict(local_sgd_steps=4, local_sgd_warmup_steps=-1), "local_sgd_warmup_steps=-1 is invalid: expected an integer >= 0"),
        (dict(local_sgd_steps=4, model_averaging_period=8), "local_sgd_steps=4 and model_averaging_period=8 are the same option"),
        (dict(local_sgd_adaptive=True), "local_sgd_adaptive=True needs local_sgd_steps"),
        (dict(local_sgd_steps=2.5), "local_sgd_steps=2.5 is invalid"),
    ],
)
def test_strategy_rejects_bad_options_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        PaddleDPStrategy(**options)


def test_hydra_options_reach_the_strategy(tmp_path):
    cfg = compose_config("digits", ["experiment=local_sgd", "strategy.local_sgd.adaptive=true"], tmp_path)
    options = build_strategy(cfg.strategy).options
    assert options.local_sgd == LocalSGDOptions(steps=4, warmup_steps=20, adaptive=True)


def test_a_comm_hook_that_already_skips_communication_is_rejected():
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import post_localSGD_hook

    with pytest.raises(ValueError, match="local_sgd_steps=4 with comm_hook='post_localSGD_hook' is invalid"):
        Options.build(dict(local_sgd_steps=4, comm_hook=post_localSGD_hook), "trainer")
    with pytest.raises(ValueError, match="strategy.model_averaging_period=2 with strategy.comm_hook='noop_hook' is invalid"):
        Options.build(dict(model_averaging_period=2, comm_hook=noop_hook), "trainer", prefix="strategy.")
    assert Options.build(dict(local_sgd_steps=4, comm_hook=allreduce_hook), "trainer").local_sgd.steps == 4
    assert Options.build(dict(local_sgd_steps=4, comm_hook="fp16"), "trainer").local_sgd.steps == 4
    assert Options.build(dict(comm_hook=noop_hook), "trainer").local_sgd.steps is None  # the hook alone is fine


def test_library_rejects_bad_arguments_by_name():
    import lit_dp

    for kwargs, message in (
        (dict(local_steps=0), "local_steps=0 is invalid"),
        (dict(local_steps=2, warmup_steps=-1), "warmup_steps=-1 is invalid"),
        (dict(local_steps=2, min_local_steps=4, max_local_steps=2), "min_local_steps=4, max_local_steps=2"),
    ):
        with pytest.raises(ValueError, match=message):
            lit_dp.LocalSGD(nn.Linear(2, 2), **kwargs)


def test_the_model_is_told_its_phase_and_the_old_names_warn_and_still_work():
    """LocalSGD tells its model the phase as its schedule moves (the model reads nothing of it);
    ``DataParallel.local_sgd`` and ``use_local_sgd``, documented before, are deprecated, naming
    their replacements."""
    import lit_dp
    from tests.helpers.groups import one_rank_group

    one_rank_group()
    model = lit_dp.DataParallel(nn.Linear(4, 2))
    averager = lit_dp.LocalSGD(model, local_steps=2, warmup_steps=1)
    assert model._syncs_gradients()  # warm-up: gradients synchronised
    averager.step()
    assert not model._syncs_gradients()  # the local phase: kept local, as the model was told
    averager.load_state_dict({"step": 0, "last_average": 1, "local_steps": 2})
    assert model._syncs_gradients()  # a schedule loaded back into its warm-up: synchronised again
    with pytest.warns(DeprecationWarning, match=r"DataParallel.local_sgd is deprecated.*join_state.local_sgd"):
        assert model.local_sgd is averager
    other = lit_dp.DataParallel(nn.Linear(4, 2))
    with pytest.warns(DeprecationWarning, match=r"DataParallel.use_local_sgd is deprecated.*keep_gradients_local"):
        other.use_local_sgd(averager)
    assert other.join_state.local_sgd is averager


def test_a_run_resumed_with_a_smaller_period_syncs_at_its_first_step_past_it():
    """Saved 6 steps after the last average with K=8, resumed with K=4: the next step is overdue and
    averages (it used to wait for a step exactly K after the last average, which never came)."""
    import lit_dp

    saved = lit_dp.LocalSGD(nn.Linear(4, 2), local_steps=8)
    assert not any(saved.step() for _ in range(6))
    resumed = lit_dp.LocalSGD(nn.Linear(4, 2), local_steps=4)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.step(), "step 7 is 7 steps after the last average: overdue with K=4"
    assert [resumed.step() for _ in range(4)] == [False, False, False, True]  # then every 4 steps


class UnevenRegressor(pl.LightningModule):
    """Rank ``rank``'s own ``count`` batches of 4 samples (``uneven_inputs``: ranks run out at different steps)."""

    def __init__(self, rank: int, count: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        self.rank, self.count = rank, count

    def training_step(self, batch, batch_idx):
        return regression_loss(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(uneven_batches(self.rank, self.count), batch_size=None)


def uneven_batches(rank: int, count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, FEATURES, generator=generator) for _ in range(count)]
    return [(x, x.sum(dim=1, keepdim=True).sin()) for x in xs]


def uneven_case(rank: int, tmp_path: str, counts: list[int]) -> list[list[float]]:
    module = UnevenRegressor(rank, counts[rank])
    trainer = lightning_trainer(
        PaddleDPStrategy(uneven_inputs=True, local_sgd_steps=2), tmp_path, max_epochs=1, use_distributed_sampler=False
    )
    trainer.fit(module)
    return [p.detach().flatten().tolist() for p in module.net.parameters()]


def uneven_reference(counts: list[int], period: int) -> list[torch.Tensor]:
    """One process: each rank steps while it has batches; every ``period`` steps, and at the end, the ranks
    that took a step since the last average average their models, which every rank then takes."""
    models = [UnevenRegressor(rank, count).net for rank, count in enumerate(counts)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    batches = [uneven_batches(rank, count) for rank, count in enumerate(counts)]
    trained = [False] * len(counts)

    @torch.no_grad()
    def average() -> None:
        for params in zip(*(m.parameters() for m in models)):
            mean = torch.stack([p for p, counted in zip(params, trained) if counted]).mean(dim=0)
            for p in params:
                p.copy_(mean)
        trained[:] = [False] * len(counts)

    for step in range(1, max(counts) + 1):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            if step <= counts[rank]:
                regression_loss(model, batches[rank][step - 1]).backward()
                optimizer.step()
                optimizer.zero_grad()
                trained[rank] = True
        if step % period == 0:
            average()
    if max(counts) % period:
        average()
    return [p.detach().flatten() for p in models[0].parameters()]


@pytest.mark.slow
def test_under_uneven_inputs_a_rank_that_ran_out_counts_only_with_its_own_work(tmp_path):
    # Rank 0 has 3 batches, rank 1 has 7; K=2: the average after step 4 still counts rank 0's step 3,
    # the one after 6 and the final one after 7 count rank 1 alone.
    counts = [3, 7]
    results = run_ranks(uneven_case, 2, str(tmp_path), counts, timeout=180)
    expected = uneven_reference(counts, 2)
    for rank, flat in results.items():
        for ours, theirs in zip(flat, expected):
            torch.testing.assert_close(torch.tensor(ours), theirs, msg=lambda m: f"rank {rank}: {m}")
