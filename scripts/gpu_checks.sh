#!/usr/bin/env bash
# What a lent GPU machine runs (docs/benchmarks.md says where the figures go): the `cuda` tests,
# the GPU benchmark, and on that machine's idle CPU cores (quieter than the project's 2-core machine):
# "cpu", the CPU reducer benchmark; "onedevice", the one-rank-group benchmark on GPU and CPU;
# "autotune", comm_buffer_size=auto against the sweep of fixed sizes.
# Run from the repository root with the Hydra wheels in .whl/; logs go to $OUT (or gpu-logs/).
#   bash scripts/gpu_checks.sh tests bench cpu onedevice autotune
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" | tee -a "$out/device.txt"
for part in "$@"; do
  case "$part" in
    tests) python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts="" 2>&1 | tee "$out/cuda-tests.log" ;;
    bench) python3 -m benchmarks.gpt_gpu 2>&1 | tee "$out/gpu-bench.log" ;;
    cpu) python3 -m benchmarks.reducer measure_memory=false 2>&1 | tee "$out/cpu-bench.log" ;;
    onedevice) { python3 -m benchmarks.one_device device=cuda threads=8
                 python3 -m benchmarks.one_device; } 2>&1 | tee "$out/one-device.log" ;;
    autotune) python3 -m benchmarks.autotune rounds=10 trials=5 2>&1 | tee "$out/autotune.log" ;;
    recipe) python3 recipes/charlm.py experiment=charlm_gpt2 trainer.devices=1 trainer.max_steps=60 \
              trainer.val_check_interval=60 trainer.limit_val_batches=2 2>&1 | tail -40 | tee "$out/charlm-gpt2.log" ;;
    *) echo "unknown part: $part" ;;
  esac
done
