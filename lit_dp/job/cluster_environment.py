"""``PaddleEnvironment``: Lightning's view of a job started by Paddle's launcher."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from lit_dp.job.env import ParallelEnv, started_by_paddle

log = logging.getLogger(__name__)


class PaddleEnvironment(ClusterEnvironment):
    """Ranks, node layout and rendezvous address from ``PADDLE_*`` variables (see ``ParallelEnv``).

    Paddle's launcher starts every process itself, so Lightning launches nothing.

    Args:
        environ: the variables to read, parsed on first use; defaults to ``os.environ``.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ
        self._parsed: ParallelEnv | None = None

    @property
    def parallel_env(self) -> ParallelEnv:
        if self._parsed is None:
            self._parsed = ParallelEnv(self._environ)
        return self._parsed

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self._rendezvous()[0]

    @property
    @override
    def main_port(self) -> int:
        return self._rendezvous()[1]

    def _rendezvous(self) -> tuple[str, int]:
        env = self.parallel_env
        if env.master_addr is None or env.master_port is None:
            raise ValueError(
                "PaddleEnvironment: no rendezvous address: expected MASTER_ADDR and MASTER_PORT, "
                "PADDLE_MASTER, or PADDLE_TRAINER_ENDPOINTS."
            )
        return env.master_addr, env.master_port

    @staticmethod
    @override
    def detect() -> bool:
        return started_by_paddle()

    @override
    def world_size(self) -> int:
        return self.parallel_env.world_size

    @override
    def set_world_size(self, size: int) -> None:
        log.debug("PaddleEnvironment.set_world_size(%s) ignored: the launcher fixed the world size.", size)

    @override
    def global_rank(self) -> int:
        return self.parallel_env.rank

    @override
    def set_global_rank(self, rank: int) -> None:
        log.debug("PaddleEnvironment.set_global_rank(%s) ignored: the launcher fixed the rank.", rank)

    @override
    def local_rank(self) -> int:
        return self.parallel_env.local_rank

    @override
    def node_rank(self) -> int:
        return self.parallel_env.node_rank

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        env = self.parallel_env
        if num_devices * num_nodes != env.world_size:
            raise ValueError(
                f"You set `devices={num_devices}` and `num_nodes={num_nodes}` in Lightning, but their product "
                f"({num_devices * num_nodes}) does not match PADDLE_TRAINERS_NUM={env.world_size}."
            )
