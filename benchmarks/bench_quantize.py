"""Quantization bandwidth: fp8kit's one-pass kernel vs eager torch vs the memory-copy ceiling.

Run: ``python -m benchmarks.bench_quantize`` (``--quick`` for a smoke run). ``make bench`` sets
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000`` so large blocks are not returned to
the OS and page-faulted again on every allocation; the table header says which were active.

Every variant is timed in the same process, round-robin (one call of each variant per round), so
the machine's load hits them alike; the table shows medians over the rounds. GB/s counts the
bytes a one-pass kernel must move: the input read once plus the FP8 output written
(``N * (itemsize + 1)``; ``+ N`` more for the transposed copy; ``2 * N * itemsize`` for the copy).
The same byte count is used for the two-read variants, so their GB/s is the effective rate.

Variants (E4M3, scale 448/3):
- ``copy float32 (ceiling)``: ``buf.copy_(x)`` of N float32, the memory ceiling every row's
  GB/s is divided by (``x ceiling``); for bfloat16 inputs the bfloat16 copy is shown too.
- ``eager torch, delayed``: fp8kit's pure-torch reference cast (``(x*s).clamp().to(fp8)`` and a
  NaN-ignoring ``abs().amax()``), written out here with torch's amax (``cast_to_fp8_reference``
  now gets its amax from ``nan_ignoring_amax``, which runs the amax kernel).
- ``fp8kit, delayed``: ``cast_to_fp8`` (the native kernel: one read gives data and amax), and
  the same kernel forced to its AVX2 and scalar loops where the CPU has a better one.
- ``eager torch, current scaling``: NaN-ignoring amax in torch, scale, reference cast.
- ``torch amax + kernel cast``: ``quantize_current`` as it was before ``nan_ignoring_amax``
  used the kernel: torch's NaN-ignoring amax (three passes), then the kernel's cast.
- ``fp8kit quantize_current``: as wired today: the amax kernel's pass, then the kernel's cast.
- ``fp8kit, current scaling (2 reads)``: the kernel's amax pass, then its cast: the best that
  current scaling can do, to set against delayed scaling's single read (the same work as
  ``quantize_current`` now, without its ``Float8Tensor`` and reciprocal).
- ``fp8kit, cast + transpose`` / ``eager torch, cast + transpose``: data and its row-major
  transpose (what wgrad needs), native one pass vs reference cast + ``.t().contiguous()``.
- ``fp8kit cast_fp8 ...`` / ``cast_fp8_current``: the kernel API the Linear hot path calls
  (``fp8kit.torch.kernels``): the amax folded into a staging entry, ``scale_inv`` and, with the
  transpose, the bias gradient (column sums) in the same native call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common import ALLOCATOR_ENV, cpu_model, loadavg
from fp8kit.formats import E4M3
from fp8kit.torch import kernels
from fp8kit.torch.quantization import (
    cast_to_fp8,
    cast_to_fp8_reference,
    quantize_current,
)
from fp8kit.torch.scaling import compute_scale


@dataclass
class Variant:
    name: str
    fn: Callable[[], object]
    nbytes: int
    reference: str | None = None  # the eager variant this one is compared with


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring amax in torch (``nan_ignoring_amax``'s fallback)."""
    a = x.abs()
    return torch.where(torch.isnan(a), 0.0, a).amax().to(torch.float32)


def _eager_cast(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference cast with torch's amax: everything in eager torch."""
    return cast_to_fp8_reference(x, scale, E4M3)[0], _torch_amax(x)


def _current_reference(x: torch.Tensor) -> object:
    """Eager current scaling: NaN-ignoring amax pass, scale, then the reference cast."""
    amax = _torch_amax(x)
    scale = compute_scale(amax, torch.ones_like(amax), E4M3.max, margin=0, power_2_scale=False)
    return _eager_cast(x, scale)


def _current_torch_amax(x: torch.Tensor) -> object:
    """``quantize_current`` before: torch's amax pass, then the kernel's cast."""
    amax = _torch_amax(x)
    scale = compute_scale(amax, torch.ones_like(amax), E4M3.max, margin=0, power_2_scale=False)
    return cast_to_fp8(x, scale, E4M3)


def _current_native(x: torch.Tensor) -> object:
    """Current scaling with both reads native: the kernel's amax pass, then its cast."""
    amax = kernels.native_amax(x)
    scale = compute_scale(amax, torch.ones_like(amax), E4M3.max, margin=0, power_2_scale=False)
    return cast_to_fp8(x, scale, E4M3)


def _variants(x: torch.Tensor, transpose: bool) -> list[Variant]:
    """The variants for one input; the first is always the float32 copy (the ceiling)."""
    n, item = x.numel(), x.element_size()
    scale = torch.tensor(448.0 / 3.0)
    x32 = x if x.dtype == torch.float32 else torch.randn(n)
    buf32 = torch.empty_like(x32)
    one_pass = n * (item + 1)
    out = [Variant("copy float32 (ceiling)", lambda: buf32.copy_(x32), 8 * n)]
    if x.dtype != torch.float32:
        buf = torch.empty_like(x)
        out.append(Variant(f"copy {_name(x.dtype)}", lambda: buf.copy_(x), 2 * n * item))
    out += [
        Variant("eager torch, delayed", lambda: _eager_cast(x, scale), one_pass),
        Variant(
            "fp8kit, delayed (1 read)",
            lambda: cast_to_fp8(x, scale, E4M3),
            one_pass,
            "eager torch, delayed",
        ),
    ]
    slot = torch.zeros(4, 3)[0, 1]  # a staging entry, as a state's row
    out.append(
        Variant(
            "fp8kit cast_fp8 (1 read, amax into a staging view)",
            lambda: kernels.cast_fp8(x, scale, E4M3, amax_out=slot),
            one_pass,
            "eager torch, delayed",
        )
    )
    if kernels.native_available():
        for isa in (kernels.ISA_AVX2, kernels.ISA_SCALAR):
            if isa < kernels.native_isa_level():
                label = "AVX2" if isa == kernels.ISA_AVX2 else "scalar"
                out.append(
                    Variant(
                        f"fp8kit, delayed, {label} loop",
                        lambda isa=isa: kernels.native_cast(x, scale, E4M3, isa),
                        one_pass,
                        "eager torch, delayed",
                    )
                )
    out += [
        Variant("eager torch, current scaling", lambda: _current_reference(x), one_pass),
        Variant(
            "torch amax + kernel cast (quantize_current before)",
            lambda: _current_torch_amax(x),
            one_pass,
            "eager torch, current scaling",
        ),
        Variant(
            "fp8kit quantize_current (kernel amax + kernel cast)",
            lambda: quantize_current(x, E4M3),
            one_pass,
            "eager torch, current scaling",
        ),
    ]
    out.append(
        Variant(
            "fp8kit cast_fp8_current (one call: amax pass + cast)",
            lambda: kernels.cast_fp8_current(x, E4M3),
            one_pass,
            "eager torch, current scaling",
        )
    )
    if kernels.native_available():
        out.append(
            Variant(
                "fp8kit, current scaling (kernel amax + kernel cast, 2 reads)",
                lambda: _current_native(x),
                one_pass,
                "eager torch, current scaling",
            )
        )
    if transpose:
        x2 = x.view(-1, 4096) if n % 4096 == 0 else x.view(1, -1)

        def eager_t() -> object:
            data, amax = _eager_cast(x2, scale)
            return data, data.t().contiguous(), amax

        out += [
            Variant("eager torch, cast + transpose", eager_t, n * (item + 2)),
            Variant(
                "fp8kit, cast + transpose (1 read)",
                lambda: kernels.cast_to_fp8_transpose(x2, scale, E4M3),
                n * (item + 2),
                "eager torch, cast + transpose",
            ),
            Variant(
                "fp8kit cast_fp8 transpose + dbias (1 read)",
                lambda: kernels.cast_fp8(x2, scale, E4M3, transpose=True, dbias=True),
                n * (item + 2),
                "eager torch, cast + transpose",
            ),
        ]
    return out


def _measure(variants: list[Variant], repeats: int) -> dict[str, float]:
    """Median seconds per variant; round-robin so load changes hit every variant alike."""
    for v in variants:  # warm-up: first-touch page faults, the native build, lazy imports
        v.fn()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            t0 = time.perf_counter()
            v.fn()
            times[v.name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(sizes: list[int], dtypes: list[torch.dtype], repeats: int, transpose: bool) -> str:
    """Run the benchmark and return the report (markdown)."""
    native = kernels.native_available()
    allocator = {k: os.environ.get(k) for k in ALLOCATOR_ENV}
    active = ", ".join(f"{k}={v}" for k, v in allocator.items() if v is not None) or "none"
    lines = [
        "# fp8kit quantize benchmark",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads",
        f"- native kernel: {'yes, ' + str(kernels.native_isa()) if native else 'NO: '}"
        f"{'' if native else kernels.native_build_error()}",
        f"- allocator env active: {active}"
        + ("" if all(allocator.values()) else " (make bench sets both; see MEASUREMENTS.md)"),
        f"- medians of {repeats} round-robin repeats; load average at start: {loadavg()}",
        "",
        "| input | N | variant | ms | GB/s | x ceiling | speedup vs eager |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = []
    for dtype in dtypes:
        for n in sizes:
            gen = torch.Generator().manual_seed(0)
            x = (torch.randn(n, generator=gen) * 3).to(dtype)
            variants = _variants(x, transpose)
            med = _measure(variants, repeats)
            copy_gbs = variants[0].nbytes / med[variants[0].name] / 1e9
            for v in variants:
                gbs = v.nbytes / med[v.name] / 1e9
                speedup = f"{med[v.reference] / med[v.name]:.1f}x" if v.reference else ""
                lines.append(
                    f"| {_name(dtype)} | {n >> 20}M | {v.name} | "
                    f"{med[v.name] * 1e3:.1f} | {gbs:.1f} | {gbs / copy_gbs:.2f} | {speedup} |"
                )
            delayed = med["fp8kit, delayed (1 read)"]
            ratio = (n * (x.element_size() + 1) / delayed / 1e9) / copy_gbs
            eager = med["eager torch, delayed"] / delayed
            line = (
                f"- {_name(dtype)} {n >> 20}M: delayed quantize at {ratio:.2f} of the copy "
                f"ceiling (target >= 0.50: {'met' if ratio >= 0.5 else 'MISSED'}), "
                f"{eager:.1f}x eager torch (target >= 5x: {'met' if eager >= 5 else 'MISSED'})"
            )
            current = "fp8kit, current scaling (kernel amax + kernel cast, 2 reads)"
            if current in med:
                line += f"; current scaling (2 reads) takes {med[current] / delayed:.2f}x as long"
            summary.append(line)
            del x, variants
    lines += ["", "## Targets", "", *summary, "", f"load average at end: {loadavg()}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small size, 7 repeats")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="sizes in Mi elements (default 16 64)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 9, >= 7)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--no-transpose", action="store_true", help="skip the transpose rows")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes or ([4] if args.quick else [16, 64])
    repeats = args.repeats or (7 if args.quick else 9)
    if repeats < 1 or any(s <= 0 for s in sizes):
        parser.error("--repeats and --sizes must be positive")
    report = run(
        [s << 20 for s in sizes],
        [torch.float32, torch.bfloat16],
        repeats,
        transpose=not args.no_transpose,
    )
    print(report)


if __name__ == "__main__":
    main()
