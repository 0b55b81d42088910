"""FP8 -> float32 bandwidth (torch's conversion vs fp8kit's native kernel) and the CPU
``"dequant"`` GEMM backend before / after the kernel, against a plain float32 GEMM.

Run: ``python -m benchmarks.bench_dequantize`` (``--quick`` for a smoke run). Every variant of a
table is timed in the same process, round-robin (one call of each per round, see
``benchmarks.common.round_robin``); the tables show medians. On a shared machine read the ratios,
which are measured side by side, not the absolute numbers.

Table 1, ``N`` FP8 elements (default 16Mi), random codes of both formats:
- ``copy float32 (ceiling)``: ``buf.copy_(x)`` of N float32 (8 bytes per element moved);
- ``torch .to(float32)`` vs ``native``: the exact upcast (what ``_dequant_mm`` needs);
- ``torch data.to(float32) * scale_inv`` vs ``native, scaled``: ``Float8Tensor.dequantize()``;
- ``torch (data.to(float32) * scale_inv).to(bfloat16)`` vs ``native, scaled -> bfloat16``.
GB/s counts one read of the FP8 input and one write of the output (``N * (1 + 4)`` bytes,
``N * (1 + 2)`` for bfloat16), the copy ``8 * N``; "x ceiling" divides by the copy's GB/s.

Table 2, ``_dequant_mm`` at M x K x N (default 4096 x 2048 x 2048; A row-major, B
column-major as the scaled_mm contract has them): the plain float32 ``A @ B`` of the same
shape and layouts, the backend before the kernel (torch upcasts), after (``gemm._dequant_mm``),
and the two upcasts alone; "x fp32 mm" divides by the float32 GEMM's time of the same run.

Table 3, the GEMM epilogue (``kernels.gemm_epilogue``: scale, bias, rounding) of an M x N float32
accumulator into float32 / bfloat16 / float16, with each loop this CPU has (``scalar`` is the
only loop before docs/decisions/0258-vector-gemm-epilogue.md) against a float32 copy of the
accumulator; GB/s counts ``4 * M * N`` bytes read and the output written.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.common import machine_note, markdown_table, round_robin
from fp8kit.torch import gemm, kernels
from fp8kit.torch.kernels import native
from fp8kit.torch.quantization import Float8Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.float8_")


def _codes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random finite FP8 values (randn scaled to the format's range, so no NaN/inf codes)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 8).to(dtype)


def bandwidth(n: int, repeats: int) -> str:
    """Table 1: FP8 -> float32 / bfloat16 GB/s, torch vs native, both formats."""
    native = kernels.native_available()
    x32 = torch.randn(n)
    buf = torch.empty_like(x32)
    s = torch.tensor(3.0 / 448.0)
    variants: dict[str, Callable[[], object]] = {"copy float32 (ceiling)": lambda: buf.copy_(x32)}
    nbytes = {"copy float32 (ceiling)": 8 * n}
    rows_of: list[tuple[str, str, str | None]] = []  # (format, variant, the torch variant)
    for dtype in FP8_DTYPES:
        x = _codes((n,), dtype, 1)
        f = _name(dtype)
        pairs: list[tuple[str, Callable[[], object], Callable[[], object], int]] = [
            (
                ".to(float32)",
                lambda x=x: x.to(torch.float32),
                lambda x=x: kernels.native_dequantize(x),
                5 * n,
            ),
            (
                ".to(float32) * scale_inv",
                lambda x=x: x.to(torch.float32) * s,
                lambda x=x: kernels.native_dequantize(x, s),
                5 * n,
            ),
            (
                "(.to(float32) * scale_inv).to(bfloat16)",
                lambda x=x: (x.to(torch.float32) * s).to(torch.bfloat16),
                lambda x=x: kernels.native_dequantize(x, s, torch.bfloat16),
                3 * n,
            ),
        ]
        for label, torch_fn, native_fn, nb in pairs:
            tname = f"{f} torch {label}"
            variants[tname] = torch_fn
            nbytes[tname] = nb
            rows_of.append((f, tname, None))
            if native:
                nname = f"{f} native {label}"
                variants[nname] = native_fn
                nbytes[nname] = nb
                rows_of.append((f, nname, tname))
    med = round_robin(variants, repeats)
    copy_gbs = nbytes["copy float32 (ceiling)"] / med["copy float32 (ceiling)"] / 1e9
    rows: list[list[object]] = [
        ["-", "copy float32 (ceiling)", f"{med['copy float32 (ceiling)'] * 1e3:.1f}",
         f"{copy_gbs:.1f}", "1.00", ""]
    ]  # fmt: skip
    for f, name, ref in rows_of:
        gbs = nbytes[name] / med[name] / 1e9
        speedup = f"{med[ref] / med[name]:.1f}x" if ref else ""
        label = name.removeprefix(f + " ")
        rows.append(
            [f, label, f"{med[name] * 1e3:.1f}", f"{gbs:.2f}", f"{gbs / copy_gbs:.2f}", speedup]
        )
    header = ["format", "variant", "ms", "GB/s", "x ceiling", "native vs torch"]
    return f"### FP8 -> float32, N = {n >> 20}Mi elements\n\n" + markdown_table(header, rows)


def _old_dequant_mm(a: Float8Tensor, b: Float8Tensor) -> torch.Tensor:
    """``_dequant_mm`` as it was before the kernel: torch's upcasts."""
    acc = a.data.to(torch.float32) @ b.data.to(torch.float32)
    return acc.mul_(a.scale_inv.reshape(()) * b.scale_inv.reshape(()))


def _dequant_mm_now(a: Float8Tensor, b: Float8Tensor) -> torch.Tensor:
    """``gemm._dequant_mm`` of the two operands, float32 out, no bias."""
    return gemm._dequant_mm(a.data, b.data, a.scale_inv, b.scale_inv, torch.float32, None)


def gemm_table(m: int, k: int, n: int, repeats: int) -> str:
    """Table 2: ``_dequant_mm`` before / after against the float32 GEMM of the same shape."""
    a32 = torch.randn(m, k)
    b32 = torch.randn(n, k).t()  # (K, N) column-major, as the FP8 operand
    variants: dict[str, Callable[[], object]] = {"float32 mm (A @ B)": lambda: a32 @ b32}
    checks = []
    for fa in FP8_DTYPES:  # E4M3 x E4M3 (forward), E5M2 x E4M3 (backward)
        a = Float8Tensor(_codes((m, k), fa, 2), torch.tensor(0.5))
        b = Float8Tensor(_codes((n, k), torch.float8_e4m3fn, 3).t(), torch.tensor(0.25))
        pair = f"{_name(fa)} x e4m3fn"
        variants[f"{pair}: _dequant_mm before (torch upcasts)"] = lambda a=a, b=b: _old_dequant_mm(
            a, b
        )
        variants[f"{pair}: _dequant_mm now"] = lambda a=a, b=b: _dequant_mm_now(a, b)
        variants[f"{pair}: the two upcasts alone, torch"] = lambda a=a, b=b: (
            a.data.to(torch.float32),
            b.data.to(torch.float32),
        )
        variants[f"{pair}: the two upcasts alone, now"] = lambda a=a, b=b: (
            kernels.dequantize_fp8(a.data),
            kernels.dequantize_fp8(b.data),
        )
        checks.append((a, b))
    for a, b in checks:  # the kernel must not change the result
        if not torch.equal(_dequant_mm_now(a, b), _old_dequant_mm(a, b)):
            raise AssertionError("_dequant_mm changed its result")
    med = round_robin(variants, repeats)
    base = med["float32 mm (A @ B)"]
    rows = [[name, f"{t * 1e3:.1f}", f"{t / base:.3f}"] for name, t in med.items()]
    return f"### _dequant_mm at {m} x {k} x {n}\n\n" + markdown_table(
        ["variant", "ms", "x fp32 mm"], rows
    )


_ISA_LOOPS = {"scalar": kernels.ISA_SCALAR, "avx2": kernels.ISA_AVX2, "avx512": kernels.ISA_AVX512}


def epilogue_table(m: int, n: int, repeats: int) -> str:
    """Table 3: the native GEMM epilogue per output dtype and loop, against a float32 copy."""
    gen = torch.Generator().manual_seed(4)
    acc = torch.randn(m, n, generator=gen) * 100
    work = torch.empty_like(acc)
    bias = torch.randn(n, generator=gen)
    s = torch.tensor(2.0**-7)
    loops = {name: isa for name, isa in _ISA_LOOPS.items() if isa <= kernels.native_isa_level()}
    variants: dict[str, Callable[[], object]] = {"copy float32 (ceiling)": lambda: work.copy_(acc)}
    nbytes = {"copy float32 (ceiling)": 8 * m * n}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out_bytes = m * n * dtype.itemsize
        for name, isa in loops.items():
            # float32 runs in place on a fresh copy (the copy's time is in its row); others
            # read acc and write a new tensor, as in the CPU GEMM
            def fn(isa: int = isa, d: torch.dtype = dtype) -> torch.Tensor:
                src = work.copy_(acc) if d is torch.float32 else acc
                return native.gemm_epilogue(src, s, s, d, bias, isa)

            label = f"{str(dtype).removeprefix('torch.')} + bias, {name}"
            variants[label] = fn
            nbytes[label] = 4 * m * n + out_bytes + (8 * m * n if dtype is torch.float32 else 0)
    med = round_robin(variants, repeats)
    copy_gbs = nbytes["copy float32 (ceiling)"] / med["copy float32 (ceiling)"] / 1e9
    rows = []
    for name, t in med.items():
        gbs = nbytes[name] / t / 1e9
        rows.append([name, f"{t * 1e3:.2f}", f"{gbs:.1f}", f"{gbs / copy_gbs:.2f}"])
    return f"### GEMM epilogue, {m} x {n} float32 accumulator\n\n" + markdown_table(
        ["output, loop", "ms", "GB/s", "x ceiling"], rows
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repeats")
    parser.add_argument("--size", type=int, default=None, help="Mi elements (default 16)")
    parser.add_argument("--mkn", type=int, nargs=3, default=None, help="GEMM M K N")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 9)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = args.size or (1 if args.quick else 16)
    m, k, n = args.mkn or ((512, 256, 256) if args.quick else (4096, 2048, 2048))
    repeats = args.repeats or (3 if args.quick else 9)
    if repeats < 1 or size <= 0 or min(m, k, n) <= 0:
        parser.error("--repeats, --size and --mkn must be positive")
    native = kernels.native_isa() if kernels.native_available() else "NO"
    print("# fp8kit dequantize benchmark\n")
    print(f"- machine: {machine_note()}")
    print(f"- native kernel: {native}; medians of {repeats} round-robin rounds\n")
    print(bandwidth(size << 20, repeats), end="\n\n")
    print(gemm_table(m, k, n, repeats))
    if kernels.native_available():
        print("\n" + epilogue_table(m, n, repeats))
    print(f"\n- load at end: {machine_note().split('load average ')[1].split(',')[0]}")


if __name__ == "__main__":
    main()
