"""What does the hang watchdog cost per step? ``hang_timeout`` on against off, interleaved.

    python -m benchmarks.watchdog                          # the reducer benchmark's models
    python -m benchmarks.watchdog --rounds 20 --steps 20 --threads 1

On 2 gloo processes, per model, three ``DataParallel`` wrappers of the same module train side
by side in rounds whose order rotates (``benchmarks.reducer_benchmark.interleaved_times``):
two with the watchdog off, one with it on (``hang_timeout=300``: its observer events, the
waits with a deadline, the thread polling the store). On against the mean of the two offs is
the watchdog's cost; off against off is the noise floor that comparison must beat.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.multiprocessing as mp

from benchmarks.reducer_benchmark import MODELS, _time_steps, free_port, init_gloo_rank, interleaved_times

WRAPPERS = ("off_a", "on", "off_b")


def _worker(rank: int, args: argparse.Namespace, port: int, results: dict) -> None:
    import lit_dp

    torch.set_num_threads(args.threads)
    init_gloo_rank(rank, 2, port)
    for name in args.models:
        build, width, batch = MODELS[name]
        torch.manual_seed(0)
        base = build()
        models = {
            wrapper: lit_dp.DataParallel(copy.deepcopy(base), hang_timeout=300.0 if wrapper == "on" else None)
            for wrapper in WRAPPERS
        }
        inputs = torch.randn(batch, width)
        times = interleaved_times(models, inputs, _time_steps, args.warmup, args.rounds, args.steps)
        if rank == 0:
            results[name] = {wrapper: statistics.median(samples) * 1e3 for wrapper, samples in times.items()}
    lit_dp.destroy_parallel_env()


def report(results: dict) -> str:
    lines = [
        "| model | off A (ms) | on (ms) | off B (ms) | on / mean(off) | off A / off B (noise) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        off = (row["off_a"] + row["off_b"]) / 2
        lines.append(
            f"| {name} | {row['off_a']:.3f} | {row['on']:.3f} | {row['off_b']:.3f} | {row['on'] / off:.3f} "
            f"| {row['off_a'] / row['off_b']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["few_large", "many_small", "many_small_norm"], choices=MODELS)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args, free_port(), results), nprocs=2)
        table = report(dict(results))
    print(table)
    return table


if __name__ == "__main__":
    main()
