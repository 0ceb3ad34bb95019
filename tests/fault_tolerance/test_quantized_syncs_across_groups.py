"""LocalSGD syncs in a wire format (``sync_dtype``) across torchft's replica groups: the cross-group hop quantized.

Real processes on gloo around a real lighthouse, launched as tests/fault_tolerance/test_transient_faults.py
launches them (its helpers), DiLoCo with K=2: each sync is the count of those taking part (an all-reduce),
then per bucket an all-to-all of encoded chunks and an all-gather of their encoded sums, all three through
the groups' commit protocol. The oracle: every rank of every group ends bitwise equal, and the bytes that
crossed groups are the encoded ones (the classifier is 4095 parameters wide, ``--hidden 341``: 16 blocks of
128 per group's chunk, so nothing is padded but one value). The transient fault is the one those tests
inject: a collective issued and completed for the peers, reported failed on one side only.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")

from lit_dp.fault_tolerance.commit import check_every_group_takes_part  # noqa: E402
from tests.fault_tolerance.test_transient_faults import (  # noqa: E402
    INJECTED_RE,
    assert_all_equal,
    assert_each_group_one_model,
    finals,
    params_at,
    run,
)
from tests.helpers.torchft import PYTHON, replica_groups  # noqa: E402

K = 2
STEPS = 8  # four syncs, after steps 2, 4, 6 and 8
WIDE = ("--hidden", "341")  # 8 * 341 + 341 + 341 * 3 + 3 = 4095 parameters
PARAMETERS = 4095
COUNT_BYTES = 4  # the count of the groups taking part, one fp32 value, all-reduced at every sync


def int8_bytes(values: int, ranks: int) -> int:
    """What an int8 exchange of ``values`` over ``ranks`` sends: a chunk per rank of whole 128-value blocks,
    each block its fp32 scale and 128 one-byte codes."""
    blocks = -(-values // (ranks * 128))
    return ranks * blocks * (4 + 128)


def traffic(tmp_path: Path, groups: int, ranks: int) -> dict[tuple[int, int], dict]:
    return {where: state["traffic"] for where, state in finals(tmp_path, groups, ranks).items()}


@pytest.mark.timeout(120)
def test_int8_syncs_cross_two_groups_encoded_and_every_rank_ends_equal(tmp_path):
    outputs = run(tmp_path, STEPS, "--local-sgd", str(K), "--sync-dtype", "int8", *WIDE, timeout=100)
    assert_all_equal(tmp_path, 2, 1)
    held = params_at(tmp_path, 2, 1)
    assert all(len(held[step]) == 1 for step in range(K, STEPS + 1, K)), {step: len(held[step]) for step in held}
    assert all(len(held[step]) == 2 for step in range(1, STEPS, K)), "the groups trained apart between syncs"
    for output in outputs.values():
        # (Under load torchft's first state transfer, at step 0, may time out: a step discarded, not a sync.)
        assert re.search(r"\] \d+ steps? discarded, 0 failed syncs", output), output
    # Per sync: the count, and the exchange's encoded payload (its all-to-all's; the all-gather carries as much
    # back), 4224 bytes where fp32 sends 4095 * 4 = 16380.
    per_sync = COUNT_BYTES + int8_bytes(PARAMETERS, 2)
    assert per_sync == 4228
    for where, sent in traffic(tmp_path, 2, 1).items():
        assert (sent["across_bytes"], sent["allreduces"]) == (4 * per_sync, 8), (where, sent)


@pytest.mark.timeout(120)
def test_a_compressed_sync_failed_on_one_side_is_voided_everywhere_and_the_groups_end_equal(tmp_path):
    # Collectives 4, 5, 6 of group 1's rank 0 are the sync after step 4: its count, its all-to-all, its
    # all-gather. The all-to-all fails there only: group 1 skips the all-gather and closes its connections,
    # so group 0's all-gather fails too; neither applies the sync, each keeps its work, and the next sync
    # carries both periods' work.
    outputs = run(tmp_path, STEPS, "--local-sgd", str(K), "--sync-dtype", "int8", "--fail", "1:0:5", timeout=100)
    assert "all-to-all 5 across groups fails here" in outputs["1"]
    assert re.search(rf"\[group 1\] the sync after step 4 failed: .*{INJECTED_RE}", outputs["1"]), outputs["1"]
    assert re.search(r"\[group 0\] the sync after step 4 failed: ", outputs["0"]), outputs["0"]
    held = params_at(tmp_path, 2, 1)
    assert len(held[4]) == 2 and all(len(held[step]) == 1 for step in (6, 8)), {s: len(held[s]) for s in held}
    assert_all_equal(tmp_path, 2, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compressed_sync_whose_gather_failed_on_one_side_heals_that_group(tmp_path):
    # The all-gather of the sync after step 4 fails on group 1's rank 0 only: group 0 applies the sync, group 1
    # does not, and takes group 0's state at the next sync's quorum (its residuals start at zero).
    outputs = run(
        tmp_path, STEPS, "--local-sgd", str(K), "--sync-dtype", "int4", "--error-feedback", "true", "--fail", "1:0:6"
    )
    assert "all-gather 6 across groups fails here" in outputs["1"]
    assert re.search(r"\[group 1\] replica group 1 recovered a peer's state in [\d.]+ s at the sync after step 6", outputs["1"])
    assert not re.search(r"\[group 0\] the sync after step 4 failed", outputs["0"])
    assert len(params_at(tmp_path, 2, 1)[4]) == 2
    assert_all_equal(tmp_path, 2, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_int4_with_error_feedback_voided_on_one_side_ends_every_rank_equal(tmp_path):
    outputs = run(
        tmp_path, 12, "--local-sgd", str(K), "--sync-dtype", "int4", "--error-feedback", "true", "--fail", "1:0:5"
    )
    assert re.search(r"\[group 1\] 0 steps discarded, 1 failed sync,", outputs["1"]), outputs["1"]
    held = params_at(tmp_path, 2, 1)
    assert all(len(held[step]) == 1 for step in range(6, 13, K)), {s: len(held[s]) for s in held}
    assert_all_equal(tmp_path, 2, 1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_int8_sends_about_a_quarter_of_fp32s_bytes_across_groups(tmp_path):
    sent = {}
    for dtype in ("fp32", "int8"):
        out = tmp_path / dtype
        out.mkdir()
        run(out, STEPS, "--local-sgd", str(K), *WIDE, *(("--sync-dtype", dtype) if dtype != "fp32" else ()))
        assert_all_equal(out, 2, 1)
        sent[dtype] = {where: t["across_bytes"] for where, t in traffic(out, 2, 1).items()}
    for where in sent["fp32"]:
        assert sent["fp32"][where] == 4 * (COUNT_BYTES + PARAMETERS * 4), sent
        assert sent["int8"][where] / sent["fp32"][where] == pytest.approx(4228 / 16384), sent  # 0.258


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_in_groups_of_two_ranks_each_rank_sends_its_shard_encoded_and_a_failed_shard_fails_the_group(tmp_path):
    # Two groups of two ranks: each rank sums the group's deltas in fp32 inside the group, then its shard of
    # 2048 values crosses groups in int8 with the same rank of the other group. Group 1's rank 0 sees the
    # all-to-all of its shard of the sync after step 4 fail; its rank 1's went through.
    run(tmp_path, STEPS, "--local-sgd", str(K), "--sync-dtype", "int8", *WIDE, "--fail", "1:0:5", ranks=2, timeout=500)
    assert_each_group_one_model(tmp_path, 2, 2)
    assert_all_equal(tmp_path, 2, 2)
    held = params_at(tmp_path, 2, 2)
    assert len(held[4]) == 2 and all(len(held[step]) == 1 for step in (6, 8)), {s: len(held[s]) for s in held}
    per_sync = COUNT_BYTES + int8_bytes(PARAMETERS // 2 + 1, 2)  # a shard of ceil(4095 / 2) values
    assert per_sync == 4 + 2112
    for where, sent in traffic(tmp_path, 2, 2).items():
        assert sent["across_bytes"] == 4 * per_sync, (where, sent)  # a failed sync's bytes count, as sent


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sync_dtype", ["int8", pytest.param("bf16", id="bf16_without_residuals")])
def test_in_groups_of_two_ranks_a_trainer_resumed_between_syncs_ends_where_the_run_that_saved_did(tmp_path, sync_dtype):
    # With int8, each rank's residual covers its own shard of the group's sum (what int8 dropped of it), so
    # rank 1's is not rank 0's: the checkpoint after step 5, between the syncs after steps 4 and 6, must hold
    # both. bf16 keeps no residuals: the resume of the rest (the model, the snapshot, torchft's step count,
    # the data's position) alone. The oracle: the resumed run ends bitwise where the run that saved went on to.
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    common = (str(STEPS), "--sync-dtype", sync_dtype, *WIDE)
    _trainer_groups(saved, *common, "--save-at", "5")
    _trainer_groups(resumed, *common, "--resume", str(saved))
    differ = []
    for group, rank in itertools.product(range(2), range(2)):
        went_on, came_back = (torch.load(folder / f"group{group}-rank{rank}.pt") for folder in (saved, resumed))
        if any(not torch.equal(value, came_back[name]) for name, value in went_on.items()):
            differ.append((group, rank))
    assert not differ, f"(group, rank) {differ}: the resumed run ends with other parameters than the run that saved"


def _trainer_groups(out: Path, *flags: str) -> None:
    """Two replica groups of two ranks, ``tests.helpers.ft_resume`` under torchrun, to their end."""
    out.mkdir()
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1"]
    command = [PYTHON, *launcher, "-m", "tests.helpers.ft_resume", str(out), *flags]
    with replica_groups(command, 2, out, min_replicas=2) as replicas:
        replicas.start_all()
        replicas.wait_all(timeout=400)


def test_sync_delay_across_replica_groups_is_refused_saying_why():
    from lit_dp.fabric import PaddleDPStrategy

    with pytest.raises(ValueError, match=re.escape(
        "local_sgd_sync_delay=1 with fault_tolerance='torchft' is not supported: a sync is a transaction of the "
        "groups' commit protocol (a quorum, its collectives, a vote), and one still in flight during the inner "
        "steps after it would cross the next transaction's quorum"
    )):  # fmt: skip
        PaddleDPStrategy(local_sgd_steps=4, local_sgd_sync_delay=1, fault_tolerance="torchft")
    taken = PaddleDPStrategy(
        local_sgd_steps=4, local_sgd_sync_dtype="int4", fault_tolerance="torchft", ft_lighthouse="http://localhost:29510", ft_replica_group=0
    )
    assert taken.options.local_sgd.sync_dtype == "int4"


def test_a_wire_format_needs_every_group_of_the_quorum_to_take_part():
    from torchft.manager import WorldSizeMode

    check_every_group_takes_part(SimpleNamespace(_use_async_quorum=False, _replica_world_size_mode=WorldSizeMode.DYNAMIC), "int8")
    for manager in (
        SimpleNamespace(_use_async_quorum=True, _replica_world_size_mode=WorldSizeMode.DYNAMIC),
        SimpleNamespace(_use_async_quorum=False, _replica_world_size_mode=WorldSizeMode.FIXED_WITH_SPARES),
    ):
        with pytest.raises(ValueError, match=r"^sync_dtype='int8' across replica groups with a Manager built with use_async_quorum=.*every group must take part"):
            check_every_group_takes_part(manager, "int8")


def test_the_count_of_bytes_is_the_encoded_payload():
    # The arithmetic the runs above check against, from the format itself.
    from lit_dp.local_sgd.transport import encoded_bytes
    from lit_dp.local_sgd.wire import wire_format

    assert encoded_bytes(wire_format("int8"), PARAMETERS, 2) == int8_bytes(PARAMETERS, 2) == 4224
    assert encoded_bytes(wire_format("int8"), 2048, 2) == int8_bytes(2048, 2) == 2112
