"""The CPU's one-call small FP8 GEMM vs its upcast + ``torch.mm`` + epilogue route, per shape.

Both compute the same FP8 GEMM (float32 accumulation, bias fused, float32 output); they differ
only in the order of the float32 sums and in how many calls they take. The crossover fixes
``fp8kit.torch.gemm.SMALL_GEMM_MACS`` (docs/decisions/0236-small-cpu-fp8-gemm.md). Timed
round-robin in one process, median of rounds.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import machine_note, markdown_table, round_robin
from fp8kit.torch import gemm, kernels

SHAPES = ((32, 32, 32), (64, 64, 64), (64, 128, 128), (128, 128, 128), (256, 256, 256))


def gemm_times(m: int, k: int, n: int, repeats: int) -> dict[str, float]:
    """Median microseconds per (m, k) x (k, n) GEMM of each route."""
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=gen) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn).t()
    sa, sb, bias = torch.tensor(0.5), torch.tensor(0.25), torch.randn(n, generator=gen)
    calls = max(1, 2_000_000 // (m * n * k))

    def small() -> None:
        for _ in range(calls):
            kernels.small_fp8_gemm(a, b, sa, sb, torch.float32, bias=bias)

    def upcast_mm() -> None:
        for _ in range(calls):
            gemm._upcast_mm(a, b, sa, sb, torch.float32, bias)  # the route above the threshold

    seconds = round_robin({"small": small, "upcast + mm": upcast_mm}, repeats, warmup=2)
    return {name: s / calls * 1e6 for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds")
    args = parser.parse_args(argv)
    if not kernels.native_available():
        text = f"native kernel unavailable ({kernels.native_build_error()}): nothing to compare"
        print(text)
        return text
    repeats = 3 if args.quick else 21
    rows = []
    for m, k, n in SHAPES:
        t = gemm_times(m, k, n, repeats)
        route = "small" if m * k * n <= gemm.SMALL_GEMM_MACS else "upcast + mm"
        small, upcast = t["small"], t["upcast + mm"]
        rows.append([f"{m} x {k} x {n}", f"{m * k * n:,}", f"{small:.1f}", f"{upcast:.1f}",
                     f"{small / upcast:.2f}", route])  # fmt: skip
    header = ["M x K x N", "MACs", "small us", "upcast + mm us", "small / upcast", "fp8kit uses"]
    text = f"Machine: {machine_note()}\n\n" + markdown_table(header, rows)
    print(text)
    return text


if __name__ == "__main__":
    main()
