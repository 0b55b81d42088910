#!/usr/bin/env bash
# bench-gpu on a lent GPU machine (no venv, nothing installable there; docs/benchmarks.md):
#   bash benchmarks/gpu_run.sh [all|tests|bench|bench-sub|lease] [benchmarks.gpu options]
# 1. installs the wheels carried in the ignored .whl/ folder (torchao) into /tmp/site;
# 2. tests: first the CUDA-only tests (compiled Triton kernels bit for bit against the model,
#    CUDA graphs, compiled modes; -v, so each result is in tests.log as it happens), then
#    python3 -m pytest -v tests/torch (at most $TEST_TIMEOUT s, default 330), without the
#    Triton-interpreter tests: the GPU runs the compiled kernels, and Triton 3.6's interpreter
#    fails under numpy >= 2.4 (int() of a 1-element array); last, alone, the whole-GPT CUDA-graph
#    test (a capture that fails could break later CUDA calls);
# 3. bench: python3 -m benchmarks.gpu --only linear,tiny,syncs,cast,gpt --out $OUT/gpu.json
#    (options given after the mode come later and win: "bench --only gpt --gpt large" times
#    the 607M GPT alone);
#    bench-sub: the JAX / Keras / kernel sub-benchmarks (--only sub --out $OUT/gpu-sub.json).
# Logs go to $OUT (./gpu-out without it): tests.log, bench.log, gpu.txt. One device call runs at
# most 10 minutes: run "tests", "bench" and "bench-sub" as three calls, or "all" with --quick.
# lease: everything in one call of at most ~9 minutes, for a session lent 15 minutes of device
#    time in all (the machine's start included): the CUDA-only tests of the default (hardware)
#    FP8 conversion (at most 120 s), bench --quick at 0.45x budgets (at most 180 s), bench-sub
#    (at most 150 s: JAX compiles for minutes), then the same tests with the integer conversion
#    (at most 50 s; ADR 0253) and, in a process of its own because a failed capture could break
#    later CUDA calls, the whole-GPT CUDA-graph test (at most 30 s; ADR 0255); no full test run.
#    Each limit sends SIGKILL 10 s after its SIGTERM (timeout -k): at most 580 s in all, which
#    leaves 20 s of the device call's 600 for nvidia-smi and the wheel install.
#    Times seen on an H200: docs/benchmarks.md, "How to run".
# Set FP8KIT_COMMIT to the commit hash: a copied tree may have no .git, or an older one.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
case "$mode" in
  all | tests | bench | bench-sub | lease) [ $# -gt 0 ] && shift ;;
  -*) mode=all ;;
  *) echo "gpu_run.sh: mode must be all, tests, bench, bench-sub or lease, got '$mode'" >&2; exit 2 ;;
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
gpu_only="test_triton_on_the_gpu or test_real_cuda_graphs or test_cuda_compiled_modes or test_cuda_masked_events_never_sync"
# The CUDA-only tests: a time limit in seconds, then (optional) a -k filter ANDed with them.
gpu_tests() {
  local select="$gpu_only"
  [ -n "${2:-}" ] && select="($gpu_only) and ($2)"
  timeout -k 10 "$1" python3 -m pytest -v -ra tests/torch -k "$select" -p no:cacheprovider 2>&1 \
    | tee -a "$out/tests.log" | tail -30 || status=$?
}
# The benchmarks: a time limit in seconds (0: none), then their extra options.
bench() {
  local limit="$1"; shift
  timeout -k 10 "$limit" python3 -m benchmarks.gpu --only linear,tiny,syncs,cast,gpt \
    --out "$out/gpu.json" "$@" 2>&1 | tee "$out/bench.log" || status=$?
}
bench_sub() {
  local limit="$1"; shift
  timeout -k 10 "$limit" python3 -m benchmarks.gpu --only sub --out "$out/gpu-sub.json" "$@" 2>&1 \
    | tee "$out/bench-sub.log" || status=$?
}
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  gpu_tests 300 "not demo_gpt"
  timeout -k 10 "${TEST_TIMEOUT:-330}" python3 -m pytest -v -ra tests/torch \
    -k "not under_interpreter and not ($gpu_only)" -p no:cacheprovider 2>&1 \
    | tee -a "$out/tests.log" | tail -30 || status=$?
  gpu_tests 30 "demo_gpt"
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  bench 0 "$@"
fi
if [ "$mode" = all ] || [ "$mode" = bench-sub ]; then
  bench_sub 0 "$@"
fi
if [ "$mode" = lease ]; then
  gpu_tests 120 "not software and not demo_gpt"
  bench 180 --quick --budget-scale 0.45 "$@"
  bench_sub 150
  gpu_tests 50 "software"
  gpu_tests 30 "demo_gpt"
fi
exit "$status"
