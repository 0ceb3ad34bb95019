"""The versions the README says are tested are the ones CI installs: pyproject.toml's floors
(.ci/lowest_versions installs them exactly) and the torch of .ci/run."""

from __future__ import annotations

import re
import runpy

from tests.helpers.documented import ROOT

FLOORS = runpy.run_path(str(ROOT / ".ci" / "floors.py"))["floors"]()


def release(version: str) -> str:
    """``2.8`` as pip installs ``==2.8``: ``2.8.0``."""
    parts = version.split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))


def test_the_readme_names_the_lowest_versions_ci_installs():
    readme = " ".join((ROOT / "README.md").read_text().split())
    expected = f"torch {release(FLOORS['torch'])} with Lightning {release(FLOORS['lightning'])}"
    assert expected in readme, f"README.md should say the lowest tested versions are {expected} (pyproject.toml)"


def test_the_readme_names_the_torch_ci_runs_both_tiers_on():
    [pinned] = re.findall(r'"torch==([\d.]+)"', (ROOT / ".ci" / "run").read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"CI runs both tiers on torch {'.'.join(pinned.split('.')[:2])}" in readme


def test_the_readme_installs_the_torch_ci_runs_on_without_cuda_in_one_line():
    # Issue 47: the README's commands pulled torch with 3 GB of CUDA libraries onto a machine with
    # no GPU, and a newer torch than the one CI tests.
    [pinned] = re.findall(r'"torch==([\d.]+)"', (ROOT / ".ci" / "run").read_text())
    readme = (ROOT / "README.md").read_text()
    assert f"python -m pip install torch=={pinned} --index-url https://download.pytorch.org/whl/cpu\n" in readme
    assert f"`torch=={pinned}`" in readme  # what CI installs, said where the tested versions are
