"""benchmarks/one_device.py: the bare model, DDP and lit_dp on a one-rank group, side by side."""

from __future__ import annotations

import torch.distributed as dist

from benchmarks.one_device import OneDeviceBenchmarkConfig, report, run


def test_one_device_benchmark_reports_ratios():
    config = OneDeviceBenchmarkConfig(steps=1, warmup=1, rounds=1, models=("many_small",))
    table = report(run(config), config)
    assert "| lit_dp / bare | lit_dp / DDP |" in table and "| many_small |" in table
    assert not dist.is_initialized(), "the benchmark must destroy the group it created"
