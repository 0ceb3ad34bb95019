"""Every option with every other: valid, or refused where the job starts, naming both (issue 39).

The pairs are derived from the declarations (``tests/helpers/combinations.py``), not listed: a
new option, a new named hook's options or a new rule is combined with every other here without
a line to add. ``Options.build`` is where every front door validates (the strategies' constructors,
``DataParallel``, the recipes' ``build_strategy`` before any rank starts), so a verdict here is
the verdict before any process starts. The slow tier trains every valid pair that
``DataParallel`` takes, in one run of two ranks.
"""

from __future__ import annotations

import pytest
import torch

import lit_dp
from lit_dp.ddp_arguments import ddp_strategy_arguments
from lit_dp.options import FABRIC, MODULE, TRAINER, Options
from lit_dp.options.core import AUTO_SETTLED_STEP
from tests.helpers.combinations import features, nested, pairs, verdict, without_examples
from tests.helpers.distributed import run_ranks
from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

SCOPES = [TRAINER, FABRIC, MODULE]
PREFIX = "strategy."


def names_one_of(message: str, paths: set[str]) -> bool:
    return any(f"{PREFIX}{path}=" in message or f"{PREFIX}{path}:" in message or f"{PREFIX}{path} " in message
               for path in paths)


@pytest.mark.parametrize("scope", SCOPES)
def test_every_option_a_command_line_can_set_has_a_value_that_turns_it_on(scope):
    # An option without one would be left out of every combination below: declare examples= with it.
    assert without_examples(scope) == []


@pytest.mark.parametrize("scope", SCOPES)
def test_every_feature_alone_is_valid_with_what_it_needs(scope):
    refused = {str(feature): verdict(feature.given, scope) for feature in features(scope)}
    assert {feature: error for feature, error in refused.items() if error} == {}


@pytest.mark.parametrize("scope", SCOPES)
def test_every_pair_is_valid_or_refused_naming_both(scope):
    found = pairs(scope)
    assert len(found) > 200, "the pairs are derived from the declarations: far fewer means they were lost"
    unnamed = []
    for first, second in found:
        error = verdict({**first.given, **second.given}, scope)
        if error is not None and not (names_one_of(error, first.paths) and names_one_of(error, second.paths)):
            unnamed.append(f"{first} | {second}: {error}")
    assert unnamed == []


def test_the_known_refusals_are_among_the_verdicts():
    # The rules the pairs exercise, spot-checked: the verdict machinery must not call everything valid.
    assert "is invalid" in verdict({"sharding.stage": 2, "comm_hook": "bf16"}, TRAINER)
    assert "needs strategy.sharding.stage" in verdict({"sharding.overlap": True}, TRAINER)
    assert "needs strategy.trace.dir" in verdict({"trace.steps": (0, 2)}, TRAINER)
    assert "needs strategy.local_sgd.steps" in verdict({"local_sgd.warmup_steps": 3}, TRAINER)
    assert "needs strategy.fault_tolerance" in verdict({"ft.min_replicas": 2}, TRAINER)
    assert "is not supported" in verdict({"fault_tolerance": "torchft", "comm_buffer_size": "auto"}, TRAINER)
    assert verdict({"sharding.stage": 1, "comm_hook": "bf16"}, TRAINER) is None


def test_every_feature_alone_builds_the_trainer_strategy(monkeypatch):
    # The constructor checks what depends on the environment too (torchft's lighthouse): given here.
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    for feature in features(TRAINER):
        options = Options.build(nested(feature.given), TRAINER, nested=True)
        assert lit_dp.PaddleDPStrategy(options=options).options == options, str(feature)


def test_under_ddp_each_feature_maps_to_ddps_own_or_is_refused_naming_it():
    mapped, refused = [], []
    for feature in features(TRAINER):
        try:
            ddp_strategy_arguments(nested(feature.given), PREFIX, nested=True)
        except ValueError as error:
            assert names_one_of(str(error), {feature.path}), f"{feature}: {error}"
            assert "no counterpart in torch DDP" in str(error) or "invalid under torch DDP" in str(error), str(error)
            refused.append(feature.path)
        else:
            mapped.append(feature.path)
    assert {"comm_buffer_size", "comm_hook", "comm_dtype", "powersgd.rank", "find_unused_parameters"} <= set(mapped)
    assert {"comm_buffer_size", "last_comm_buffer_size", "comm_stats", "sharding.stage", "local_sgd.steps"} <= set(refused)


def test_under_ddp_every_pair_of_its_options_is_valid_or_refused_naming_both():
    for first, second in pairs(TRAINER):
        given = nested({**first.given, **second.given})
        try:
            ddp_strategy_arguments(given, PREFIX, nested=True)
        except ValueError as error:
            message = str(error)
            assert names_one_of(message, first.paths) or names_one_of(message, second.paths), message


def test_the_step_auto_settles_by_is_the_tuners():
    from lit_dp.observability.autotune import settled_step

    assert AUTO_SETTLED_STEP == settled_step()


# ---- The slow tier: every valid pair DataParallel takes, trained on two ranks in one run. ----

STEPS = 4


def _train_pairs(rank: int, combinations: list[dict], world_size: int, folder: str) -> list[str]:
    """Each combination: a fresh model, ``STEPS`` SGD steps; the weights checked against one process
    on the concatenated batch (exact reductions) or across the ranks (compressed ones)."""
    import os

    import torch.distributed as dist

    os.chdir(folder)  # trace.dir's example is a relative folder
    lit_dp.init_parallel_env()
    failures = []
    for given in combinations:
        torch.manual_seed(0)
        base = MODELS["tied"]()
        reference = MODELS["tied"]()
        reference.load_state_dict(base.state_dict())
        options = Options.build(nested(given), MODULE, nested=True)
        model = lit_dp.DataParallel(base, options=options)
        if options.sharding.stage is not None:
            optimizer = lit_dp.ShardedOptimizer(torch.optim.SGD, model, lr=0.1)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        try:
            for step in range(STEPS):
                inputs, targets = batch(step, world_size)
                optimizer.zero_grad()
                loss(model, shard(inputs, rank), shard(targets, rank), rank, step).backward()
                optimizer.step()
                reference_optimizer.zero_grad()
                reference_loss(reference, step, world_size).backward()
                reference_optimizer.step()
            model.wait_for_parameters()  # sharding.overlap leaves the last step's gathers in flight
            ours = torch.cat([p.detach().flatten() for p in base.parameters()])
            gathered = [torch.empty_like(ours) for _ in range(world_size)]
            dist.all_gather(gathered, ours)
            assert torch.isfinite(ours).all(), "non-finite weights"
            assert all(torch.equal(gathered[0], other) for other in gathered), "the replicas differ"
            if options.comm_hook is None and options.comm_dtype is None:
                expected = torch.cat([p.detach().flatten() for p in reference.parameters()])
                torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
        except Exception as error:  # noqa: BLE001 - every combination is reported, not the first only
            failures.append(f"{given}: {error!r}")
        finally:
            if model.watchdog is not None:
                model.watchdog.close()
    return failures


@pytest.mark.slow
def test_every_valid_pair_dataparallel_takes_trains_on_two_ranks(tmp_path):
    valid = []
    for first, second in pairs(MODULE):
        given = {**first.given, **second.given}
        if verdict(given, MODULE) is None:
            valid.append(given)
    assert len(valid) > 200
    results = run_ranks(_train_pairs, 2, valid, 2, str(tmp_path), timeout=1200.0)
    assert results == {0: [], 1: []}
