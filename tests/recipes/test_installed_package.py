"""The recipes from an installed wheel, as a user without a clone runs them (docs/configs.md, "From an
installed package"): the wheel built from this repository, installed (not editable) in a fresh
virtual environment, its commands run from an empty folder; the configs are the packaged ones,
and a config of the user's joins them through Hydra's search path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.recipes import final_metrics

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
# A config of the user's, in a folder of their own: the GPT recipe a few steps long.
USER_EXPERIMENT = """\
# @package _global_
data: {max_bytes: 30000, block_size: 32, batch_size: 4}
model: {n_layer: 1, n_embd: 32, n_head: 2, warmup_steps: 1}
trainer: {max_steps: 6, val_check_interval: 3, limit_val_batches: 1}
callbacks: {throughput: {warmup: 1}}
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment with the wheel installed; its python. The environment sees this one's
    packages (torch, Lightning, Hydra: --system-site-packages), lit_dp's own files are the wheel's."""
    pytest.importorskip("setuptools")  # the build backend, used without an isolated build (no network)
    work = tmp_path_factory.mktemp("installed")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"), str(ROOT)],
        capture_output=True, text=True, timeout=600, cwd=work,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (work / "dist").glob("lit_dp-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(work / "venv")], check=True, timeout=300)
    python = work / "venv" / "bin" / "python"
    # --ignore-installed: this environment's lit_dp (an editable install, say) would otherwise satisfy it.
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    return python


def run(command: list[str], cwd: Path, timeout: float = 600) -> str:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing of the clone
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} failed ({result.returncode}):\n{output[-4000:]}"
    return output


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_wheel_runs_both_recipes_and_samples_from_any_folder(installed, tmp_path):
    venv = installed.parent.parent
    where = run([str(installed), "-c", "import lit_dp, lit_dp_recipes.cli as c; print(lit_dp.__file__); print(c.CONF_DIR)"], tmp_path)
    library, configs = where.split()
    assert Path(library).is_relative_to(venv) and not Path(library).is_relative_to(ROOT), library
    assert Path(configs).is_relative_to(venv) and (Path(configs) / "gpt.yaml").is_file(), configs

    # The digits recipe by its console script, as documented: 2 CPU processes, its documented accuracy.
    digits = run([str(venv / "bin" / "lit-dp-digits"), *QUIET], tmp_path)
    assert final_metrics(digits)["val_acc"] >= 0.95, digits[-3000:]

    # The GPT recipe with an experiment of the user's found on Hydra's search path, as docs/configs.md shows it.
    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    (tmp_path / "my_conf" / "experiment" / "mine.yaml").write_text(USER_EXPERIMENT)
    gpt = run([str(venv / "bin" / "lit-dp-gpt"), "hydra.searchpath=[file://my_conf]", "experiment=mine", *QUIET], tmp_path)
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in gpt, gpt[-3000:]
    (checkpoint,) = (tmp_path / "outputs" / "gpt").glob("*/checkpoints/last.ckpt")

    # As docs/configs.md and docs/gpt.md show it, the run folder as the user copies it.
    sampled = run([str(installed), "-m", "lit_dp_recipes.run.sample", f"ckpt_path={checkpoint.relative_to(tmp_path)}"], tmp_path)
    assert "[lit_dp] sampling" in sampled and "---------------" in sampled, sampled[-3000:]
