"""Run every benchmark in one process, one after the other (``make bench``)."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = (
    "bench_quantize",
    "bench_dequantize",
    "bench_small_gemm",
    "bench_inspect",
    "bench_training",
    "bench_update",
    "bench_host",
    "bench_cuda_host",
    "bench_memory",
    "bench_reduction",
    "bench_keras",
    "kernel_census",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke-run every benchmark")
    args = parser.parse_args(argv)
    for name in BENCHMARKS:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"\n## {name}\n", flush=True)
        module.main(["--quick"] if args.quick else [])


if __name__ == "__main__":
    main()
