"""Compare strategies and bucket sizes by training throughput, with Hydra multirun.

    python recipes/benchmark.py -m strategy=paddle_dp,ddp strategy.comm_buffer_size=1,5,25

The sweep folder (multirun/benchmark/<time>/) gets throughput.md and throughput.png.
"""

import hydra
from omegaconf import DictConfig

from lit_dp.config import register_configs
from lit_dp.recipes.benchmark import benchmark_job

register_configs()


@hydra.main(config_path="../conf", config_name="benchmark", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return benchmark_job(cfg)


if __name__ == "__main__":
    main()
