"""What torchft's lighthouse says of a job: to a replica group that cannot reach a quorum, and of the groups' sizes.

The lighthouse has no API for it besides joining a quorum, but it serves its state as a page,
``GET /status`` (torchft's ``templates/status.html``): why the next quorum is not ready ("only
have 1 participants, need min_replicas 2"), the previous quorum (its groups and their steps),
and every replica it has heard from with how long ago; and each member's ranks (its world size),
which tell replica groups of different sizes apart. A group left out of every quorum reads
it to tell a job that ended (it went on past this group's step, and no other group is heard
from any more) from one whose groups are alive, or only down, and to say so. ``LighthouseStatus.read`` returns None
when the page cannot be read or understood: the caller then says only what it knows itself.
"""

from __future__ import annotations

import html
import logging
import re
import urllib.request
from dataclasses import dataclass

log = logging.getLogger(__name__)

READ_SECONDS = 5.0
_NEXT = re.compile(r"Next quorum status:\s*([^<\n]*)")
_PREVIOUS_MEMBER = re.compile(r"<b>\s*([^<\s]+)\s*</b>\s*<br/>\s*Step:\s*(-?\d+)")
_MEMBER_SIZE = re.compile(r"<b>\s*([^<\s]+)\s*</b>(?:(?!<b>).)*?World size:\s*(\d+)", re.DOTALL)
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*([^<\s]+): seen ([\d.]+)s ago')


def group_of(replica_id: str) -> str:
    """The replica group of a torchft replica id (``"<group>:<uuid>"``: a new uuid per process)."""
    return replica_id.split(":", 1)[0]


@dataclass(frozen=True)
class LighthouseStatus:
    next_quorum: str  # the lighthouse's own words on why the next quorum is not ready (or is)
    previous: dict[str, int]  # the previous quorum's replica groups and the step each asked at
    heard: dict[str, tuple[float, bool]]  # replica group -> (seconds since last heard, past the heartbeat timeout)
    world_sizes: dict[str, int]  # the previous quorum's replica groups and their ranks each

    @classmethod
    def read(cls, address: str) -> LighthouseStatus | None:
        """The status of the lighthouse at ``address`` (``http://host:port``), or None."""
        try:
            with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=READ_SECONDS) as response:
                page = html.unescape(response.read().decode("utf-8", "replace"))
        except (OSError, ValueError) as error:
            log.debug("lit_dp: the lighthouse's status at %s could not be read: %s", address, error)
            return None
        return cls.parse(page)

    @classmethod
    def parse(cls, page: str) -> LighthouseStatus | None:
        found = _NEXT.search(page)
        if found is None:
            return None
        previous: dict[str, int] = {}
        for replica_id, step in _PREVIOUS_MEMBER.findall(page):
            previous[group_of(replica_id)] = max(int(step), previous.get(group_of(replica_id), -1))
        heard: dict[str, tuple[float, bool]] = {}
        for old, replica_id, age in _HEARTBEAT.findall(page):
            group, seconds = group_of(replica_id), float(age)
            if group not in heard or seconds < heard[group][0]:  # a group's newest process
                heard[group] = (seconds, bool(old))
        sizes = {group_of(replica_id): int(size) for replica_id, size in _MEMBER_SIZE.findall(page)}
        return cls(found.group(1).strip(), previous, heard, sizes)

    def alive(self, besides: str) -> list[str]:
        """The replica groups other than ``besides`` that the lighthouse still hears from."""
        return sorted((g for g, (_, old) in self.heard.items() if g != besides and not old), key=_number)

    def ended_without(self, group: str, step: int) -> bool:
        """Whether the job went on past ``step`` without ``group`` and no other group is heard from:
        it ended (or every other group stopped for good). A job whose other groups are only down
        (restarting) did not go past this group's step."""
        ahead = any(other != group and at > step for other, at in self.previous.items())
        return ahead and not self.alive(besides=group)

    def silent_for(self, besides: str) -> float | None:
        """Seconds since the lighthouse last heard from any group other than ``besides`` (None: never)."""
        ages = [age for group, (age, _) in self.heard.items() if group != besides]
        return min(ages) if ages else None


def _number(group: str) -> tuple[int, str]:
    return (int(group), group) if group.isdigit() else (-1, group)
