#!/usr/bin/env bash
# What a lent GPU machine runs, in one call of at most 8 minutes on one H100 (docs/benchmarks.md):
# every documented GPU command shortened, `pytest -m cuda`, and the GPU benchmarks, then one table
# (scripts/gpu_checks.py says what and how). From the repository root; logs go to $OUT (or gpu-logs/).
#   bash scripts/gpu_checks.sh              # everything
#   bash scripts/gpu_checks.sh --dry-run    # the checks it would run
#   bash scripts/gpu_checks.sh --only bench # a part: docs, tests, bench
# That machine has no Hydra: carry its wheels in .whl/ (/work/shared/GPU.md says how); where .whl/
# is absent, the installed packages are used.
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
fi
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" | tee -a "$out/device.txt"
python3 scripts/gpu_checks.py --out "$out" "$@" 2>&1 | tee "$out/gpu_checks.log"
exit "${PIPESTATUS[0]}"
