"""One device, one-rank group: lit_dp and torch DDP against the bare model, side by side.

    python -m benchmarks.bench_one_device
    python -m benchmarks.bench_one_device device=cuda threads=8

Prints a Markdown table (median step times and their ratios).
"""

import hydra
from omegaconf import DictConfig

from benchmarks.one_device_benchmark import OneDeviceBenchmarkConfig, report, run


@hydra.main(config_path="../conf", config_name="bench_one_device", version_base="1.3")
def main(cfg: DictConfig) -> None:
    options = {key: value for key, value in cfg.items() if key != "task_name"}
    options["models"] = tuple(options["models"])
    config = OneDeviceBenchmarkConfig(**options)
    print(report(run(config), config))


if __name__ == "__main__":
    main()
