"""Finding the parameters a backward cannot reach, and reading the flags after it."""

from __future__ import annotations

import torch
from torch import nn

from lit_dp.gradients.unused import UnusedParametersError, reached_parameters


def test_the_graph_walk_finds_exactly_the_parameters_the_outputs_depend_on():
    used, unused, direct = nn.Linear(3, 3), nn.Linear(3, 3), nn.Parameter(torch.ones(3))
    outputs = {"main": used(torch.randn(2, 3)), "extra": [direct * 2, torch.zeros(1)]}
    reached = reached_parameters(outputs)
    assert {id(used.weight), id(used.bias), id(direct)} <= reached
    assert id(unused.weight) not in reached and id(unused.bias) not in reached
    assert reached_parameters(direct) == {id(direct)}  # a leaf output is its own parameter


def test_the_missing_gradient_error_names_each_parameter_and_its_ranks_and_every_front_doors_remedy():
    error = UnusedParametersError(["a", "b"], 3, [(1, 2.0)], bytearray([1, 0]))
    lines = str(error).splitlines()
    assert lines[0].startswith("lit_dp reducer: trainable parameters received no gradient")
    assert "  b (missing on 2 of 3 ranks, including this one)" in lines
    assert error.parameters == ["b"] and isinstance(error, RuntimeError)
    for remedy in ("DataParallel(..., find_unused_parameters=True)", "paddle_dp_find_unused_parameters_true",
                   "strategy.find_unused_parameters=true"):
        assert remedy in lines[-1]
