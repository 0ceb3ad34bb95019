"""torch.compile around or inside DataParallel: eager's weights, and communication overlapping backward.

Compiled on CPU with ``backend="aot_eager"`` (AOT autograd's graphs, run eagerly: the graph
splitting and autograd structure of inductor without its compile time); inductor itself is in
``tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.overlap import graphs_compiled, launch_fractions_and_weights


@pytest.mark.slow
def test_compiled_models_train_like_eager_and_overlap():
    variants = ["eager", "DataParallel(compile(model))", "compile(DataParallel(model))"]
    results = run_ranks(launch_fractions_and_weights, 2, variants, timeout=280)
    for rank, shares in results.items():
        # Eager launches the first bucket after the last layer's nodes (about 1/8 of them); an
        # unsplit compiled graph is one node, all run before any launch (a share of 1, as seen
        # with the graph breaks switched off). Half is far from both.
        for variant, share in shares.items():
            assert share < 0.5, f"rank {rank}: {variant}: first bucket launched after {share:.0%} of backward's nodes"


@pytest.mark.slow
def test_a_compiled_model_is_split_at_buckets_only_where_communication_overlaps_backward():
    results = run_ranks(graphs_compiled, 2, ["sync", "local_sgd"], timeout=280)
    for rank, graphs in results.items():
        # Eight 1 MB weights in 1 MB buckets: synchronous steps split the graph into about one piece
        # per bucket; LocalSGD's local phase reduces nothing in backward, so it compiles one graph.
        assert graphs["local_sgd"] == 1, f"rank {rank}: {graphs}"
        assert graphs["sync"] > 4, f"rank {rank}: {graphs}"
