"""A process group written in Python, of one rank, that counts what is asked of it.

torchft's groups are such subclasses of ``dist.ProcessGroup``; torch's own DDP tests
(``test_c10d_pypg.py``) check DDP against one like this. Its collectives leave tensors as they
are (one rank), and its works are Python objects too, whose ``wait`` takes the timeout argument
as torch's C++ side passes it.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.distributed as dist


class CountingWork(dist._Work):
    def __init__(self, result: object, group: OneRankPythonGroup) -> None:
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(result)
        self._group = weakref.ref(group)

    def wait(self, timeout):  # no default, as in torch's test: the caller must pass it
        self._group().waits += 1
        return True

    def get_future(self) -> torch.futures.Future:
        self._group().futures += 1
        return self._future


class OneRankPythonGroup(dist.ProcessGroup):
    """Counts its collectives by name (``calls``), the waits and the futures asked of its works."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.calls: Counter[str] = Counter()
        self.waits = 0
        self.futures = 0
        self._works: list[CountingWork] = []  # kept alive, as a real backend keeps its works

    def _work(self, name: str, result: object) -> CountingWork:
        self.calls[name] += 1
        work = CountingWork(result, self)
        self._works.append(work)
        return work

    def broadcast(self, tensors, opts):
        return self._work("broadcast", tensors)

    def allreduce(self, tensors, opts):
        return self._work("allreduce", tensors)

    def allgather(self, outputs, inputs, opts):
        for output, tensor in zip(outputs[0], inputs):
            output.copy_(tensor)
        return self._work("allgather", outputs)

    def getSize(self) -> int:
        return 1

    def getBackendName(self) -> str:
        return "one-rank-python"
