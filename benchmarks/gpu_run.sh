#!/usr/bin/env bash
# bench-gpu on a lent GPU machine (no venv, nothing installable there; docs/benchmarks.md):
#   bash benchmarks/gpu_run.sh [all|tests|bench] [benchmarks.gpu options, e.g. --quick]
# 1. installs the wheels carried in the ignored .whl/ folder (torchao) into /tmp/site;
# 2. tests: python3 -m pytest -q -x tests/torch (at most $TEST_TIMEOUT s, default 240);
# 3. bench: python3 -m benchmarks.gpu --out $OUT/gpu.json (sub-benchmarks' JSON beside it).
# Logs go to $OUT (./gpu-out without it): tests.log, bench.log, gpu.txt. One device call runs at
# most 10 minutes: run "tests" and "bench" as two calls, or "all" with --quick.
# Set FP8KIT_COMMIT to the commit hash when the copied tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
case "$mode" in
  all | tests | bench) [ $# -gt 0 ] && shift ;;
  -*) mode=all ;;
  *) echo "gpu_run.sh: mode must be all, tests or bench, got '$mode'" >&2; exit 2 ;;
esac
out="${OUT:-gpu-out}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
status=0
if [ "$mode" != bench ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x tests/torch -p no:cacheprovider 2>&1 \
    | tee "$out/tests.log" | tail -5 || status=$?
fi
if [ "$mode" != tests ]; then
  python3 -m benchmarks.gpu --out "$out/gpu.json" "$@" 2>&1 | tee "$out/bench.log" || status=$?
fi
exit "$status"
