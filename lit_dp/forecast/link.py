"""The links a forecast is made over, and how long each collective takes on them.

A flat link: every rank's path to its ring neighbours has ``bandwidth`` (bytes/s) and ``latency``
(s per hop). A ring all-reduce of ``s`` bytes on ``N`` ranks takes ``2(N-1)`` hops, each sending
``s/N``: ``2(N-1) * latency + 2(N-1)/N * s / bandwidth``; a reduce-scatter or an all-gather is half
of it. With ``ranks_per_node`` and ``inter_node``, ranks on one node share the first link and
nodes meet over the second: a flat ring crosses nodes and goes at the slower one's pace, and a
hierarchical all-reduce (replica groups per node) reduce-scatters inside the node, all-reduces
each rank's ``1/G`` across the nodes and all-gathers inside the node again.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_dp.options.forecast import show_bandwidth


@dataclass(frozen=True)
class Link:
    """Bandwidth in bytes/s, latency in s per hop; ``ranks_per_node`` and ``inter_node`` (bytes/s) for two levels."""

    bandwidth: float
    latency: float = 0.0
    ranks_per_node: int | None = None
    inter_node: float | None = None
    measured: bool = False  # the run's own link, as fitted

    def describe(self) -> str:
        text = f"{show_bandwidth(self.bandwidth)}, latency {self.latency * 1e6:.3g} us per hop"
        if self.measured:
            text = f"the run's own link ({text}, as fitted)"
        if self.ranks_per_node is not None and self.inter_node is not None:
            text += f"; {self.ranks_per_node} ranks per node, {show_bandwidth(self.inter_node)} between nodes"
        return text

    def nodes(self, ranks: int) -> int:
        """Nodes the ranks span (1 on a flat link)."""
        if self.ranks_per_node is None or self.inter_node is None:
            return 1
        return -(-ranks // self.ranks_per_node)

    def _flat_bandwidth(self, ranks: int) -> float:
        """A ring over every rank goes at its slowest hop's pace: between nodes once it spans several."""
        if self.nodes(ranks) > 1:
            return min(self.bandwidth, self.inter_node)  # type: ignore[type-var]
        return self.bandwidth

    def allreduce_ms(self, nbytes: float, ranks: int) -> float:
        if ranks < 2:
            return 0.0
        return (2 * (ranks - 1) * self.latency + 2 * (ranks - 1) / ranks * nbytes / self._flat_bandwidth(ranks)) * 1e3

    def half_ms(self, nbytes: float, ranks: int) -> float:
        """A reduce-scatter, or an all-gather, of ``nbytes`` in all."""
        if ranks < 2:
            return 0.0
        return ((ranks - 1) * self.latency + (ranks - 1) / ranks * nbytes / self._flat_bandwidth(ranks)) * 1e3

    def hierarchical_ms(self, nbytes: float, ranks: int) -> float:
        """Inside the node a reduce-scatter and an all-gather; across the nodes an all-reduce of 1/G of it."""
        per_node = min(ranks, self.ranks_per_node or ranks)
        nodes = self.nodes(ranks)
        inside = Link(self.bandwidth, self.latency)
        across = Link(self.inter_node or self.bandwidth, self.latency)
        return 2 * inside.half_ms(nbytes, per_node) + across.allreduce_ms(nbytes / per_node, nodes)

    def hierarchical_bytes(self, nbytes: float, ranks: int) -> float:
        per_node = min(ranks, self.ranks_per_node or ranks)
        nodes = self.nodes(ranks)
        return 2 * (per_node - 1) / per_node * nbytes + (
            2 * (nodes - 1) / nodes * nbytes / per_node if nodes > 1 else 0.0
        )
