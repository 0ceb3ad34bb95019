"""LocalSGD and DiLoCo under Fabric by the Trainer's names (``lit_dp.strategies.local_sgd``).

A hand-written Fabric loop, as litgpt's pretraining loop is one, with
``lit_dp.fabric.PaddleDPStrategy(local_sgd_steps=4, local_sgd_outer="nesterov")`` on 2 CPU ranks:
the averager steps after each ``optimizer.step()``, ``fabric.save`` keeps its state under
``"lit_dp"``, and a new launch that ``fabric.load`` s the checkpoint ends with the weights of the
run that was never interrupted. The Trainer's side is ``tests/test_local_sgd_outer.py``'s.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

import lit_dp
from tests.helpers.distributed import launch_forking

K = 4
STEPS = 3 * K  # the last step syncs: every rank ends with the same weights


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``, the same in every launch (a resumed one starts at its step)."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * step + rank))
    return x, x.sum(dim=1, keepdim=True).sin()


def _loop(fabric: Fabric, optimizer_name: str, checkpoint: str, start: int, stop: int) -> list[list[float]]:
    """Steps ``start`` to ``stop`` of the loop; a start past 0 loads the checkpoint, a stop short of
    ``STEPS`` saves one. Returns the weights after ``fabric.strategy.teardown()``, checked equal on every rank."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01) if optimizer_name == "adamw" else torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = fabric.setup(net, optimizer)
    if start:
        assert fabric.load(checkpoint, {"model": model, "optimizer": optimizer}) == {"step": start}
    for step in range(start, stop):
        x, y = _batch(fabric.global_rank, step)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()  # the strategy's LocalSGD steps after it, syncing after every K-th
        optimizer.zero_grad()
    if stop < STEPS:
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": stop})
    fabric.strategy.teardown()  # the end of the run: LocalSGD's last average, if a local step is pending
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = fabric.all_gather(weights)
    assert torch.equal(gathered[0], gathered[1]), f"rank {fabric.global_rank}: the ranks' weights differ at the end"
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _launch(optimizer_name: str, checkpoint: str, start: int, stop: int) -> list[list[float]]:
    strategy = lit_dp.fabric.PaddleDPStrategy(local_sgd_steps=K, local_sgd_outer="nesterov", start_method="fork")
    return Fabric(strategy=strategy, accelerator="cpu", devices=2).launch(_loop, optimizer_name, checkpoint, start, stop)


def _uninterrupted_and_resumed(optimizer_name: str, checkpoint: str, saved_at: int) -> tuple[list, list, dict]:
    """Three launches: the whole run; the run to ``saved_at``, saved; a new launch from the checkpoint.
    Also what the checkpoint's ``lit_dp`` entry says of LocalSGD (no tensors: they would not outlive this process)."""
    uninterrupted = _launch(optimizer_name, checkpoint, 0, STEPS)
    _launch(optimizer_name, checkpoint, 0, saved_at)
    local_sgd = torch.load(checkpoint, weights_only=False)["lit_dp"]["local_sgd"]
    saved = {
        "step": local_sgd["step"],
        "last_average": local_sgd["last_average"],
        "momentum": all(momentum is not None for momentum in local_sgd["outer"]["momentum"]),
    }
    return uninterrupted, _launch(optimizer_name, checkpoint, saved_at, STEPS), saved


def _assert_same_weights(resumed: list, uninterrupted: list) -> None:
    for index, (got, want) in enumerate(zip(resumed, uninterrupted)):
        assert got == want, f"parameter {index}: the resumed run's weights differ from the uninterrupted run's"


@pytest.mark.slow  # end to end: two Fabric runs on 2 forked ranks, with a checkpoint
def test_diloco_in_a_fabric_loop_resumes_from_a_checkpoint_saved_at_a_sync(tmp_path):
    # Saved right after the sync of step 8: the ranks hold the same model, and SGD keeps no state of its
    # own; the checkpoint's lit_dp entry carries the schedule and the outer optimizer (snapshot, momentum).
    uninterrupted, resumed, saved = launch_forking(_uninterrupted_and_resumed, "sgd", str(tmp_path / "ckpt"), 2 * K)
    assert saved == {"step": 2 * K, "last_average": 2 * K, "momentum": True}
    _assert_same_weights(resumed, uninterrupted)


@pytest.mark.slow
def test_diloco_in_a_fabric_loop_resumes_exactly_from_between_two_syncs(tmp_path):
    # The judging run, as litgpt's loop would save: AdamW, saved after step 6, between the syncs of
    # steps 4 and 8. Fabric's save and load call the features' state_dict/load_state_dict on every rank,
    # and the lit_dp entry is restored after the model and optimizer, so a per-rank state wins over rank 0's.
    uninterrupted, resumed, saved = launch_forking(_uninterrupted_and_resumed, "adamw", str(tmp_path / "ckpt"), K + 2)
    assert saved["step"] == K + 2
    _assert_same_weights(resumed, uninterrupted)


def test_the_strategy_with_local_sgd_pickles_for_a_spawning_launcher():
    # paddle_dp_spawn pickles the strategy, features included, into each rank.
    strategy = pickle.loads(pickle.dumps(lit_dp.fabric.PaddleDPStrategy(local_sgd_steps=K, start_method="spawn")))
    assert strategy.options.local_sgd.steps == K


def test_fabric_refuses_a_second_model_and_the_adaptive_period_naming_lit_dp_localsgd():
    with pytest.raises(ValueError, match="local_sgd_adaptive=True is not an option of lit_dp.fabric.PaddleDPStrategy: "
                       "the adaptive period needs each step's loss"):  # fmt: skip
        lit_dp.fabric.PaddleDPStrategy(local_sgd_steps=K, local_sgd_adaptive=True)
    run = Fabric(strategy=lit_dp.fabric.PaddleDPStrategy(local_sgd_steps=K, hang_timeout=None), accelerator="cpu", devices=1)
    run.launch()
    run.setup(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"local_sgd_steps=4 averages one model, and fabric.setup was given a second"):
        run.setup(nn.Linear(2, 2))
    run.strategy.teardown()
    run.setup(nn.Linear(2, 2))  # a new run after teardown gets its own averager
    run.strategy.teardown()
