"""The resume probe: what each idle wait adds to the host work after it, from the workload's own times."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import lit_dp.observability.resume_probe as resume_probe
from lit_dp.observability.resume_probe import IDLE_MS, probe_resume

WORK_S = 1e-3


class _SlowToResumeHost:
    """A clock on which the workload takes WORK_S, plus a tenth of the idle wait before it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0
        self.penalty = 0.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # a workload's end: each workload reads the clock at its start and end
            self.now += WORK_S + self.penalty
            self.penalty = 0.0
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        self.penalty = seconds / 10


def test_each_wait_adds_what_the_workload_after_it_took_beyond_back_to_back(monkeypatch):
    host = _SlowToResumeHost()
    monkeypatch.setattr(resume_probe, "time", SimpleNamespace(perf_counter=host.perf_counter, sleep=host.sleep))
    probe = probe_resume(idle_ms=(2.0, 8.0), tries=3, work=1)
    assert probe["idle_ms"] == [2.0, 8.0]
    assert probe["work_ms"] == 1.0
    assert probe["extra_ms"] == [0.2, 0.8]  # a tenth of each wait
    assert host.slept == [0.002] * 3 + [0.008] * 3  # each wait, tries times, idle


def test_on_this_host_the_probe_measures_every_wait_and_leaves_the_random_stream_alone():
    state = torch.get_rng_state()
    probe = probe_resume()
    assert torch.equal(torch.get_rng_state(), state)
    assert probe["idle_ms"] == list(IDLE_MS)
    assert len(probe["extra_ms"]) == len(IDLE_MS) and all(extra >= 0 for extra in probe["extra_ms"])
    assert probe["work_ms"] > 0
