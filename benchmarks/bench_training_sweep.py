"""Compare strategies and bucket sizes by training throughput and exposed communication, with Hydra multirun.

    python -m benchmarks.bench_training_sweep -m strategy=paddle_dp,ddp strategy.comm_buffer_size=1,5,25
    python -m benchmarks.bench_training_sweep -m strategy.comm_buffer_size=1,2,5,10,25,50,100,auto

The sweep folder (multirun/benchmark/<time>/) gets throughput.md, throughput.png and, for
paddle_dp (whose comm_stats the recipes turn on), exposed.png: exposed time against bucket size.
"""

import hydra
from omegaconf import DictConfig

from lit_dp_recipes.config import register_configs
from benchmarks.training_sweep import benchmark_job

register_configs()


@hydra.main(config_path="../conf", config_name="benchmark", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return benchmark_job(cfg)


if __name__ == "__main__":
    main()
