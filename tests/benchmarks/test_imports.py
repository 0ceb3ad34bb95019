"""Every benchmark module imports: benchmarks run by hand must not rot."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.stem)
def test_every_benchmark_module_imports(path):
    importlib.import_module(f"benchmarks.{path.stem}")
