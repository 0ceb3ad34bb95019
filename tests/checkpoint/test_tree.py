"""The checkpoint as a tree (``lit_dp.checkpoint.tree``): pure functions, no processes."""

from collections import OrderedDict, namedtuple

import torch

from lit_dp.checkpoint.tree import (
    RankEntries,
    TensorSpec,
    map_tensors,
    only_rank_entries,
    placeholders,
    plain,
    rank_entries,
    spec_order,
    specs,
    tensors,
)

Betas = namedtuple("Betas", "first second")


def _tree() -> dict:
    state_dict = OrderedDict(weight=torch.ones(2, 3), bias=torch.zeros(3))
    state_dict._metadata = {"": {"version": 2}}  # what nn.Module.state_dict() records
    return {
        "state_dict": state_dict,
        "optimizer": {"state": RankEntries({3: {"exp_avg": torch.arange(4.0)}}), "param_groups": [{"betas": Betas(0.9, 0.99)}]},
        "epoch": 2,
        "pair": (torch.ones(1), "label"),
    }


def test_map_tensors_rebuilds_each_container_as_its_type():
    mapped = map_tensors(_tree(), lambda t: t * 2)
    assert type(mapped["state_dict"]) is OrderedDict and mapped["state_dict"]._metadata == {"": {"version": 2}}
    assert type(mapped["optimizer"]["state"]) is RankEntries
    assert mapped["optimizer"]["param_groups"][0]["betas"] == Betas(0.9, 0.99)
    assert torch.equal(mapped["optimizer"]["state"][3]["exp_avg"], torch.arange(4.0) * 2)
    assert mapped["pair"][1] == "label" and torch.equal(mapped["pair"][0], torch.full((1,), 2.0))


def test_a_ranks_entries_travel_as_specs_and_come_back_as_placeholders_in_the_same_order():
    [(path, entries)] = list(rank_entries(_tree()))
    assert path == ("optimizer", "state")
    sent = specs(entries)
    assert spec_order(sent) == [TensorSpec((4,), torch.float32)] and TensorSpec((4,), torch.float32).nbytes == 16
    standing_in = placeholders(sent)
    assert [(p, t.shape, t.dtype) for p, t in tensors(standing_in)] == [((3, "exp_avg"), torch.Size([4]), torch.float32)]


def test_plain_leaves_no_lit_dp_type_in_what_a_file_holds():
    flat = plain(_tree())
    assert type(flat["optimizer"]["state"]) is dict
    assert [path for path, _ in tensors(flat)] == [path for path, _ in tensors(_tree())]


def test_another_rank_keeps_only_its_entries_at_their_paths():
    tree = {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [{"state": {}}, {"state": RankEntries({1: {"m": torch.ones(1)}})}]}
    kept = only_rank_entries(tree)
    assert kept == {"optimizer_states": [None, {"state": tree["optimizer_states"][1]["state"]}]}
    assert [path for path, _ in rank_entries(kept)] == [path for path, _ in rank_entries(tree)]
    assert only_rank_entries({"state_dict": {"w": torch.ones(2)}}) is None
