"""Communication statistics, the trace and the bucket autotuner on 2 real gloo processes.

One multi-process run checks all three on ``lit_dp.DataParallel`` (the strategy and the
recipes are covered in ``tests/test_recipes.py``); the pure parts run without processes.
"""

from __future__ import annotations

import csv
import json
import re
import time
from unittest import mock

import pytest
import torch
from torch import nn

from lit_dp.observability.autotune import MEASURE_STEPS, WARMUP_STEPS
from lit_dp.observability.stats import BucketSpan, StepTimeline, check_trace_steps
from lit_dp import Options
from lit_dp.observability.trace import main as trace_main
from tests.helpers.distributed import run_ranks

KB = 1024 / 2**20  # one KB in MB
STATS_STEPS = 4
TRACED = (1, 3)
# Candidates for the autotuner on the test model (34 KB of weights of 16 KB and small biases):
# 40 KB and 1 MB both give one bucket, so 3 distinct partitions are tried; rank 1 is made slow
# except with PREFERRED buckets.
CANDIDATES = (4 * KB, 20 * KB, 40 * KB, 1.0)
DISTINCT = 3
# A budget for 2 passes and a bit (a pass times each distinct partition once: a warm-up step,
# then the timed ones); the tuner spends whole passes only.
PASSES = 2
TUNING_BUDGET = (PASSES * DISTINCT + 1) * (WARMUP_STEPS + MEASURE_STEPS)
MAX_TUNING_STEPS = PASSES * DISTINCT * (WARMUP_STEPS + MEASURE_STEPS)
EXPECTED_SIZE = "expected a positive number of megabytes or 'auto'"
PREFERRED = 20 * KB


def make_model() -> nn.Module:
    torch.manual_seed(0)
    hidden = [layer for _ in range(2) for layer in (nn.Linear(64, 64), nn.ReLU())]
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), *hidden, nn.Linear(64, 4))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def stats_trace_and_autotune(rank: int, trace_dir: str) -> dict:
    import lit_dp
    import lit_dp.observability.autotune

    lit_dp.init_parallel_env()
    # Statistics and trace: 4 KB buckets, so several buckets per step.
    model = make_model()
    wrapped = lit_dp.DataParallel(
        model, comm_buffer_size=4 * KB, last_comm_buffer_size=4 * KB, comm_stats=True, trace_dir=trace_dir,
        trace_steps=TRACED,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = []
    for step in range(STATS_STEPS):
        train_step(wrapped, optimizer, step)
        stats.append(wrapped.comm_stats())
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buckets = len(wrapped.reducer.bucket_indices)

    # Autotune: rank 1 sleeps 30 ms per step unless the buckets are those of PREFERRED, so the
    # slowest rank's step time (both ranks wait for it in the all-reduce) picks PREFERRED.
    tuned_model = make_model()
    with mock.patch.multiple(lit_dp.observability.autotune, CANDIDATES_MB=CANDIDATES, TUNING_STEPS=TUNING_BUDGET):
        tuned = lit_dp.DataParallel(tuned_model, comm_buffer_size="auto", last_comm_buffer_size=4 * KB)
    preferred = _partition(tuned_model, PREFERRED)
    optimizer = torch.optim.SGD(tuned_model.parameters(), lr=0.01)
    steps = 0
    while tuned.autotuner.chosen_mb is None and steps < 2 + MAX_TUNING_STEPS:
        if rank == 1 and tuned.reducer.bucket_indices != preferred:
            time.sleep(0.03)
        train_step(tuned, optimizer, steps)
        steps += 1
    return {
        "stats": stats,
        "gradient_bytes": gradient_bytes,
        "buckets": buckets,
        "chosen": tuned.comm_buffer_size,
        "sweep": tuned.autotuner.sweep,
        "tuning_steps": tuned.autotuner.tuning_steps,
        "steps": steps,
        "tuned_buckets": tuned.reducer.bucket_indices,
        "preferred_buckets": preferred,
    }


def _partition(model: nn.Module, megabytes: float) -> list[list[int]]:
    """The buckets a reducer builds for ``model`` at ``megabytes`` (in backward order, as the reducer lists them)."""
    from lit_dp.gradients.buckets import MB, assign_group_by_size

    params = list(model.parameters())
    groups = assign_group_by_size(params, [False] * len(params), [int(4 * KB * MB), int(megabytes * MB)])
    return list(reversed(groups))


@pytest.mark.slow
def test_stats_trace_and_autotune_on_two_ranks(tmp_path):
    results = run_ranks(stats_trace_and_autotune, 2, str(tmp_path), timeout=120)
    for rank, result in results.items():
        assert [s.step for s in result["stats"]] == list(range(STATS_STEPS)), f"rank {rank}"
        for s in result["stats"][1:]:  # after the ready-order rebuild (step 0 may bucket differently)
            assert s.buckets == result["buckets"] > 2, f"rank {rank}: {s}"
        for s in result["stats"]:
            assert s.bytes == result["gradient_bytes"], f"rank {rank}: {s}"
            assert s.time_ms > 0 and 0 <= s.exposed_ms <= s.time_ms and 0 <= s.overlap <= 1, f"rank {rank}: {s}"
            assert s.overlap == pytest.approx(1 - s.exposed_ms / s.time_ms)

    # The trace: valid trace-event JSON, one complete event per bucket per traced step.
    for rank, result in results.items():
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())["traceEvents"]
        spans = [e for e in events if e["ph"] == "X" and e["cat"] == "bucket"]
        assert len(spans) == result["buckets"] * (TRACED[1] - TRACED[0])
        assert sorted({e["args"]["step"] for e in spans}) == list(range(*TRACED))
        for e in spans:
            assert {"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["pid"] == rank and e["dur"] >= 0
            assert e["args"]["bytes"] > 0 and e["args"]["params"] and isinstance(e["args"]["bucket"], int)
        assert sum(e["name"] == "backward" for e in events) == TRACED[1] - TRACED[0]
        assert sum(e["ph"] == "i" for e in events) == TRACED[1] - TRACED[0]
    trace_main(["merge", str(tmp_path), "-o", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    trace_main(["render", str(tmp_path / "merged.json"), "-o", str(tmp_path / "timeline.png")])
    assert (tmp_path / "timeline.png").stat().st_size > 1000

    # Autotune: the same choice everywhere, the preferred one, reached within the schedule.
    first, second = results[0], results[1]
    assert first["chosen"] == second["chosen"] == PREFERRED
    assert first["sweep"] == second["sweep"] and sorted(first["sweep"]) == [4 * KB, 20 * KB, 40 * KB]
    assert first["tuned_buckets"] == second["tuned_buckets"] == first["preferred_buckets"]
    assert first["steps"] == 1 + first["tuning_steps"] + 1  # step 0, the windows, the deciding step
    assert first["tuning_steps"] == MAX_TUNING_STEPS


HOOK_DELAY_S = 0.05


def stats_with_a_slow_hook(rank: int) -> list[float]:
    """A hook whose result comes 50 ms after its all-reduce: communication time must include it."""
    import threading

    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()

    def slow_allreduce(state: None, bucket) -> torch.futures.Future:
        gradients = bucket.buffer().div_(dist.get_world_size())
        work = dist.all_reduce(gradients, async_op=True)
        result: torch.futures.Future = torch.futures.Future()

        def finish_later() -> None:  # on its own thread, so the hook returns at once, as real ones do
            work.wait()
            time.sleep(HOOK_DELAY_S)
            result.set_result(gradients)

        threading.Thread(target=finish_later, daemon=True).start()
        return result

    wrapped = lit_dp.DataParallel(make_model(), comm_stats=True)
    wrapped.register_comm_hook(None, slow_allreduce)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    times = []
    for step in range(2):
        train_step(wrapped, optimizer, step)
        times.append(wrapped.comm_stats().time_ms)
    return times


def test_comm_time_includes_the_hooks_collectives():
    for rank, times in run_ranks(stats_with_a_slow_hook, 2, timeout=60).items():
        # Without the hook's future, only the flags' all-reduce (well under a millisecond) would count.
        assert all(ms >= 0.8 * HOOK_DELAY_S * 1e3 for ms in times), f"rank {rank}: {times}"


def test_exposed_time_is_communication_after_backward():
    """Two overlapping all-reduces and a later one; backward ends at 5."""
    buckets = (
        BucketSpan(0, 8, ("a",), 1.0, 4.0), BucketSpan(1, 8, ("b",), 3.0, 6.0), BucketSpan(2, 8, ("c",), 7.0, 9.0),
    )  # fmt: skip
    stats = StepTimeline(step=3, start=0.0, backward_start=0.5, backward_end=5.0, reduced=9.5, buckets=buckets).stats()
    assert stats.time_ms == pytest.approx(7e3)  # [1, 6] and [7, 9]
    assert stats.exposed_ms == pytest.approx(3e3)  # [5, 6] and [7, 9]
    assert stats.overlap == pytest.approx(4 / 7)
    assert (stats.bytes, stats.buckets, stats.step) == (24, 3, 3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"comm_buffer_size": "fast"}, f"strategy.comm_buffer_size='fast' is invalid: {EXPECTED_SIZE}"),
        ({"comm_buffer_size": 0}, f"strategy.comm_buffer_size=0 is invalid: {EXPECTED_SIZE}"),
        ({"trace_steps": [3, 1]}, "strategy.trace_steps=[3, 1] is invalid: expected two integers (start, stop)"),
        ({"comm_stats": "yes"}, "strategy.comm_stats='yes' is invalid: expected True or False"),
    ],
)
def test_bad_options_are_rejected_naming_the_option(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Options.build(options, "trainer", prefix="strategy.")


def test_auto_is_accepted_from_the_command_line():
    from hydra import compose, initialize_config_dir

    from lit_dp_recipes.config import build_strategy, register_configs
    from tests.helpers.recipes import ROOT

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("digits", overrides=["strategy.comm_buffer_size=auto"])
        assert build_strategy(cfg.strategy).comm_buffer_size == "auto"
        with pytest.raises(ValueError, match="strategy.comm_buffer_size='fast' is invalid"):
            build_strategy(compose("digits", overrides=["strategy.comm_buffer_size=fast"]).strategy)
    assert check_trace_steps("trace_steps", (0, 2)) == (0, 2)


@pytest.mark.slow
def test_recipe_logs_comm_columns_and_a_resumed_run_keeps_the_tuned_size(tmp_path):
    from tests.helpers.recipes import QUIET, run_recipe

    short = [
        "trainer.max_epochs=1", "trainer.limit_train_batches=6", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=2",
    ]  # fmt: skip
    output = run_recipe("digits", *QUIET, *short, "strategy.comm_buffer_size=auto", f"hydra.run.dir={tmp_path / 'run'}")
    assert "[lit_dp] comm_buffer_size=auto chose 1 MB" in output  # the digits MLP: one bucket for every candidate
    assert re.search(r"\[lit_dp\] comm: 0\.100 MB in 1 bucket per step; time [\d.]+ ms, exposed [\d.]+ ms", output)
    [metrics] = (tmp_path / "run").glob("csv/version_*/metrics.csv")
    with metrics.open() as file:
        rows = list(csv.DictReader(file))
    columns = {f"comm/{name}" for name in ("bytes", "buckets", "time_ms", "exposed_ms", "overlap", "exposed_ms_max", "tuned_buffer_mb")}
    assert columns <= rows[0].keys()
    logged = [row for row in rows if row["comm/bytes"]]
    assert len(logged) >= 2 and float(logged[-1]["comm/tuned_buffer_mb"]) == 1  # logged once chosen (step 1)
    assert all(float(row["comm/exposed_ms_max"]) >= float(row["comm/exposed_ms"]) for row in logged)

    resumed = run_recipe(
        "digits", *QUIET, *short[1:], "trainer.max_epochs=2", "strategy.comm_buffer_size=auto",
        f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={tmp_path / 'resumed'}",
    )  # fmt: skip
    assert "comm_buffer_size=auto: 1 MB, tuned before" in resumed
    assert "comm_buffer_size=auto chose" not in resumed
