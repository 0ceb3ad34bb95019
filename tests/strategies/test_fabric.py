"""Fabric(strategy="paddle_dp") against Fabric(strategy="ddp")."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lit_dp import DataParallel, fabric
from lit_dp.gradients.unused import UnusedParametersError
from lit_dp.strategies.lightning_private import forward_module
from tests.helpers.distributed import launch_forking
from tests.helpers.lightning import REGISTERED, assert_logged_in_order

STEPS = 4
MICRO_BATCH = 4


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.spare = nn.Linear(2, 2) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def setup(fabric: Fabric, net: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def train(fabric: Fabric, accumulate: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """STEPS optimizer steps of `accumulate` micro-batches each, the first ones without synchronisation."""
    model, optimizer = setup(fabric, Net())
    data = dataset()
    # Built in user code, from the process group (one rank on one device).
    loader = DataLoader(data, batch_size=MICRO_BATCH, sampler=DistributedSampler(data, shuffle=False))
    batches = iter(fabric.setup_dataloaders(loader, use_distributed_sampler=False))
    for _ in range(STEPS):
        for micro in range(accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(((model(x) - y) ** 2).mean())
            if micro < accumulate - 1 and fabric.world_size > 1:
                # Not synchronised yet: each rank still holds the gradient of its own shard.
                grads = fabric.all_gather(next(model.parameters()).grad)
                assert not torch.equal(grads[0], grads[1]), "no_backward_sync did not keep gradients local"
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def train_both_ways(fabric: Fabric, checkpoint: str | None) -> dict[int, dict[str, list]]:
    """Weights after training with and without gradient accumulation; checks a checkpoint round trip.

    Weights come back as lists: tensors returned from a spawned rank travel as shared memory
    that dies with the process.
    """
    weights = {}
    for accumulate in (1, 2):
        model, optimizer = train(fabric, accumulate)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gathered = fabric.all_gather(state["net.0.weight"])
        assert all(torch.equal(gathered[0], other) for other in gathered), "ranks disagree"
        weights[accumulate] = {key: value.tolist() for key, value in state.items()}
    if checkpoint is not None:
        assert isinstance(model._forward_module, DataParallel)
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": STEPS})
        saved = torch.load(checkpoint, weights_only=True)
        assert set(saved["model"]) == set(state), "wrapper prefix in checkpoint"
        fresh, fresh_optimizer = setup(fabric, Net())
        restore = {"model": fresh, "optimizer": fresh_optimizer}
        assert fabric.load(checkpoint, restore) == {"step": STEPS}
        for key, value in fresh.state_dict().items():
            torch.testing.assert_close(value, state[key], msg=lambda m: f"{key}: {m}")
        assert fresh_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    return weights


def fork_both(checkpoint: str) -> tuple[dict, dict]:
    options = dict(accelerator="cpu", devices=2)
    ours = Fabric(strategy="paddle_dp_fork", **options).launch(train_both_ways, checkpoint)
    return ours, Fabric(strategy="ddp_fork", **options).launch(train_both_ways, None)


def test_same_weights_as_ddp_with_and_without_accumulation(tmp_path):
    # Fork (Lightning's "ddp_fork" twin): children start without re-importing, a second or less.
    ours, theirs = launch_forking(fork_both, str(tmp_path / "ours.ckpt"))
    untrained = Net().state_dict()
    for accumulate in (1, 2):
        for key in untrained:
            ours_, theirs_ = torch.tensor(ours[accumulate][key]), torch.tensor(theirs[accumulate][key])
            torch.testing.assert_close(ours_, theirs_, msg=lambda m: f"{key}, accumulate={accumulate}: {m}")
        assert ours[accumulate]["net.0.weight"] != untrained["net.0.weight"].tolist(), "no training"
    assert ours[1]["net.0.weight"] != ours[2]["net.0.weight"], "accumulation changed nothing"


def test_one_device_is_a_one_rank_group_and_unused_parameters_raise(tmp_path):
    run = Fabric(strategy="paddle_dp", accelerator="cpu", devices=1)
    run.launch()
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        weights = train_both_ways(run, str(tmp_path / "one.ckpt"))
        for key, value in plain_sgd().state_dict().items():
            torch.testing.assert_close(torch.tensor(weights[1][key]), value, msg=lambda m: f"{key}: {m}")

        model, _ = setup(run, Net(unused=True))
        with pytest.raises(UnusedParametersError) as error:
            run.backward(model(torch.randn(2, 6)).sum())
    finally:
        run.strategy.teardown()  # Fabric leaves it to the user: it gives back the SIGTERM and SIGUSR1 handlers
    message = str(error.value)
    assert "spare.weight (missing on 1 of 1 ranks, including this one)" in message
    assert "strategy='paddle_dp_find_unused_parameters_true' (Trainer or Fabric)" in message


def test_debug_log_shows_each_step_of_setup_and_teardown(caplog):
    caplog.set_level(logging.DEBUG, logger="lit_dp")
    run = Fabric(strategy=fabric.PaddleDPStrategy(sharding_stage=1, hang_timeout=None), accelerator="cpu", devices=1)
    run.launch()
    train(run, 1)
    run.strategy.teardown()  # Fabric leaves it to the user
    assert dist.is_initialized(), "the group outlives teardown, as under Fabric's ddp"
    run.barrier()
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("lit_dp.strategies")]
    assert_logged_in_order(
        messages,
        [
            "PaddleDPStrategy: setting up distributed",
            "PaddleDPStrategy: creating the process group: rank 0 of 1",
            "PaddleDPStrategy: wrapping Net in lit_dp.DataParallel with Options(",
            "PaddleDPStrategy: no hang watchdog (hang_timeout=None, world size 1)",
            "PaddleDPStrategy: setting up SGD",
            "sharding.stage=1: SGD rebuilt over this rank's parameters",
            "PaddleDPStrategy: tearing down strategy",
            "PaddleDPStrategy: leaving the process group alive, as \"ddp\" does",
        ],
    )


def plain_sgd() -> Net:
    """One process on the whole batch: plain SGD on the same micro-batches, without Fabric."""
    reference = Net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = dataset().tensors
    for step in range(STEPS):
        rows = slice(step * MICRO_BATCH, (step + 1) * MICRO_BATCH)
        ((reference(x[rows]) - y[rows]) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return reference


def test_comm_hooks_and_statistics_through_fabric():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # One device: a hook still runs on a group of one rank (as under DDP); the 2-rank hook
    # equivalence is tests/test_comm_hooks.py's.
    strategy = fabric.PaddleDPStrategy(ddp_comm_hook=allreduce_hook, comm_stats=True)
    run = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    run.launch()
    try:
        model, _ = train(run, 1)
    finally:
        run.strategy.teardown()
    module = model._forward_module
    assert module.comm_hook.name.endswith("allreduce_hook") and module.comm_stats().bytes > 0
    for key, value in plain_sgd().state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, msg=lambda m: f"{key}: {m}")


def launcher_start_method(launcher) -> str:
    if isinstance(launcher, _SubprocessScriptLauncher):
        return "popen"
    assert isinstance(launcher, _MultiProcessingLauncher), type(launcher)
    return launcher._start_method


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_every_name_resolves_case_insensitively(name):
    start_method, find_unused = REGISTERED[name]
    assert {n for n in STRATEGY_REGISTRY.available_strategies() if n.startswith("paddle_dp")} == set(REGISTERED)
    for spelling in (name, name.upper()):
        strategy = Fabric(strategy=spelling, accelerator="cpu", devices=2).strategy
        assert type(strategy) is fabric.PaddleDPStrategy, spelling
        assert launcher_start_method(strategy.launcher) == start_method, spelling
        assert strategy.find_unused_parameters is find_unused, spelling


def test_comm_buffer_size_is_the_set_up_models_and_before_setup_the_option():
    """docs/observability.md: the strategy returns the bucket size in effect (after "auto", the tuned
    one, kept after teardown and used by the next model set up, as under the Trainer)."""
    assert fabric.PaddleDPStrategy(comm_buffer_size=5).comm_buffer_size == 5
    run = Fabric(strategy=fabric.PaddleDPStrategy(comm_buffer_size="auto", hang_timeout=None), accelerator="cpu", devices=1)
    run.launch()
    assert run.strategy.comm_buffer_size == "auto"
    model, optimizer = setup(run, Net())
    inner = forward_module(model)  # the DataParallel inside Fabric's wrapper
    for _ in range(3):  # a one-bucket model settles at its first step
        run.backward(model(torch.randn(4, 6)).sum())
        optimizer.step()
    assert inner.autotuner.chosen_mb is not None
    assert run.strategy.comm_buffer_size == inner.comm_buffer_size == inner.autotuner.chosen_mb
    chosen = inner.autotuner.chosen_mb
    run.strategy.teardown()
    assert run.strategy.comm_buffer_size == run.strategy.tuned_comm_buffer_size == chosen
    again = forward_module(setup(run, Net())[0])
    assert again.autotuner is None and again.comm_buffer_size == chosen  # no step spent tuning again
    run.strategy.teardown()


def test_fabric_checkpoints_keep_the_features_state_under_lit_dp(tmp_path):
    """docs/fabric.md, "Checkpoints": fabric.save adds the features' state under "lit_dp", fabric.load restores
    it (here the tuned bucket size, into a new strategy) and returns the rest; a raw load restores nothing."""
    checkpoint = tmp_path / "tuned.ckpt"
    run = Fabric(strategy=fabric.PaddleDPStrategy(comm_buffer_size="auto", hang_timeout=None), accelerator="cpu", devices=1)
    run.launch()
    model, optimizer = setup(run, Net())
    with pytest.raises(ValueError, match="fabric.save.path, state. with a key 'lit_dp' in state is invalid"):
        run.save(checkpoint, {"model": model, "lit_dp": 1})
    for _ in range(3):  # a one-bucket model settles at its first step
        run.backward(model(torch.randn(4, 6)).sum())
        optimizer.step()
    chosen = run.strategy.tuned_comm_buffer_size
    assert chosen is not None
    run.save(checkpoint, {"model": model, "optimizer": optimizer, "step": 3})
    assert torch.load(checkpoint, weights_only=True)["lit_dp"] == {"tuned_comm_buffer_size": chosen}
    run.strategy.teardown()

    again = Fabric(strategy=fabric.PaddleDPStrategy(comm_buffer_size="auto", hang_timeout=None), accelerator="cpu", devices=1)
    again.launch()  # adopts the process group the first run left alive
    model, optimizer = setup(again, Net())
    assert again.strategy.tuned_comm_buffer_size is None
    assert set(again.load(checkpoint)) == {"model", "optimizer", "step", "lit_dp"}  # raw: returned whole
    assert again.strategy.tuned_comm_buffer_size is None  # and nothing restored
    assert again.load(checkpoint, {"model": model, "optimizer": optimizer}) == {"step": 3}
    assert again.strategy.tuned_comm_buffer_size == chosen
    inner = forward_module(model)
    assert inner.autotuner.chosen_mb == inner.comm_buffer_size == chosen  # the running model stopped tuning
    again.strategy.teardown()
