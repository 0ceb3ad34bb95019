"""scripts/gpu_checks.py, without a GPU: its checks, their configs, how it runs them, its table.

No GPU is lent to CI, so what can be checked here is checked: the documented GPU commands it runs
are the suite's (the same rule, for CUDA), the benchmarks' shortened settings pass their own
checks, the figures are read from the benchmarks' own report functions (so a change of their
tables fails here), and real subprocesses run together, alone, past a timeout and past the budget.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from benchmarks.common import config_from
from benchmarks.gpt_gpu import GPTBenchmarkConfig, GPTResults, Row
from benchmarks.gpt_gpu import report as gpt_gpu_report
from benchmarks.gpt_recipe import Measured, check_config
from benchmarks.gpt_recipe import report as gpt_recipe_report
from lit_dp_recipes.config import register_configs
from tests.helpers.documented import gpu_commands
from tests.helpers.recipes import compose_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_checks  # noqa: E402 - a script, found through its folder


def checks_by_name(device: str, tmp_path: Path) -> dict[str, gpu_checks.Check]:
    return {check.name: check for check in gpu_checks.plan(device, tmp_path)}


def test_it_runs_every_documented_gpu_command_on_the_gpu_then_the_cuda_tests_and_the_benchmarks(tmp_path):
    checks = checks_by_name("cuda", tmp_path)
    documented = [command.source for command in gpu_commands()]
    assert list(checks)[: len(documented)] == documented
    benchmarks = ["benchmarks.gpt_gpu", "benchmarks.gpt_recipe experiment=gpt2_small"]
    assert list(checks)[len(documented) :] == ["pytest -m cuda", *benchmarks]
    for source in documented:
        argv = checks[source].argv
        assert "trainer.accelerator=gpu" in argv and "trainer.devices=1" in argv, argv
        assert not any(a.startswith("compile_backend=") for a in argv), argv  # the docs' own: inductor
    assert [check.name for check in checks.values() if check.alone] == benchmarks
    # The shards gpt.md's GPT-2 small command names are written where it looks.
    assert list((tmp_path / "clone" / "fineweb10B").glob("fineweb_*_000000.bin"))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_benchmarks_settings_pass_their_checks_with_clipping_on(device, tmp_path):
    config_from(GPTBenchmarkConfig, OmegaConf.from_dotlist(gpu_checks.GPT_GPU[device]))
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "benchmarks" / "conf"), version_base="1.3"):
        cfg = compose("gpt_recipe", overrides=[f"hydra.run.dir={tmp_path}", *gpu_checks.GPT_RECIPE[device]])
    check_config(cfg)
    assert cfg.trainer.gradient_clip_val == 1.0 and cfg.trainer.precision == "bf16-mixed"
    assert cfg.model.n_layer == (12 if device == "cuda" else 1)  # GPT-2 small on the GPU


def test_figures_are_read_from_the_benchmarks_reports_and_a_recipes_last_line(tmp_path):
    config = GPTBenchmarkConfig(shapes=((16, 1024),), shared_ranks=2, shared_shape=(8, 256))
    rows = [Row("eager", [16, 1024], {"none": 50.0, "ddp": 55.0, "lit_dp": 50.0}, [1.1], None)]
    shared = Row("eager", [8, 256], {"none": 10.0, "ddp": 10.0, "lit_dp": 20.0}, [2.0], None)
    output = gpt_gpu_report(GPTResults("H100", "nccl", 124_000_000, rows, shared, 30_000_000), config)
    shared_label = "eager 8 x 256, 2 Gloo ranks sharing the device, per rank"
    assert gpu_checks.gpt_gpu_figures(output) == [
        gpu_checks.Figure("eager 16 x 1024, one-rank group", 16 * 1024 * 1000 / 50.0, 1.1, "torch DDP"),
        gpu_checks.Figure(shared_label, 8 * 256 * 1000 / 20.0, 0.5, "torch DDP"),
    ]

    tiny = ["experiment=gpt_bench_cpu", "model.n_layer=1", "model.n_embd=32", "model.n_head=2"]
    cfg = compose_config("gpt", tiny, tmp_path)
    output = gpt_recipe_report(
        cfg, {"bare": [Measured(1000.0, 2.0)], "recipe": [Measured(980.0, 2.04)], "multi_rank": [Measured(970.0, 2.06)]}
    )
    assert gpu_checks.gpt_recipe_figures(output) == [
        gpu_checks.Figure("recipe", 980.0, 0.98, "nanoGPT's bare loop"),
        gpu_checks.Figure("multi_rank", 970.0, 0.97, "nanoGPT's bare loop"),
    ]

    final = "[lit_dp] final comm/time_ms_mean=0.1 tokens_per_sec=9158.9746 train_loss=4.7692"
    assert gpu_checks.recipe_figures(f"noise\n{final}\n") == [gpu_checks.Figure("", 9158.9746)]
    assert gpu_checks.pytest_figures("...\n11 passed, 1 failed, 6 skipped in 80.12s\n")[0].label == (
        "11 passed, 1 failed, 6 skipped"
    )
    assert gpu_checks.recipe_figures("Traceback ...") == []


def script(name: str, code: str, timeout: float, alone: bool = False) -> gpu_checks.Check:
    return gpu_checks.Check(name, [sys.executable, "-c", code], ROOT, timeout, gpu_checks.recipe_figures, alone)


def test_checks_run_together_then_alone_within_the_budget_into_one_table(tmp_path):
    final = "print('[lit_dp] final tokens_per_sec=1234.5')"
    checks = [
        script("fine", final, 60),
        script("fails", "import sys; sys.exit(3)", 60),
        script("hangs", "import time; time.sleep(60)", 2),
        script("benchmark", "import time; time.sleep(60)", 60, alone=True),  # stopped when the budget is spent
        script("late", final, 60, alone=True),
    ]
    results = gpu_checks.run_all(checks, budget=5, out=tmp_path)
    statuses = [(result.check.name, result.status) for result in results]
    assert statuses == [
        ("fine", "0"), ("fails", "3"), ("hangs", "timeout"), ("benchmark", "timeout"), ("late", "not run")
    ]
    assert results[0].figures == [gpu_checks.Figure("", 1234.5)]
    assert results[2].seconds < 5 and results[3].seconds < 5
    assert (tmp_path / "fails.log").read_text().startswith(f"$ {sys.executable} -c")
    lines = gpu_checks.table(results).splitlines()
    assert lines[0] == "| check | exit | seconds | tokens/s | / peer | peer, or what ran |"
    assert lines[2].startswith("| fine | 0 |") and lines[2].endswith("| 1,234 | n/a |  |")
    assert lines[3].startswith("| fails | 3 |") and "| n/a | n/a |" in lines[3]
    assert lines[-1].startswith("| late | not run | 0 |")


@pytest.mark.slow
def test_the_wrapper_prints_its_plan_on_a_machine_without_a_gpu(tmp_path):
    environ = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    command = ["bash", "scripts/gpu_checks.sh", "--dry-run", "--device", "cpu"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=environ)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pytest -m cuda:" in done.stdout and "trainer.accelerator=cpu" in done.stdout
    assert f"torch {torch.__version__}" in (tmp_path / "device.txt").read_text()
    with pytest.raises(SystemExit):
        gpu_checks.main(["--budget", "0"])
