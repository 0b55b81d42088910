"""The FP8 kernels on a CUDA GPU: bandwidth against a copy, the update event, host time per call.

Run: ``python -m benchmarks.gpu_kernels [--out results.json]`` (or call :func:`main`). On a
machine without CUDA it prints a message and returns ``{}``.

What it measures (``docs/decisions/0210-kernel-api-and-dispatch.md`` has the targets):

- ``bandwidth``: for bfloat16 and float32 inputs of 64M elements (8192 x 8192), the median time
  (CUDA events) of ``dst.copy_(x)`` and of each cast variant, the cast's bytes moved (input read
  once, each FP8 output written once) per second, and that rate divided by the copy's (bytes
  read + written per second): ``x copy``. Issue 9's targets on an H100 with bfloat16: cast+amax
  >= 0.85, cast+transpose(+dbias) >= 0.75. The torch reference of the same call is timed too,
  and on sm_89+ the Triton casts again with the integer FP8 conversion ("integer cvt").
- ``update``: one ``delayed_update_`` event on the states of 1000 Linear modules (N = 3000
  forward slots) for history lengths 16 and 1024, Triton kernel and torch reference.
- ``host``: wall time per call on tiny tensors (the GPU is idle, so this is the Python and
  launch cost), and the CUDA kernels each call launches (profiler count).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_common import device_event_kind, kernel_ms
from fp8kit.torch import kernels
from fp8kit.torch.kernels import triton_cast

_E4M3 = torch.float8_e4m3fn
_N_ELEMENTS = 64 << 20
_SIDE = 8192  # 8192 x 8192 = 64M
_TRITON_CASTS = ("cast+amax", "cast+transpose+amax", "cast+transpose+dbias+amax")


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Wall microseconds per call, the GPU kept idle (tiny tensors), synchronised at the end."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _kernels_per_call(fn: Callable[[], object]) -> int:
    """CUDA kernels (and memsets) one call launches, counted with the profiler."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if device_event_kind(e) == "kernel"
        or (device_event_kind(e) == "copy" and not e.name.startswith("Memcpy"))
    )


def _bandwidth(dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(_SIDE, _SIDE, device="cuda", generator=gen) * 3).to(dtype)
    n, item = x.numel(), x.element_size()
    dst = torch.empty_like(x)
    scale = torch.tensor(448.0 / 3.0, device="cuda")
    staging = torch.zeros(16, 3, device="cuda")
    slot = staging[0, 0]
    copy_ms = kernel_ms(lambda: dst.copy_(x), repeats)
    copy_rate = 2 * n * item / copy_ms / 1e6  # GB/s, bytes read + written
    triton = "triton"  # named: a failing kernel raises instead of timing the torch fallback
    variants: dict[str, tuple[Callable[[], object], int]] = {
        "cast+amax": (
            lambda: kernels.cast_fp8(x, scale, _E4M3, amax_out=slot, backend=triton),
            n * (item + 1),
        ),
        "cast+transpose+amax": (
            lambda: kernels.cast_fp8(
                x, scale, _E4M3, transpose=True, amax_out=slot, backend=triton
            ),
            n * (item + 2),
        ),
        "cast+transpose+dbias+amax": (
            lambda: kernels.cast_fp8(
                x, scale, _E4M3, transpose=True, dbias=True, amax_out=slot, backend=triton
            ),
            n * (item + 2),
        ),
        "current scaling cast+transpose (2 reads)": (
            lambda: kernels.cast_fp8_current(x, _E4M3, transpose=True, backend=triton),
            n * (2 * item + 2),  # both reads of x counted
        ),
        "reference cast+transpose+dbias (torch)": (
            lambda: kernels.cast_fp8(
                x, scale, _E4M3, transpose=True, dbias=True, amax_out=slot, backend="reference"
            ),
            n * (item + 2),
        ),
    }

    def row(fn: Callable[[], object], nbytes: int) -> dict[str, float]:
        ms = kernel_ms(fn, repeats)
        rate = nbytes / ms / 1e6
        return {"ms": ms, "GB/s": rate, "x copy": rate / copy_rate}

    rows = {"copy": {"ms": copy_ms, "GB/s": copy_rate}}
    rows.update({name: row(fn, nbytes) for name, (fn, nbytes) in variants.items()})
    # the same Triton casts with the integer FP8 conversion (what GPUs below sm_89 run), side
    # by side with the hardware one (ADR 0253)
    hardware = triton_cast.set_hardware_conversion(x.device, False)
    try:
        if hardware:
            for name in _TRITON_CASTS:
                rows[f"{name} (integer cvt)"] = row(*variants[name])
    finally:
        triton_cast.set_hardware_conversion(x.device, hardware)
    return {"dtype": str(dtype).removeprefix("torch."), "elements": n, "rows": rows}


def _update(length: int, repeats: int) -> dict[str, Any]:
    n = 3 * 1000  # forward slots of 1000 Linear modules
    gen = torch.Generator(device="cuda").manual_seed(1)
    history = torch.rand(length, n, device="cuda", generator=gen)
    scale = torch.ones(n, device="cuda")
    scale_inv = torch.ones(n, device="cuda")
    count = torch.zeros(n, dtype=torch.int64, device="cuda")
    staging = torch.rand(n, device="cuda", generator=gen) + 0.5  # every slot ran
    out = {"L": length, "N": n}
    for backend in ("triton", "reference"):

        def event(backend: str = backend) -> None:
            kernels.delayed_update_(
                history, scale, scale_inv, count, fmax=448.0, staging=staging, backend=backend
            )

        out[f"{backend} ms"] = kernel_ms(event, repeats)
        out[f"{backend} kernels"] = _kernels_per_call(event)
    return out


def _host() -> dict[str, Any]:
    x = torch.randn(16, 16, device="cuda").to(torch.bfloat16)
    scale = torch.tensor(2.0, device="cuda")
    staging = torch.zeros(16, 3, device="cuda")
    slot = staging[0, 0]
    count = torch.zeros(3, dtype=torch.int64, device="cuda")
    first = count[0]
    history = torch.rand(16, 3, device="cuda")
    scale3, inv3 = torch.ones(3, device="cuda"), torch.ones(3, device="cuda")
    calls: dict[str, Callable[[], object]] = {
        "cast_fp8 (amax_out)": lambda: kernels.cast_fp8(x, scale, _E4M3, amax_out=slot),
        "cast_fp8 (amax result)": lambda: kernels.cast_fp8(x, scale, _E4M3),
        "cast_fp8 transpose (amax_out)": lambda: kernels.cast_fp8(
            x, scale, _E4M3, transpose=True, amax_out=slot
        ),
        "cast_fp8 transpose+dbias (amax_out)": lambda: kernels.cast_fp8(
            x, scale, _E4M3, transpose=True, dbias=True, amax_out=slot
        ),
        "cast_fp8 first step (amax_out)": lambda: kernels.cast_fp8(
            x, scale, _E4M3, amax_out=slot, first_step_current=first
        ),
        "cast_fp8_current transpose": lambda: kernels.cast_fp8_current(x, _E4M3, transpose=True),
        "compute_amax (amax_out)": lambda: kernels.compute_amax(x, amax_out=slot),
        "delayed_update_": lambda: kernels.delayed_update_(
            history, scale3, inv3, count, fmax=448.0
        ),
        "baseline: one aten op (x.abs())": lambda: x.abs(),
        "baseline: reference cast_fp8 (torch)": lambda: kernels.cast_fp8(
            x, scale, _E4M3, amax_out=slot, backend="reference"
        ),
    }
    return {
        name: {"host us": host_us(fn), "kernels": _kernels_per_call(fn)}
        for name, fn in calls.items()
    }


def _print_report(results: dict[str, Any]) -> None:
    print(f"# fp8kit GPU kernels on {results['device']} (torch {results['torch']})")
    print("\n| input | variant | ms | GB/s | x copy |\n|---|---|---|---|---|")
    for block in results["bandwidth"]:
        for name, row in block["rows"].items():
            ratio = f"{row['x copy']:.2f}" if "x copy" in row else ""
            print(f"| {block['dtype']} | {name} | {row['ms']:.3f} | {row['GB/s']:.0f} | {ratio} |")
    print("\n| update event | L | N | Triton ms (kernels) | torch ms (kernels) |")
    print("|---|---|---|---|---|")
    for row in results["update"]:
        print(
            f"| delayed_update_ | {row['L']} | {row['N']} | {row['triton ms']:.3f} "
            f"({row['triton kernels']}) | {row['reference ms']:.3f} ({row['reference kernels']}) |"
        )
    print("\n| call (tiny tensors) | host us | CUDA kernels |\n|---|---|---|")
    for name, row in results["host"].items():
        print(f"| {name} | {row['host us']:.1f} | {row['kernels']} |")


def main(out_json_path: str | None = None, repeats: int = 20) -> dict[str, Any]:
    """Measure, print a report, save it as JSON to ``out_json_path`` (if given), return it."""
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here, nothing to measure")
        return {}
    if kernels.backend_for(torch.empty(1, device="cuda")) != "triton":
        print("gpu_kernels: triton is unavailable, so the kernels would run in torch")
        return {}
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "bandwidth": [_bandwidth(d, repeats) for d in (torch.bfloat16, torch.float32)],
        "update": [_update(length, repeats) for length in (16, 1024)],
        "host": _host(),
    }
    _print_report(results)
    if out_json_path is not None:
        with open(out_json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per variant")
    args = parser.parse_args()
    main(args.out, args.repeats)
