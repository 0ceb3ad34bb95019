"""Step times of lit_dp's reducer, torch DDP and no synchronisation, side by side on 2 gloo processes.

    python recipes/bench_reducer.py
    python recipes/bench_reducer.py steps=50 rounds=5 comm_buffer_size=5

Prints a Markdown table (medians, lit_dp / DDP ratio, peak memory with and without gradient views).
"""

import hydra
from omegaconf import DictConfig

from lit_dp.recipes.reducer_benchmark import BenchmarkConfig, report, run


@hydra.main(config_path="../conf", config_name="bench_reducer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    options = {key: value for key, value in cfg.items() if key != "task_name"}
    print(report(*run(BenchmarkConfig(**options))))


if __name__ == "__main__":
    main()
