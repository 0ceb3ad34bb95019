"""Finding the parameters a backward cannot reach, and reading the flags after it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_dp.gradients.unused import missing_gradients_message, reached_parameters


def test_the_graph_walk_finds_exactly_the_parameters_the_outputs_depend_on():
    used, unused, direct = nn.Linear(3, 3), nn.Linear(3, 3), nn.Parameter(torch.ones(3))
    outputs = {"main": used(torch.randn(2, 3)), "extra": [direct * 2, torch.zeros(1)]}
    reached = reached_parameters(outputs)
    assert {id(used.weight), id(used.bias), id(direct)} <= reached
    assert id(unused.weight) not in reached and id(unused.bias) not in reached
    assert reached_parameters(direct) == {id(direct)}  # a leaf output is its own parameter


@pytest.mark.parametrize(
    ("opening", "first_line", "last_line"),
    [
        (None, "lit_dp reducer: trainable parameters", "pass find_unused_parameters=True"),
        ("Lightning's sentence.", "Lightning's sentence.", "  b (missing on 2 of 3 ranks, including this one)"),
    ],
)
def test_the_missing_gradient_error_names_each_parameter_and_its_ranks(opening, first_line, last_line):
    lines = missing_gradients_message(["a", "b"], 3, [(1, 2.0)], bytearray([1, 0]), opening).splitlines()
    assert "  b (missing on 2 of 3 ranks, including this one)" in lines
    assert lines[0].startswith(first_line) and last_line in lines[-1]
