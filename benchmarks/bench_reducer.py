"""Step times of lit_dp's reducer, torch DDP and no synchronisation, side by side.

    python -m benchmarks.bench_reducer                        # 2 Gloo processes on CPU, small models
    python -m benchmarks.bench_reducer steps=50 rounds=5 comm_buffer_size=5
    python -m benchmarks.bench_reducer device=cuda            # GPT-2 small on one GPU, eager and compiled

Prints Markdown tables: medians, the lit_dp / DDP ratio, and on CPU peak memory with and without
gradient views, on CUDA host synchronisations per step (docs/benchmarks.md).
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from benchmarks.gpu_benchmark import GPTBenchmarkConfig, report_gpt, run_gpt, select_benchmark
from benchmarks.reducer_benchmark import BenchmarkConfig, report, run


@hydra.main(config_path="../conf", config_name="bench_reducer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if select_benchmark(cfg.benchmark, cfg.device) == "gpt":
        config = GPTBenchmarkConfig(**OmegaConf.to_container(cfg.gpt, resolve=True))
        print(report_gpt(run_gpt(config, cfg.device), config))
        return
    options = {key: value for key, value in cfg.items() if key not in ("task_name", "device", "benchmark", "gpt")}
    print(report(*run(BenchmarkConfig(**options))))


if __name__ == "__main__":
    main()
