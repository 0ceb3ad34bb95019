"""``fault_tolerance="torchft"`` through the Trainer and Fabric: real replica groups, a real lighthouse.

Each replica group runs ``tests/helpers/ft_lightning_replica.py``; one is SIGKILLed mid-run and
started again. Checked as for ``DataParallel`` (tests/test_fault_tolerance.py): equal parameters
after every committed step, discarded steps not applied, each sample once; plus what users see:
a line per membership change, the ``ft/*`` metrics in the Trainer's logger.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

pytest.importorskip("torchft")

import lit_dp  # noqa: E402
from lit_dp.options import TRAINER, Options  # noqa: E402
from lit_dp.fault_tolerance.manager import Settings  # noqa: E402
from lit_dp.strategies.fault_tolerance import replica_batches  # noqa: E402
from tests.helpers.ft_lightning_replica import dataset  # noqa: E402
from tests.helpers.ft_replica import BATCH  # noqa: E402
from tests.helpers.torchft import PYTHON, read_records, replica_groups  # noqa: E402

STEPS, KILL_AT, SAVE_AT = 16, 4, 6


def group_1_killed_and_restarted(command: list[str], tmp_path: Path) -> dict[int, str]:
    """Two replica groups of ``command``; group 1 kills itself (its ``--kill``), is started again, and both run to
    the end: each group's log."""
    with replica_groups(command, 2, tmp_path) as replicas:
        replicas.start_all()
        victim = replicas.replicas[1]
        replicas.wait_for("replica group 1 to kill itself", lambda: victim.process.poll() is not None, 180)
        assert victim.process.returncode == -9, victim.tail()
        replicas.start(1)
        replicas.wait_all(timeout=240)
        return {group: replica.log.read_text() for group, replica in enumerate(replicas.replicas)}


def run(tmp_path: Path, front: str, accumulate: int = 1) -> dict[int, list[dict]]:
    command = [PYTHON, "-m", "tests.helpers.ft_lightning_replica", str(tmp_path), str(STEPS), front]
    command += ["--accumulate", str(accumulate)]
    command += ["--kill", f"1:{KILL_AT}", "--alone-seconds", "3"]  # alone, slowly: the restart comes back first
    logs = group_1_killed_and_restarted(command, tmp_path)
    records = {group: read_records(tmp_path / f"replica{group}.jsonl") for group in (0, 1)}
    check(records, logs)
    return records


def check(records: dict[int, list[dict]], logs: dict[int, str]) -> None:
    ends: dict[int, set[str]] = {}
    for group, lines in records.items():
        for line in lines:
            if line["committed"]:
                ends.setdefault(line["committed_steps"], set()).add(line["end"])
            else:
                assert line["start"] == line["end"], f"replica group {group} applied a discarded step"
    # A discarded step counts as a step (as one a gradient scaler skips): fewer than STEPS commit.
    committed = max(ends)
    assert sorted(ends) == list(range(1, committed + 1)) and all(len(h) == 1 for h in ends.values()), ends
    assert all(lines[-1]["committed_steps"] == committed for lines in records.values())
    # The restarted replica's first committed step: its peers' parameters, bit for bit (checked above),
    # after a recovery it announces.
    assert any(not line["committed"] for line in records[0]), "the kill discarded no step"
    assert "replica group 1 left" in logs[0] and "replica group 1 joined" in logs[0]
    assert "replica group 1 recovered a peer's state" in logs[1]
    # Each sample once, in the data stream's order, over the committed steps: micro-batch j of the
    # replica of quorum rank r reads the step's (j * replicas + r)-th batch (lit_dp.fault_tolerance.replica_data).
    read = []
    for step in range(1, committed + 1):
        takers = {
            line["rank"]: line["indices"]
            for lines in records.values()
            for line in lines
            if line["committed"] and line["committed_steps"] == step
        }
        micro_batches = max(len(batches) for batches in takers.values())
        read += [i for j in range(micro_batches) for rank in sorted(takers) for i in takers[rank][j]]
    assert read == lit_dp.ReplicaBatches(dataset(), BATCH, seed=0).indices(0, len(read)).tolist()


@pytest.mark.slow
def test_the_trainer_goes_on_without_a_killed_replica_group_and_takes_it_back(tmp_path):
    run(tmp_path, "trainer")
    with (tmp_path / "replica0" / "version_0" / "metrics.csv").open() as metrics:
        rows = list(csv.DictReader(metrics))
    replicas = [float(row["ft/replicas"]) for row in rows if row.get("ft/replicas")]
    assert 1.0 in replicas and replicas[-1] == 2.0
    assert max(float(row["ft/steps_discarded"]) for row in rows if row.get("ft/steps_discarded")) >= 1
    assert {row["ft/syncs_failed"] for row in rows if row.get("ft/syncs_failed")} == {"0.0"}  # no LocalSGD here


@pytest.mark.slow
def test_under_gradient_accumulation_the_trainers_step_count_survives_a_recovery(tmp_path):
    records = run(tmp_path, "trainer", accumulate=2)
    # global_step counts discarded steps too (as steps a gradient scaler skips): every replica,
    # the recovered one with its peer's loop counters, ends at max_steps, not a step short or over.
    steps = {group: int((tmp_path / f"replica{group}.steps").read_text()) for group in records}
    assert steps == {0: STEPS, 1: STEPS}, steps
    assert all(len(line["indices"]) == 2 for lines in records.values() for line in lines if line["committed"])
    weights = [torch.load(tmp_path / f"replica{group}.pt") for group in records]
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_fabric_goes_on_without_a_killed_replica_group_and_takes_it_back(tmp_path):
    run(tmp_path, "fabric")


@pytest.mark.slow
def test_fabric_resumed_from_fabric_save_goes_on_from_torchfts_step_count_and_the_data_where_it_stopped(tmp_path):
    # A whole-job restart: both replica groups stop, and start again from what fabric.save kept after
    # step SAVE_AT. Each resumed step is the uninterrupted run's, bit for bit: its quorum rank, its
    # samples, its parameters before and after.
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    module = [PYTHON, "-m", "tests.helpers.ft_lightning_replica"]
    for out, extra in ((saved, ["--save-at", str(SAVE_AT)]), (resumed, ["--resume", str(saved)])):
        out.mkdir()
        both = ["--min-replicas", "2"]  # every step in both groups: the first to start waits for the other
        with replica_groups([*module, str(out), str(STEPS), "fabric", *both, *extra], 2, out, min_replicas=2) as replicas:
            replicas.start_all()
            replicas.wait_all(timeout=240)
    for group in (0, 1):
        uninterrupted = {
            line["committed_steps"]: line for line in read_records(saved / f"replica{group}.jsonl") if line["committed"]
        }
        lines = [line for line in read_records(resumed / f"replica{group}.jsonl") if line["committed"]]
        assert [line["committed_steps"] for line in lines] == list(range(SAVE_AT + 1, STEPS + 1)), (
            f"replica group {group} did not go on from torchft's step {SAVE_AT}"
        )
        for line in lines:
            assert line == uninterrupted[line["committed_steps"]], f"replica group {group}, step {line['committed_steps']}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("period", "steps", "kill_at", "alone_seconds"),
    # K=24: a period deals 24 x 4 samples per group present, whole epochs of the 96: every sync ends an
    # epoch, the one where the restarted group meets its peers included.
    [(2, STEPS, 3, 3), (24, 96, 2, 1)],
    ids=["K=2", "K=24-every-sync-ends-an-epoch"],
)
def test_under_diloco_a_restarted_group_that_meets_its_peers_at_a_sync_counts_the_trainers_steps_as_they_do(
    tmp_path, period, steps, kill_at, alone_seconds
):
    # DiLoCo: the groups take a quorum only at a sync, inside the optimizer step, where the peers' state is
    # made after their loop counted the step's batch. Group 1 dies (after ``kill_at`` transactions: step 1's,
    # then the syncs) and its restart meets group 0 at a sync from the start of its first step, which its
    # own loop counts and which ends the peers' step: a batch and an optimizer step counted twice, or an
    # epoch end missed, put its validations and epoch ends apart from its peers' for the rest of the run.
    command = [PYTHON, "-m", "tests.helpers.ft_lightning_replica", str(tmp_path), str(steps), "trainer"]
    command += ["--local-sgd", str(period), "--kill", f"1:{kill_at}", "--alone-seconds", str(alone_seconds)]
    restarted = group_1_killed_and_restarted(command, tmp_path)[1].rsplit("] replica group 1, lighthouse", 1)[1]
    met = r"replica group 1 recovered a peer's state in [\d.]+ s and (re)?joined at the sync after step \d+"
    assert re.search(met, restarted), restarted
    loops = {group: json.loads((tmp_path / f"replica{group}.loops").read_text()) for group in (0, 1)}
    assert loops[0] == loops[1], loops
    # Every batch and optimizer step counted once, as in a run without faults.
    batches, step = loops[0]["batches"]["total"], loops[0]["optimizer"]["optimizer"]["step"]["total"]
    assert set(batches.values()) == set(step.values()) == {steps} and loops[0]["batches_that_stepped"] == steps, loops
    weights = [torch.load(tmp_path / f"replica{group}.pt") for group in (0, 1)]
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_the_settings_come_from_the_options_or_torchfts_variables():
    options = Options.build({"fault_tolerance": "torchft", "ft_min_replicas": 2}, TRAINER)
    settings = Settings.resolve(options, {"TORCHFT_LIGHTHOUSE": "http://lh:29510", "REPLICA_GROUP_ID": "3"})
    assert (settings.lighthouse, settings.replica_group, settings.min_replicas) == ("http://lh:29510", "3", 2)
    with pytest.raises(ValueError, match="needs the lighthouse's address: expected ft_lighthouse=.* or TORCHFT_LIGHTHOUSE"):
        Settings.resolve(options, {"REPLICA_GROUP_ID": "0"})
    with pytest.raises(ValueError, match="needs this replica group's id: expected ft_replica_group .* or REPLICA_GROUP_ID"):
        Settings.resolve(options, {"TORCHFT_LIGHTHOUSE": "http://lh:29510"})
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID='a' is invalid: expected a number"):
        Settings.resolve(options, {"TORCHFT_LIGHTHOUSE": "http://lh:29510", "REPLICA_GROUP_ID": "a"})
    named = Options.build({**{"fault_tolerance": "torchft"}, "ft_lighthouse": "http://a:1", "ft_replica_group": 0}, TRAINER)
    assert Settings.resolve(named, {}).replica_group == "0"


def test_what_the_strategies_cannot_follow_across_replicas_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    with pytest.raises(ValueError, match="local_sgd_adaptive=True with fault_tolerance='torchft' is not supported"):
        lit_dp.PaddleDPStrategy(fault_tolerance="torchft", local_sgd_steps=4, local_sgd_adaptive=True)
    lit_dp.PaddleDPStrategy(fault_tolerance="torchft", local_sgd_steps=4, local_sgd_outer="nesterov")  # DiLoCo across groups
    with pytest.raises(ValueError, match="uneven_inputs=True with fault_tolerance='torchft'"):
        lit_dp.PaddleDPStrategy(fault_tolerance="torchft", uneven_inputs=True)
    with pytest.raises(ValueError, match="ft_min_replicas=2 needs fault_tolerance"):
        lit_dp.fabric.PaddleDPStrategy(ft_min_replicas=2)
    assert lit_dp.fabric.PaddleDPStrategy(fault_tolerance="torchft").fault_tolerance.settings.replica_group == "0"


def test_without_torchft_the_strategies_say_how_to_install_it_as_they_are_built(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setitem(sys.modules, "torchft", None)  # what an environment without it imports
    for strategy in (lit_dp.PaddleDPStrategy, lit_dp.fabric.PaddleDPStrategy):
        with pytest.raises(ImportError, match=r"fault_tolerance='torchft' needs torchft, which is not installed here: "
                                              r"pip install \"lit_dp\[ft\]\""):
            strategy(fault_tolerance="torchft")
    lit_dp.PaddleDPStrategy()  # off: torchft is not needed


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


def test_the_training_loader_becomes_replica_batches_with_its_order():
    data = TensorDataset(torch.arange(10))
    shuffled = replica_batches(DataLoader(data, batch_size=2, shuffle=True), accumulate=3, seed=7)
    assert (shuffled.batch_size, shuffled.shuffle, shuffled.seed, shuffled.accumulate) == (2, True, 7, 3)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=False, seed=11)
    ordered = replica_batches(DataLoader(data, batch_size=2, sampler=sampler), accumulate=1, seed=7)
    assert (ordered.shuffle, ordered.seed) == (False, 11)
    with pytest.raises(ValueError, match="expected a map-style dataset and a batch_size"):
        replica_batches(DataLoader(_Stream(), batch_size=2), accumulate=1, seed=0)
    with pytest.raises(ValueError, match="expected a torch DataLoader"):
        replica_batches([1, 2], accumulate=1, seed=0)


@pytest.mark.slow
def test_a_group_that_comes_back_after_the_job_ended_exits_0_saying_so(tmp_path):
    # Three groups, two needed a step: group 2 dies at step 4 and is started again only once the
    # two others finished. It finds no quorum, reads that the job went on without it, and ends
    # with status 0 (its launcher does not start it again) instead of timing out forever.
    command = [PYTHON, "-m", "tests.helpers.ft_lightning_replica", str(tmp_path), str(STEPS), "trainer"]
    command += ["--kill", "2:4", "--min-replicas", "2", "--quorum-timeout", "5"]
    with replica_groups(command, 3, tmp_path, min_replicas=2) as replicas:
        replicas.start_all()
        victim = replicas.replicas[2]
        replicas.wait_for("replica group 2 to kill itself", lambda: victim.process.poll() is not None, 180)
        others = replicas.replicas[:2]
        replicas.wait_for("replica groups 0 and 1 to finish", lambda: all(r.process.poll() == 0 for r in others), 240, killed=victim)
        replicas.start(2)
        replicas.wait_for("replica group 2 to end by itself", lambda: victim.process.poll() is not None, 120)
        assert victim.process.returncode == 0, victim.tail()
        said = victim.tail(60)
    assert re.search(
        r"\[lit_dp\] fault tolerance: \[group 2\] replica group 2 \(at step \d+\) found no quorum of ft.min_replicas=2 replica groups "
        r"at the lighthouse http://\S+ in \d+ s \(attempt 1 of 3\): the job went on without this group and ended "
        r"\(its last quorum: groups 0 at step \d+, 1 at step \d+; no other group heard from for \d+ s\); exiting", said
    ), said
    assert "Traceback" not in said, said


@pytest.mark.slow
def test_a_group_left_alone_tries_a_bounded_number_of_times_then_exits_naming_the_quorum(tmp_path):
    # Two groups, both needed a step; group 1 dies and is not started again. Group 0 is not behind
    # anyone (the job did not go on without it): it tries 3 times, then exits 1, naming the
    # quorum it could not reach and the min_replicas it needed, for its launcher to restart it.
    command = [PYTHON, "-m", "tests.helpers.ft_lightning_replica", str(tmp_path), str(STEPS), "trainer"]
    command += ["--kill", "1:4", "--min-replicas", "2", "--quorum-timeout", "3"]
    with replica_groups(command, 2, tmp_path, min_replicas=2) as replicas:
        replicas.start_all()
        victim, survivor = replicas.replicas[1], replicas.replicas[0]
        replicas.wait_for("replica group 1 to kill itself", lambda: victim.process.poll() is not None, 180)
        replicas.wait_for(
            "replica group 0 to give up", lambda: survivor.process.poll() is not None, 120, killed=victim
        )
        assert survivor.process.returncode == 1, survivor.tail()
        said = survivor.tail(60)
    tries = re.findall(r"replica group 0 \(at step \d+\) found no quorum of ft.min_replicas=2 replica groups at the "
                       r"lighthouse \S+ in \d+ s \(attempt (\d) of 3\): no other group is alive; its last quorum: groups "
                       r"0 at step \d+, 1 at step \d+; the lighthouse says: New quorum not ready, only have 1 "
                       r"participants, need min_replicas 2", said)  # fmt: skip
    assert tries == ["1", "2", "3"], said
