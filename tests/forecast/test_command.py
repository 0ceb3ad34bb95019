"""``python -m lit_dp.forecast RUN_FOLDER``: the table on a recorded run folder, and one line for a folder without a run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_dp.forecast.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
RUN = Path(__file__).parent / "recorded_run"


def forecast(*arguments: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "lit_dp.forecast", *arguments], capture_output=True, text=True, env=environ, timeout=120
    )


def test_the_command_prints_every_scenario_the_fastest_and_the_options_to_type():
    result = forecast(str(RUN), "--ranks", "8,64", "--bandwidth", "10Gbit,1Gbit", "--latency", "20us")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("the run: 2 gloo ranks on cpu, rank ")
    headers = [line for line in out.splitlines() if " ranks over " in line and "|" not in line]
    assert headers == [
        "8 ranks over 10 Gbit/s, latency 20 us per hop",
        "8 ranks over 1 Gbit/s, latency 20 us per hop",
        "64 ranks over 10 Gbit/s, latency 20 us per hop",
        "64 ranks over 1 Gbit/s, latency 20 us per hop",
    ]
    assert (
        out.count("| setting | step (ms) | exposed comm (ms/step) | MB per rank per step | vs one rank's compute |")
        == 4
    )
    assert out.count("\nfastest: ") == 4 and "strategy." in out and "(Python: " in out
    assert "| DiLoCo K=16, syncs in bf16 * |" in out
    assert (
        "* the quality cost (loss at equal steps) is not predicted; measured on the GPT recipe: docs/local_sgd.md#diloco-on-the-gpt-recipe"
        in out
    )


def test_without_flags_the_run_s_own_size_and_link_then_eight_ranks(capsys):
    assert main([str(RUN)]) == 0
    out = capsys.readouterr().out
    assert "\n2 ranks over the run's own link (" in out and "\n8 ranks over the run's own link (" in out


def test_two_levels_add_the_replica_groups_per_node(capsys):
    assert (
        main([str(RUN), "--ranks", "64", "--bandwidth", "400Gbit", "--ranks-per-node", "8", "--inter-node", "100Gbit"])
        == 0
    )
    out = capsys.readouterr().out
    assert "64 ranks over 400 Gbit/s, latency " in out and "; 8 ranks per node, 100 Gbit/s between nodes" in out
    assert "| replica groups of 8 ranks, one per node (hierarchical all-reduce) |" in out


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ["--bandwidth", "10Gbit,fast"],
            "error: argument --bandwidth: 'fast' is invalid: expected a positive bandwidth with its unit, e.g. 10Gbit",
        ),
        (
            ["--ranks", "1"],
            "error: argument --ranks: '1' is invalid: expected numbers of ranks, each at least 2, e.g. 8,64",
        ),
        (
            ["--latency", "20"],
            "error: argument --latency: '20' is invalid: expected a latency with its unit, e.g. 20us",
        ),
        (["--buckets", "0"], "error: argument --buckets: '0' is invalid: expected bucket sizes in MB, e.g. 5,10"),
        (["--ranks-per-node", "8"], "error: --ranks-per-node and --inter-node go together"),
    ],
)
def test_a_bad_flag_is_named(arguments, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main([str(RUN), *arguments])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_a_missing_folder_gets_one_line_saying_what_to_run_first(tmp_path):
    result = forecast(str(tmp_path / "outputs" / "digits" / "nothing"))
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        f"error: {tmp_path / 'outputs' / 'digits' / 'nothing'}: no such run folder; run training first, e.g. "
    )
    assert "python recipes/digits.py" in lines[0] and "then pass its folder" in lines[0]


def test_a_folder_without_a_profile_gets_one_line(tmp_path, capsys):
    (tmp_path / "csv" / "version_0").mkdir(parents=True)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {tmp_path}: no lit_dp profile (lit_dp_profile.rank*.json) in it; ")
    assert "comm_stats on: run python recipes/digits.py" in err


def test_a_damaged_profile_gets_one_line(tmp_path, capsys):
    shutil.copytree(RUN, tmp_path / "run")
    (tmp_path / "run" / "csv" / "version_0" / "lit_dp_profile.rank1.json").write_text("{")
    assert main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lit_dp_profile.rank1.json is damaged: " in err and "run training again" in err


def test_the_newest_run_under_a_folder_is_read(tmp_path, capsys):
    # A resumed run writes csv/version_1 beside version_0: the newest is the one forecast.
    older, newer = tmp_path / "csv" / "version_0", tmp_path / "csv" / "version_1"
    shutil.copytree(RUN / "csv" / "version_0", older)
    shutil.copytree(RUN / "csv" / "version_0", newer)
    (older / "lit_dp_profile.rank0.json").write_text("{")  # never read: the newer folder wins
    (older / "lit_dp_profile.rank1.json").write_text("{")
    os.utime(older / "lit_dp_profile.rank0.json", (0, 0))
    os.utime(older / "lit_dp_profile.rank1.json", (0, 0))
    assert main([str(tmp_path)]) == 0
