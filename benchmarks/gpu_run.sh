#!/usr/bin/env bash
# One call on a lent GPU machine (no venv, nothing installable; see docs/benchmarks.md):
#   bash benchmarks/gpu_run.sh            # writes logs and JSON under $OUT (or ./gpu-out)
# Installs wheels carried in .whl/ (torchao), runs the GPU-relevant tests, then make bench-gpu's
# script. Each part's log is kept even if a later part fails or times out.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -x tests/torch -p no:cacheprovider 2>&1 | tee "$out/tests.log" | tail -5
python3 -m benchmarks.gpu --out "$out/gpu.json" "$@" 2>&1 | tee "$out/bench.log"
