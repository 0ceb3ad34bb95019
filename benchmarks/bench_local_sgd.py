"""LocalSGD (K = 1, 2, 4, 8, 16) against plain data parallelism on 2 gloo processes.

    python -m benchmarks.bench_local_sgd
    python -m benchmarks.bench_local_sgd epochs=8 warmup_steps=20 plot=docs/local_sgd.png

Prints a Markdown table: MB sent per step, mean step time, and the validation accuracy of
the digits MLP after the same number of epochs, each with its ratio to data parallelism.
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from benchmarks.local_sgd_benchmark import LocalSGDBenchmarkConfig, report, run


@hydra.main(config_path="../conf", config_name="bench_local_sgd", version_base="1.3")
def main(cfg: DictConfig) -> None:
    options = {key: value for key, value in OmegaConf.to_container(cfg).items() if key != "task_name"}
    options["local_steps"] = tuple(options["local_steps"])
    config = LocalSGDBenchmarkConfig(**options)
    print(report(run(config), config))


if __name__ == "__main__":
    main()
