"""DiLoCo on the GPT recipe, killed between two syncs under torchrun and resumed, ends where the
uninterrupted run ends (issue 45): every rank's model and inner optimizer state, not rank 0's alone.

Both runs are ``torchrun --nproc-per-node=2 recipes/gpt.py`` as a user types it, a tiny GPT with
DiLoCo every 4 steps; the killed one loses rank 1 after step 14 (``KillRankOnce``), two steps after
the sync of step 12, and its restart resumes from the step-10 checkpoint, two steps after the sync
of step 8: the ranks' models differ there, so resuming every rank from rank 0's would show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.recipes import QUIET, model_metrics, torchrun_recipe

TORCHRUN_TIMEOUT = 400  # two attempts of a 2-process job on a loaded 2-core machine
DILOCO = [
    *QUIET, "experiment=gpt_tiny", "trainer.max_steps=20", "trainer.val_check_interval=20", "checkpoint_every_n_steps=5",
    "strategy.local_sgd.steps=4", "strategy.local_sgd.outer=nesterov",
]
KILL = ["+callbacks.kill._target_=lit_dp_recipes.faults.KillRankOnce", "+callbacks.kill.rank=1", "+callbacks.kill.step=14"]


def _torchrun(*overrides: str, cwd: Path, max_restarts: int) -> str:
    return torchrun_recipe("gpt", *overrides, cwd=cwd, max_restarts=max_restarts, timeout=TORCHRUN_TIMEOUT)


def _rank_states(checkpoint: Path) -> dict[int, dict[str, Any]]:
    """Each rank's model and optimizer state in a checkpoint: rank 0's is Lightning's own, the others' LocalSGD's."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    replicas = saved["lit_dp"]["local_sgd"]["replicas"]
    assert replicas["world_size"] == 2, replicas.keys()
    states = {0: {"model": saved["state_dict"], "optimizers": saved["optimizer_states"]}}
    for rank, state in replicas["ranks"].items():
        states[rank] = {"model": state["model"], "optimizers": state["optimizers"]}
    return states


def _assert_equal_states(resumed: dict[int, dict[str, Any]], uninterrupted: dict[int, dict[str, Any]], where: str) -> None:
    assert resumed.keys() == uninterrupted.keys() == {0, 1}, where
    for rank in uninterrupted:
        theirs, ours = uninterrupted[rank], resumed[rank]
        assert ours["model"].keys() == theirs["model"].keys(), f"rank {rank}, {where}"
        for name, tensor in theirs["model"].items():
            assert torch.equal(ours["model"][name], tensor), f"rank {rank}, {where}: the model's {name} differs"
        for index, (mine, reference) in enumerate(zip(ours["optimizers"], theirs["optimizers"], strict=True)):
            for param, state in reference["state"].items():
                for key, value in state.items():
                    assert torch.equal(torch.as_tensor(mine["state"][param][key]), torch.as_tensor(value)), (
                        f"rank {rank}, {where}: optimizer {index}'s {key} of parameter {param} differs"
                    )


@pytest.mark.slow
@pytest.mark.timeout(2 * TORCHRUN_TIMEOUT + 60)
def test_diloco_on_the_gpt_recipe_killed_between_syncs_resumes_exactly(tmp_path):
    reference = _torchrun(*DILOCO, f"hydra.run.dir={tmp_path / 'uninterrupted'}", cwd=tmp_path, max_restarts=0)
    run_dir = tmp_path / "killed"
    output = _torchrun(*DILOCO, *KILL, f"hydra.run.dir={run_dir}", cwd=tmp_path, max_restarts=1)

    assert "[lit_dp] fault: rank 1 killed after step 14" in output
    assert f"[lit_dp] resuming from {run_dir / 'checkpoints' / 'step=10.ckpt'} (step 10, restart 1 of 1)" in output
    assert "other ranks' work since their last sync is lost" not in output  # every rank resumed from its own state
    assert model_metrics(output)["val_loss"] == model_metrics(reference)["val_loss"]
    # Step 15: three steps past the sync of step 12, each rank's own model and AdamW moments;
    # step 20: the last sync's model, which the final validation measured.
    for step in (15, 20):
        checkpoint = f"step={step}.ckpt"
        _assert_equal_states(
            _rank_states(run_dir / "checkpoints" / checkpoint),
            _rank_states(tmp_path / "uninterrupted" / "checkpoints" / checkpoint),
            f"{checkpoint} resumed against uninterrupted",
        )
