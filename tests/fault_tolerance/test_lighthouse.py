"""``LighthouseStatus``: torchft's lighthouse status page read, as a group left out of every quorum reads it.

The page is torchft 0.2's ``templates/status.html`` as its lighthouse renders it; one test reads
a real lighthouse's.
"""

from __future__ import annotations

import pytest

from lit_dp.fault_tolerance.lighthouse import LighthouseStatus, group_of


def page(
    previous: list[tuple[str, int]], heartbeats: list[tuple[str, float, bool]], status: str, sizes: dict[str, int] | None = None
) -> str:
    members = "".join(
        f'\n<div class="member\n \n">\n  <b>{replica}</b> <br/>\n  Step: {step} <br/>\n  Manager: http://vm:1 <br/>\n'
        f"  TCPStore: vm:2 <br/>\n  World size: {(sizes or {}).get(replica, 1)} <br/>\n</div>\n"
        for replica, step in previous
    )
    beats = "".join(
        f'\n  <li class="heartbeat\n    {"old" if old else ""}\n  ">\n    {replica}: seen {age}s ago\n  </li>\n'
        for replica, age, old in heartbeats
    )
    return (
        f"\nCurrent quorum_id: 7 <br>\nNext quorum status: {status}\n\n<h3>Previous Quorum</h3>\n\n"
        f"Previous quorum id: 7 <br>\nNum participants: {len(previous)} <br>\n<div>{members}</div>\n"
        f"<h2>Heartbeats</h2>\n\n<ul>{beats}</ul>\n"
    )


NOT_READY = "New quorum not ready, only have 1 participants, need min_replicas 2 [1/1 participants healthy][1 heartbeating][shrink_only=false]"


def test_a_job_that_went_on_and_ended_without_a_group():
    status = LighthouseStatus.parse(page(
        [("0:aaa", 299), ("1:bbb", 299)],
        [("0:aaa", 14.2, True), ("1:bbb", 14.3, True), ("2:old", 80.0, True), ("2:new", 0.05, False)],
        NOT_READY,
    ))  # fmt: skip
    assert status is not None
    assert status.next_quorum == NOT_READY
    assert status.previous == {"0": 299, "1": 299}
    assert status.heard["2"] == (0.05, False)  # a group's newest process
    assert status.alive(besides="2") == []
    assert status.silent_for(besides="2") == pytest.approx(14.2)
    assert status.ended_without("2", step=0)
    assert not status.ended_without("2", step=299)  # not behind: the others are down, not done


def test_a_job_whose_other_groups_are_alive_or_only_down_has_not_ended():
    alive = LighthouseStatus.parse(page([("0:a", 40), ("1:b", 40)], [("0:a", 0.1, False), ("1:b", 9.0, True)], NOT_READY))
    assert alive is not None and alive.alive(besides="1") == ["0"] and not alive.ended_without("1", step=0)
    down = LighthouseStatus.parse(page([("0:a", 40), ("1:b", 40)], [("0:a", 9.0, True), ("1:b", 0.1, False)], NOT_READY))
    assert down is not None and not down.ended_without("1", step=40)  # the group that waits is the one ahead


def test_the_ranks_of_each_group_of_the_last_quorum_are_read():
    status = LighthouseStatus.parse(page([("0:a", 4), ("1:b", 4)], [("0:a", 0.1, False)], NOT_READY, {"0:a": 2, "1:b": 1}))
    assert status is not None and status.world_sizes == {"0": 2, "1": 1}


def test_what_is_not_the_status_page_is_none():
    assert LighthouseStatus.parse("<html>something else</html>") is None
    assert LighthouseStatus.read("http://127.0.0.1:9") is None  # nothing listens: the caller says what it knows
    assert group_of("12:5f0c") == "12"


def test_a_real_lighthouse_page_is_understood():
    torchft = pytest.importorskip("torchft._torchft")
    server = torchft.LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=10, heartbeat_timeout_ms=1000)
    try:
        status = LighthouseStatus.read(server.address())
    finally:
        server.shutdown()
    assert status is not None and status.next_quorum.startswith("New quorum not ready") and status.previous == {}
