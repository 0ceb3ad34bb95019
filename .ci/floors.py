"""The lowest torch and Lightning pyproject.toml allows, as exact pins: ``torch==X lightning==Y``.

Read by .ci/lowest_versions (which installs them) and by tests/test_versions.py (which checks the
README names them).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def floors() -> dict[str, str]:
    """``{"torch": ..., "lightning": ...}``: each package's ``>=`` bound in the project's dependencies."""
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    found = {}
    for name in ("torch", "lightning"):
        bounds = [m.group(1) for d in dependencies if (m := re.fullmatch(rf"{name}>=([\w.]+)", d.replace(" ", "")))]
        if len(bounds) != 1:
            raise ValueError(f"pyproject.toml: expected one '{name}>=X' dependency, got {dependencies}")
        found[name] = bounds[0]
    return found


if __name__ == "__main__":
    print(" ".join(f"{name}=={floor}" for name, floor in floors().items()))
