"""benchmarks/gpt_gpu.py: its options, its tables on CPU, its sync counter on CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpt_gpu import GPTBenchmarkConfig, count_syncs
from tests.helpers.recipes import run_benchmark

TINY = [
    "device=cpu", "n_layer=1", "n_head=2", "n_embd=32", "block_size=32", "vocab_size=64", "shapes=[[4,32]]",
    "compile_shapes=[[4,16]]", "compile_backend=aot_eager", "warmup=1", "steps=2", "rounds=2", "compile_rounds=1",
    "shared_n_layer=1", "shared_n_head=2", "shared_n_embd=32", "shared_shape=[4,32]", "shared_rounds=2",
]


def table_rows(output: str, label: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in output.splitlines()
        if line.startswith(f"| {label} |")
    ]


@pytest.mark.slow
def test_gpt_benchmark_on_cpu_prints_eager_compiled_and_shared_rows(tmp_path):
    output = run_benchmark("gpt_gpu", *TINY, f"hydra.run.dir={tmp_path}")
    eager = table_rows(output, "eager")
    compiled = table_rows(output, "torch.compile (aot_eager)")
    assert [row[1] for row in eager] == ["4 x 32", "4 x 32"]  # part 1, then part 2 (2 Gloo ranks)
    assert [row[1] for row in compiled] == ["4 x 16"]
    assert "GLOO group of one rank" in output and "2 Gloo ranks sharing CPU" in output
    for row in eager + compiled:
        bare, ddp, ours, ratio = (float(cell) for cell in row[2:6])
        low, high = (float(part) for part in row[6].split("-"))
        assert 0 < bare and 0 < ddp and 0 < ours
        # The times are printed to 0.01 ms, the ratio (of the unrounded medians) to 0.001.
        assert ratio == pytest.approx(ours / ddp, abs=1e-3 + 0.01 * ours / ddp**2)
        assert 0 < low <= high
        assert row[7] == "n/a"  # synchronisations are counted on CUDA only


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shapes": [[8, 2048]]}, r"shapes has \[8, 2048\]: expected \[batch, length\] .* length <= block_size=1024"),
        ({"compile_shapes": [[0, 16]]}, r"compile_shapes has \[0, 16\]"),
        ({"shared_shape": [8]}, r"shared_shape has \[8\]"),
        ({"n_embd": 100}, r"n_embd=100 is invalid: expected a multiple of n_head=12"),
        ({"rounds": 0}, r"rounds=0 is invalid: expected a positive integer"),
        ({"sync_steps": -1}, r"sync_steps=-1 is invalid: expected a non-negative integer"),
        ({"shared_ranks": 1}, r"shared_ranks=1 is invalid: expected 0 \(skip part 2\) or at least 2"),
        ({"device": "tpu"}, r"device='tpu' is invalid: expected one of cpu, cuda"),
    ],
)
def test_bad_gpt_benchmark_options_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        GPTBenchmarkConfig(**options)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sync_counter_sees_a_synchronisation_and_none_in_a_plain_step():
    # The zeros the benchmark reports mean something only if the counter sees a known sync.
    x = torch.ones(1024, device="cuda")
    assert count_syncs(lambda: x.sum().item(), 3) >= 1
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(8, 64, device="cuda")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(inputs).square().mean().backward()
        optimizer.step()

    step()
    assert count_syncs(step, 3) == 0
