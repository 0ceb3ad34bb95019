"""lit_dp's warnings print as its other lines do: one ``[lit_dp] ...`` line, no source-line echo."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest

from lit_dp.options.warning import LitDPDeprecationWarning, LitDPFutureWarning, LitDPWarning, format_warning
from tests.helpers.recipes import ROOT

# Warnings of lit_dp's raised in its own code (the recipes' check of trainer.devices, through Lightning's
# rank_zero_warn; DataParallel alone) and pointing at the caller's (a deprecated argument), then one of
# someone else's, which keeps Python's form. Lightning is imported second, after lit_dp, as in a user's script.
SCRIPT = textwrap.dedent(
    """
    import warnings

    import torch

    import lit_dp
    import lightning.pytorch
    from lit_dp_recipes.config import check_cpu_devices

    check_cpu_devices("cpu", 3, cores=2)
    lit_dp.DataParallel(torch.nn.Linear(2, 2))
    lit_dp.DataParallel(torch.nn.Linear(2, 2), check_reduction=True)
    warnings.warn("not lit_dp's")
    """
)


def test_lit_dps_warnings_are_one_line_each_with_no_source_line_echo(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, "-W", "always", str(script)], cwd=tmp_path, check=False, capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    lines = result.stderr.splitlines()
    assert result.returncode == 0, result.stderr
    ours = [line for line in lines if line.startswith("[lit_dp] ")]
    assert ours[0] == (
        "[lit_dp] trainer.devices=3 starts more CPU processes than the 2 cores this machine gives: they share the "
        "cores, so each step takes longer (at most 8 are accepted)."
    )
    assert ours[1].startswith("[lit_dp] DataParallel: world size is 1 and no process group exists;")
    assert ours[1].endswith(f"({script}:11)")  # where the user's code asked for it
    assert any(line.startswith("[lit_dp] DataParallel(check_reduction=True): deprecated") for line in ours)
    assert "rank_zero_warn(" not in result.stderr and "UserWarning: trainer.devices" not in result.stderr
    assert "lit_dp.DataParallel(" not in result.stderr  # no source line of the user's either
    # Every line is one of lit_dp's, but the other warning's, in Python's form with its source line.
    others = [line for line in lines if not line.startswith("[lit_dp] ")]
    assert others == [f"{script}:13: UserWarning: not lit_dp's", "  warnings.warn(\"not lit_dp's\")"], result.stderr


@pytest.mark.parametrize("category", [LitDPWarning, LitDPDeprecationWarning, LitDPFutureWarning])
def test_lit_dps_categories_are_the_standard_ones_to_filters(category):
    standard = {LitDPWarning: UserWarning, LitDPDeprecationWarning: DeprecationWarning, LitDPFutureWarning: FutureWarning}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=standard[category])
        warnings.warn("hidden by a filter on the standard category", category)
    assert not caught
    assert format_warning("m", category, __file__, 3) == f"[lit_dp] m ({__file__}:3)\n"
