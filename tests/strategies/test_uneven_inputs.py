"""``PaddleDPStrategy(uneven_inputs=True)``: ranks with different numbers of batches finish together.

Each rank is its own process started through Paddle's launcher variables, so it can be given
its own data: an ``IterableDataset`` per rank, or a map-style dataset without the distributed
sampler. The oracle is one process running the same schedule: at batch t the ranks that have a
batch contribute their loss, divided by the world size, and the optimizer steps as Lightning
does (every ``accumulate_grad_batches`` and at the last batch). Tolerance: ``assert_close``'s
defaults; sums are only reordered.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lit_dp import PaddleDPStrategy
from lit_dp.options import Options
from tests.helpers.distributed import launch_forking, run_ranks
from tests.helpers.lightning import trainer

WORLD = 2


def shard_batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + index)
    x = torch.randn(4, 6, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


class Shard(IterableDataset):
    """Rank ``rank``'s own stream of ``count`` batches (no length: the common uneven case)."""

    def __init__(self, rank: int, count: int, offset: int = 0) -> None:
        self.rank, self.count, self.offset = rank, count, offset

    def __iter__(self):
        return (shard_batch(self.rank, self.offset + i) for i in range(self.count))


class SizedShard(Dataset):
    def __init__(self, rank: int, count: int) -> None:
        self.rank, self.count = rank, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        return shard_batch(self.rank, index)


class Module(pl.LightningModule):
    def __init__(self, step_sync: bool = False, manual: bool = False, norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        middle = nn.BatchNorm1d(16) if norm else nn.Tanh()  # norm: buffers, broadcast before forwards
        self.net = nn.Sequential(nn.Linear(6, 16), middle, nn.Linear(16, 1))
        self.step_sync = step_sync
        self.automatic_optimization = not manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss, on_step=self.step_sync, on_epoch=not self.step_sync, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.net(x) - y) ** 2).mean(), sync_dist=True)
        self.log("val_max", x.abs().max(), reduce_fx="max", sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_trainer(tmp_path: str, uneven: bool = True, sharding_stage: int | None = None, **kwargs) -> pl.Trainer:
    strategy = PaddleDPStrategy(uneven_inputs=uneven, timeout=60, sharding_stage=sharding_stage)
    options = dict(devices=WORLD, use_distributed_sampler=False, num_sanity_val_steps=1)
    return trainer(strategy, tmp_path, **{**options, **kwargs})


def reference_weights(counts: list[int], epochs: int, accumulate: int = 1) -> list[torch.Tensor]:
    module = Module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    longest = max(counts)
    for _ in range(epochs):
        for t in range(longest):
            active = [rank for rank in range(len(counts)) if t < counts[rank]]
            losses = [((module.net(x) - y) ** 2).mean() for x, y in (shard_batch(r, t) for r in active)]
            (sum(losses) / len(counts) / accumulate).backward()
            if (t + 1) % accumulate == 0 or t == longest - 1:
                optimizer.step()
                optimizer.zero_grad()
    return [p.detach() for p in module.parameters()]


def reference_batchnorm_buffers(counts: list[int], epochs: int) -> list[torch.Tensor]:
    """The BatchNorm statistics every rank should end with: at each step the ranks with a batch
    start from the buffers of the lowest rank that had one in the step before (broadcast before the
    forward), and that rank's update is the one kept; the weights follow ``reference_weights``."""
    module = Module(norm=True)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    norm = module.net[1]
    for _ in range(epochs):
        for t in range(max(counts)):
            broadcast = [buffer.clone() for buffer in norm.buffers()]
            kept = None
            for rank in (r for r in range(len(counts)) if t < counts[r]):
                with torch.no_grad():
                    for buffer, value in zip(norm.buffers(), broadcast):
                        buffer.copy_(value)
                x, y = shard_batch(rank, t)
                # Each rank's backward before the next resets the buffers (BatchNorm saves them for it).
                (((module.net(x) - y) ** 2).mean() / len(counts)).backward()
                kept = kept or [buffer.clone() for buffer in norm.buffers()]
            with torch.no_grad():
                for buffer, value in zip(norm.buffers(), kept):
                    buffer.copy_(value)
            optimizer.step()
            optimizer.zero_grad()
    return [norm.running_mean, norm.running_var]


def fit_uneven(rank: int, tmp_path: str) -> dict[str, object]:
    """Four fits: per-rank streams (with uneven validation), a rank with no batch at all (and
    validation whose longest rank has a single batch), sized per-rank datasets with gradient
    accumulation, and sharding stage 2; then a model with BatchNorm whose rank 0 has no validation
    batch, yet takes the buffer broadcast of the others' first validation forward (its buffers go to both)."""
    outcome: dict[str, object] = {}
    cases = [
        ("streams", [2, 5], [1, 3], {}),
        ("empty_rank", [0, 3], [0, 1], {}),
        ("sized_accumulate", [3, 5], [2, 2], {"accumulate_grad_batches": 2}),
        ("sharded", [2, 5], [1, 0], {"sharding_stage": 2}),
    ]
    for name, train_counts, val_counts, kwargs in cases:
        module = Module()
        if name == "sized_accumulate":
            train = DataLoader(SizedShard(rank, train_counts[rank]), batch_size=None)
        else:
            train = DataLoader(Shard(rank, train_counts[rank]), batch_size=None)
        val = DataLoader(Shard(rank, val_counts[rank], offset=100), batch_size=None)
        sharding = {"sharding_stage": kwargs.pop("sharding_stage")} if "sharding_stage" in kwargs else {}
        trainer = make_trainer(tmp_path, **kwargs, **sharding)
        trainer.fit(module, train, val)
        expected = reference_weights(train_counts, epochs=2, accumulate=kwargs.get("accumulate_grad_batches", 1))
        for (param_name, param), ref in zip(module.named_parameters(), expected):
            torch.testing.assert_close(param.detach(), ref, msg=lambda m: f"rank {rank} {name}: {param_name}: {m}")
        outcome[name] = {
            "global_step": trainer.global_step,
            "metrics": {key: round(value.item(), 6) for key, value in trainer.callback_metrics.items()},
        }
    module = Module(norm=True)
    train = DataLoader(Shard(rank, 2 + rank), batch_size=None)
    make_trainer(tmp_path).fit(module, train, DataLoader(Shard(rank, 2 * rank, offset=100), batch_size=None))
    outcome["batchnorm_buffers"] = [round(v, 6) for v in module.net[1].running_mean.tolist()]
    # Rank 0 runs out first: the tail's statistics are rank 1's, and every rank ends with them.
    module, counts = Module(norm=True), [2, 4]
    make_trainer(tmp_path).fit(module, DataLoader(Shard(rank, counts[rank]), batch_size=None))
    expected = reference_batchnorm_buffers(counts, epochs=2)
    for name, ours, reference in zip(("running_mean", "running_var"), module.net[1].buffers(), expected):
        torch.testing.assert_close(ours, reference, msg=lambda m: f"rank {rank}: BatchNorm {name} after the tail: {m}")
    return outcome


@pytest.mark.slow
def test_ranks_with_different_numbers_of_batches_finish_together_with_the_same_weights(tmp_path):
    results = run_ranks(fit_uneven, WORLD, str(tmp_path), timeout=180)
    assert results[0] == results[1], "ranks disagree on steps or metrics"
    outcome = results[0]
    assert outcome["streams"]["global_step"] == 10  # 5 batches a epoch on every rank, 2 epochs
    assert outcome["empty_rank"]["global_step"] == 6
    assert outcome["sized_accumulate"]["global_step"] == 6  # steps after batches 2, 4, 5 of each epoch
    assert outcome["sharded"]["global_step"] == 10
    for name in ("streams", "empty_rank", "sharded"):
        assert set(outcome[name]["metrics"]) == {"train_loss", "val_loss", "val_max"}, name


class OutputsBesideTheLoss(Module):
    """A training_step that returns its predictions beside the loss, as many do."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        predictions = self.net(x)
        return {"loss": ((predictions - y) ** 2).mean(), "predictions": predictions.detach()}


class CollectivesInTheHooks(Callback):
    """Collectives where Lightning's hooks run after training_step: a sync_dist log of the
    gradient norm in on_after_backward, a gather of the step's outputs in on_train_batch_end."""

    def __init__(self) -> None:
        self.backward_hooks: list[str] = []
        self.gradient_norms: list[float] = []
        self.outputs: list[dict[str, tuple[int, ...]]] = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.backward_hooks.append("before")

    def on_after_backward(self, trainer, pl_module) -> None:
        self.backward_hooks.append("after")
        norm = pl_module.net[0].weight.grad.norm()
        self.gradient_norms.append(round(norm.item(), 6))
        pl_module.log("gradient_norm", norm, on_step=True, on_epoch=False, sync_dist=True, reduce_fx="max")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.outputs.append({key: tuple(value.shape) for key, value in outputs.items()})
        gathered = trainer.strategy.all_gather(outputs["predictions"])
        assert gathered.shape == (WORLD, *outputs["predictions"].shape)


def fit_with_collectives_in_the_hooks(rank: int, tmp_path: str) -> dict[str, object]:
    counts = [1, 3]  # rank 0 replays the last two batches of each epoch
    hooks = CollectivesInTheHooks()
    module = OutputsBesideTheLoss()
    run = make_trainer(tmp_path, callbacks=[hooks])
    run.fit(module, DataLoader(Shard(rank, counts[rank]), batch_size=None))
    for (name, param), expected in zip(module.named_parameters(), reference_weights(counts, epochs=2)):
        torch.testing.assert_close(param.detach(), expected, msg=lambda m: f"rank {rank}: {name}: {m}")
    return {
        "hooks": hooks.backward_hooks,
        "gradient_norms": hooks.gradient_norms,
        "outputs": hooks.outputs,
        "logged": run.callback_metrics["gradient_norm"].item(),
    }


@pytest.mark.slow
def test_a_replaying_rank_runs_the_backward_hooks_and_returns_outputs_like_the_others(tmp_path):
    results = run_ranks(fit_with_collectives_in_the_hooks, WORLD, str(tmp_path), timeout=180)
    assert results[0] == results[1], "the replaying rank ran other hooks, saw other gradients or returned other outputs"
    outcome = results[0]
    assert outcome["hooks"] == ["before", "after"] * 6  # 3 steps an epoch on every rank, 2 epochs
    assert outcome["outputs"] == [{"loss": (), "predictions": (4, 1)}] * 6
    assert outcome["logged"] == pytest.approx(outcome["gradient_norms"][-1], abs=1e-6)


def failing_fits(rank: int, tmp_path: str) -> dict[str, str]:
    """Refusals before any step (unequal lengths without the option, manual optimization), then a
    step-level sync_dist in the uneven tail, which must fail at once on every rank."""
    errors = {}
    train = DataLoader(SizedShard(rank, 3 + 2 * rank), batch_size=None)
    for name, module, uneven in (("lengths", Module(), False), ("manual", Module(manual=True), True)):
        try:
            make_trainer(tmp_path, uneven=uneven).fit(module, train)
        except ValueError as error:
            errors[name] = str(error)
    started = time.monotonic()
    try:
        tail = DataLoader(Shard(rank, 1 + 2 * rank), batch_size=None)
        make_trainer(tmp_path, max_epochs=1).fit(Module(step_sync=True), tail)
    except Exception as error:  # noqa: BLE001 - every rank must fail, each in its own way
        errors["step_sync"] = f"{type(error).__name__}: {error} after {time.monotonic() - started:.0f}s"
    return errors


@pytest.mark.slow  # end to end: three Lightning fits on 2 ranks, each failing
def test_unequal_lengths_manual_optimization_and_step_level_sync_in_the_tail_fail_at_once(tmp_path):
    results = run_ranks(failing_fits, WORLD, str(tmp_path), timeout=120)
    for rank, errors in results.items():
        assert "rank 0: 3, rank 1: 5" in errors["lengths"] and "uneven_inputs=True" in errors["lengths"], rank
        assert "uneven_inputs=True needs automatic optimization" in errors["manual"], rank
        assert "step_sync" in errors, f"rank {rank} finished a fit that cannot be matched"
    message = results[1]["step_sync"]
    assert "uneven_inputs=True): training_step called strategy.reduce" in message, message
    assert "rank(s) [0] have run out of batches" in message and "on_step=False, on_epoch=True" in message, message


def test_options_are_validated_naming_both_when_they_conflict():
    with pytest.raises(ValueError, match="uneven_inputs='yes' is invalid: expected True or False"):
        PaddleDPStrategy(uneven_inputs="yes")
    with pytest.raises(ValueError, match="hang_timeout=0 is invalid: expected a positive duration"):
        PaddleDPStrategy(hang_timeout=0)
    with pytest.raises(ValueError, match=r"hang_timeout=60 with timeout=30 is invalid"):
        PaddleDPStrategy(hang_timeout=60, timeout=30)
    assert Options.build({"hang_timeout": None}, "module").hang_timeout is None
    # The default stays under a shorter process-group timeout; a given hang_timeout is kept or refused, never changed.
    assert PaddleDPStrategy(timeout=60).options.hang_timeout == 30
    assert PaddleDPStrategy(timeout=400, hang_timeout=300.0).options.hang_timeout == 300
    with pytest.raises(ValueError, match=r"hang_timeout=300 with timeout=60 is invalid.*below timeout \(e.g. 30\)"):
        PaddleDPStrategy(timeout=60, hang_timeout=300.0)
    with pytest.raises(ValueError, match="uneven_inputs=True is not an option of lit_dp.DataParallel"):
        Options.build({"uneven_inputs": True}, "module")


def test_hydra_strategy_group_takes_both_options(tmp_path):
    from hydra.utils import instantiate

    from tests.helpers.recipes import compose_config

    config = compose_config("digits", ["strategy.uneven_inputs=true", "strategy.hang_timeout=120"], tmp_path)
    strategy = instantiate(config.strategy)
    assert (strategy.options.uneven_inputs, strategy.options.hang_timeout) == (True, 120.0)
    config = compose_config("digits", ["strategy.hang_timeout=null"], tmp_path)
    assert instantiate(config.strategy).options.hang_timeout is None


def join_in_a_fabric_loop(fabric) -> list[list[float]]:
    module = Module()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    rank = fabric.global_rank
    with fabric.strategy.join(model):
        for t in range(2 * (rank + 1)):
            x, y = shard_batch(rank, t)
            fabric.backward(((model(x) - y) ** 2).mean())
            optimizer.step()
            optimizer.zero_grad()
    weights = [p.detach().clone() for p in module.parameters()]
    for weight in weights:
        gathered = fabric.all_gather(weight)
        assert torch.equal(gathered[0], gathered[1]), "ranks disagree after the join"
    return [w.tolist() for w in weights]


def fork_fabric_join() -> list:
    from lightning.fabric import Fabric

    from lit_dp import fabric

    run = Fabric(strategy=fabric.PaddleDPStrategy(start_method="fork"), accelerator="cpu", devices=WORLD)
    return run.launch(join_in_a_fabric_loop)


def test_fabric_strategy_join_trains_uneven_inputs_in_a_hand_written_loop():
    weights = launch_forking(fork_fabric_join)
    # Rank r takes 2(r+1) steps; averaged over the world size (torch's default division).
    for ours, expected in zip(weights, reference_weights([2, 4], epochs=1)):
        torch.testing.assert_close(torch.tensor(ours), expected)


def test_join_takes_what_fabric_setup_returned_and_is_no_attribute_under_the_trainer():
    """The Trainer's way is ``uneven_inputs=True``: its strategy has no ``join``, as Lightning's ``DDPStrategy``."""
    from lit_dp import fabric

    with pytest.raises(TypeError, match=r"expects the module returned by fabric.setup .* got Linear"):
        fabric.PaddleDPStrategy().join(nn.Linear(1, 1))
    with pytest.raises(AttributeError, match=r"^'PaddleDPStrategy' object has no attribute 'join'$"):
        PaddleDPStrategy().join(nn.Linear(1, 1))
