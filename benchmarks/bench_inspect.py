"""The numerics inspector's cost per observed cast on the CPU: ``kernels.cast_error_sums`` in one
native pass vs the same statistics in torch ops, beside the cast itself
(docs/decisions/0256-native-cast-error-sums.md).

Run: ``python -m benchmarks.bench_inspect`` (``--quick`` for a smoke run). For each input shape
and dtype, timed round-robin in one process (medians): the delayed-scaling cast with its
transpose (``kernels.cast_fp8``, what the Linear's input slot runs), the error sums with
``backend="native"`` and with ``backend="reference"`` (torch ops, float32 and float64
temporaries), and ``inspect.cast_statistics`` (the native sums plus the amax and scale fields).
Ratios divide by the cast's time of the same run.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import machine_note, markdown_table, round_robin
from fp8kit.formats import E4M3
from fp8kit.torch import kernels
from fp8kit.torch.inspect import cast_statistics
from fp8kit.torch.quantization import Float8Tensor

SHAPES = ((1024, 128), (1024, 512), (4096, 1024))
DTYPES = (torch.float32, torch.bfloat16)


def times_us(shape: tuple[int, int], dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Median microseconds per call of the cast, both error-sum backends and the statistics."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    s = torch.tensor(8.0)
    cast = kernels.cast_fp8(x, s, torch.float8_e4m3fn)
    q = Float8Tensor(cast.data, cast.scale_inv, amax=cast.amax)
    variants = {
        "cast + transpose": lambda: kernels.cast_fp8(x, s, torch.float8_e4m3fn, transpose=True),
        "sums, native": lambda: kernels.cast_error_sums(
            x, cast.data, s, cast.scale_inv, E4M3.max, backend="native"
        ),
        "sums, torch ops": lambda: kernels.cast_error_sums(
            x, cast.data, s, cast.scale_inv, E4M3.max, backend="reference"
        ),
        "cast_statistics": lambda: cast_statistics(x, q, s, E4M3.max),
    }
    return {name: t * 1e6 for name, t in round_robin(variants, repeats).items()}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few rounds")
    args = parser.parse_args(argv)
    if not kernels.native_available():
        text = f"benchmarks.bench_inspect: no native kernel ({kernels.native_build_error()})"
        print(text)
        return text
    shapes, repeats = (((256, 64),), 3) if args.quick else (SHAPES, 15)
    rows = []
    for shape in shapes:
        for dtype in DTYPES:
            t = times_us(shape, dtype, repeats)
            cast = t["cast + transpose"]
            rows.append(
                [f"{shape[0]} x {shape[1]}", str(dtype).removeprefix("torch."), f"{cast:.0f}",
                 f"{t['sums, native']:.0f}", f"{t['sums, torch ops']:.0f}",
                 f"{t['cast_statistics']:.0f}",
                 f"{t['sums, torch ops'] / t['sums, native']:.1f}x",
                 f"{t['cast_statistics'] / cast:.2f}x"]
            )  # fmt: skip
    header = ["x", "dtype", "cast + transpose us", "sums native us", "sums torch ops us",
              "cast_statistics us", "torch ops / native", "cast_statistics / cast"]  # fmt: skip
    text = (
        f"Machine: {machine_note()}\n\n"
        f"Inspector statistics per E4M3 cast, median of {repeats} rounds:\n\n"
        f"{markdown_table(header, rows)}"
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
