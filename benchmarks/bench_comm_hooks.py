"""Gradient compression on 2 gloo processes: fp32, bf16 and PowerSGD rank 1 and 4, side by side.

    python -m benchmarks.bench_comm_hooks
    python -m benchmarks.bench_comm_hooks steps=100 tasks=[digits] modes=[fp32,powersgd_1]

Prints a Markdown table: bytes all-reduced per step, median step time, and the digits accuracy
and charlm validation loss each mode reaches after the same steps.
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from benchmarks.comm_hook_benchmark import CommHookBenchmarkConfig, report, run


@hydra.main(config_path="../conf", config_name="bench_comm_hooks", version_base="1.3")
def main(cfg: DictConfig) -> None:
    options = {key: value for key, value in OmegaConf.to_container(cfg).items() if key != "task_name"}
    config = CommHookBenchmarkConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
    print(report(run(config), config))


if __name__ == "__main__":
    main()
