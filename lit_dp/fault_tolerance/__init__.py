"""Live recovery with torchft (``fault_tolerance="torchft"``, ``pip install "lit_dp[ft]"``): the engine.

A job split into replica groups keeps training while groups fail and come back
(docs/fault_tolerance.md). Its pieces, each in one module of this package:

- ``replica_group``: ``DataParallel(manager=...)``'s buckets all-reduced across the replica
  groups of each step's quorum (``FaultTolerantGroup``), and ``replica_process_group``: torchft's
  process group with what it takes for no failure to make a survivor wait;
- ``hierarchical``: a replica group of several ranks (a launcher's job): each bucket
  reduce-scattered inside it, each rank's slice all-reduced across the groups, all-gathered;
- ``gloo_connections``: the abort Gloo lacks (a group's TCP connections shut down, a peer's
  hang-up seen);
- ``commit``: the one commit protocol of everything that crosses groups (``CrossGroupCommit``):
  a quorum per transaction (a step, a LocalSGD sync), its collectives' failures, the vote of
  every rank of the group, a group that healed re-aligned on one peer's state, the lines users
  see, a group that finds no quorum ending (``QuorumUnreachable``);
- ``manager``: a replica group's torchft ``Manager`` for the strategies (``FaultTolerance``): its
  steps' transactions, the state a recovering group receives, its data, torchft's log in a file;
- ``lighthouse``: the lighthouse's status page, read by a group that finds no quorum, and for the
  groups' sizes;
- ``replica_data``: ``ReplicaBatches``, the data dealt step by step to the groups present.

As for every feature, its options are declared with the others (``lit_dp.options.fault_tolerance``)
and its Lightning side is a strategy feature (``lit_dp.strategies.fault_tolerance``: the Trainer's
and Fabric's steps, data and loop counters). torchft is imported only inside the functions that
start it.
"""

from lit_dp.fault_tolerance.replica_group import FaultTolerantGroup, replica_process_group

__all__ = ["FaultTolerantGroup", "replica_process_group"]
