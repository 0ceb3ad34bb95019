import pytest
import torch

from lit_dp import assign_group_by_size
from lit_dp.gradients.buckets import megabytes_to_bytes


def floats(*numels, dtype=torch.float32):
    return [torch.empty(n, dtype=dtype) for n in numels]


def test_first_group_uses_first_limit_then_last_limit_repeats():
    # 4-byte floats: sizes 40, 40, 40, 40, 40, 40 bytes.
    tensors = floats(10, 10, 10, 10, 10, 10)
    groups = assign_group_by_size(tensors, [False] * 6, [40, 100])
    # First group closes at >= 40 bytes (one tensor), then groups close at >= 100 bytes.
    assert groups == [[0], [1, 2, 3], [4, 5]]


def test_tensor_crossing_the_limit_stays_in_the_group():
    groups = assign_group_by_size(floats(5, 100, 5), [False] * 3, [30])
    assert groups == [[0, 1], [2]]


def test_dtypes_never_mix_and_each_has_its_own_limits():
    tensors = [
        torch.empty(10),
        torch.empty(10, dtype=torch.float16),
        torch.empty(10),
        torch.empty(10, dtype=torch.float16),
        torch.empty(10, dtype=torch.float64),
    ]
    groups = assign_group_by_size(tensors, [False] * 5, [1000])
    assert groups == [[0, 2], [1, 3], [4]]
    for group in groups:
        assert len({tensors[i].dtype for i in group}) == 1


def test_sparse_tensors_are_groups_of_their_own():
    groups = assign_group_by_size(floats(4, 4, 4, 4), [False, True, False, True], [1000])
    assert groups == [[0, 2], [1], [3]]


def test_every_index_exactly_once_and_groups_ordered_by_first_index():
    tensors = floats(*range(1, 60)) + floats(7, dtype=torch.bfloat16)
    groups = assign_group_by_size(tensors, [i % 11 == 0 for i in range(len(tensors))], [16, 64])
    assert sorted(i for g in groups for i in g) == list(range(len(tensors)))
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)


def test_empty_input_gives_no_groups():
    assert assign_group_by_size([], [], [100]) == []


@pytest.mark.parametrize(
    ("sparse", "limits", "message"),
    [
        ([False], [100], "is_sparse has 1 entries but tensors has 2"),
        ([False, False], [], "group_size_limits is empty"),
        ([False, False], [0], "positive integers"),
        ([False, False], [1.5], "positive integers"),
    ],
)
def test_bad_arguments(sparse, limits, message):
    with pytest.raises(ValueError, match=message):
        assign_group_by_size(floats(1, 1), sparse, limits)


@pytest.mark.parametrize("value", [0, -1, "5", True, float("nan")])
def test_bucket_sizes_must_be_positive_megabytes(value):
    with pytest.raises(ValueError, match=f"comm_buffer_size={value!r} is invalid: expected a positive number"):
        megabytes_to_bytes("comm_buffer_size", value)


def test_fractional_megabytes():
    assert megabytes_to_bytes("comm_buffer_size", 0.5) == 512 * 1024
    assert megabytes_to_bytes("comm_buffer_size", 25) == 25 * 1024 * 1024


def test_owners_are_balanced_within_one_tensor_of_an_even_split():
    from lit_dp.gradients.buckets import assign_owners

    generator = torch.Generator().manual_seed(0)
    for world_size in (1, 2, 3, 8):
        for _ in range(50):
            count = int(torch.randint(1, 40, (1,), generator=generator))
            sizes = (torch.randint(1, 1000, (count,), generator=generator) * 4).tolist()
            owners = assign_owners(sizes, world_size)
            loads = [sum(size for size, owner in zip(sizes, owners) if owner == rank) for rank in range(world_size)]
            assert set(owners) <= set(range(world_size))
            assert max(loads) <= sum(sizes) / world_size + max(sizes), (sizes, world_size, loads)


def test_owners_largest_first_to_the_least_loaded_rank_lowest_on_ties():
    from lit_dp.gradients.buckets import assign_owners

    # Largest first: 40 -> 0; 30 -> 1; 20 -> 1 (30 < 40); the first 10 -> 0 (40 < 50); the last 10 -> 0 (a tie at 50).
    assert assign_owners([10, 40, 20, 30, 10], 2) == [0, 0, 1, 1, 0]
    assert assign_owners([8, 8, 8], 3) == [0, 1, 2]  # equal sizes keep their order
    assert assign_owners([], 2) == []


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_owners_need_a_positive_world_size(world_size):
    from lit_dp.gradients.buckets import assign_owners

    with pytest.raises(ValueError, match=f"world_size={world_size!r} is invalid: expected an integer >= 1"):
        assign_owners([4], world_size)
