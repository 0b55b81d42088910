"""Where one step's time goes on a GPU: host functions and device kernels (docs/benchmarks.md).

``make bench-gpu`` says how fast a step is; this says why, for the steps it finds slow:

- ``host``: cProfile of steps of a Linear(256) training step and of the demo GPT (6 x 512), the
  functions with the most own time (the host overhead of a small step is Python and launches);
- ``calls``: wall microseconds per call of single operations the step is made of, on tiny
  tensors (:func:`benchmarks.gpu_kernels.host_us`: the device idles, so this is host time);
- ``kernels``: ``torch.profiler``'s device-time table of one Linear step per shape, eager and
  compiled.

Writes ``profile-<part>.txt`` under ``--out-dir`` and prints the top of each. Without CUDA it
prints one line and exits 0. Run: ``PYTHONPATH=$PWD python3 -m benchmarks.gpu_profile``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.gpu import GPT_SIZES
from benchmarks.gpu_kernels import host_us
from benchmarks.gpu_measure import (
    DELAYED,
    Step,
    compiled,
    fp8_linear_like,
    gpt_training_step,
    training_step,
)
from fp8kit.torch import kernels

TINY = 256
HOST_STEPS = 200
CALLS = 2000
SMALL_GPT = next(iter(GPT_SIZES))  # the size bench-gpu --quick times
KERNEL_SHAPES = ((4096, 1024, 1024), (16384, 4096, 4096))
PARTS = ("host", "calls", "kernels")


def host_profile(step: Step, steps: int, top: int = 30) -> str:
    """cProfile of ``steps`` calls of ``step`` after 5 warm-up calls: the ``top`` functions by
    own time (``tottime``), then by cumulative time."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    wall_us = (time.perf_counter() - start) / steps * 1e6
    text = io.StringIO()
    text.write(f"{steps} steps, {wall_us:.0f} us per step under cProfile\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def host_part() -> str:
    base = nn.Linear(TINY, TINY, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TINY, TINY, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TINY, TINY, device="cuda", dtype=torch.bfloat16)
    parts = [
        "## bf16 nn.Linear(256) step\n"
        + host_profile(training_step(base, x, dy, None), HOST_STEPS),
        "## fp8kit delayed Linear(256) step\n"
        + host_profile(training_step(fp8_linear_like(base), x, dy, DELAYED), HOST_STEPS),
        f"## {SMALL_GPT} step, fp8kit delayed\n"
        + host_profile(gpt_training_step(*GPT_SIZES[SMALL_GPT], DELAYED)[0], 20),
    ]
    return "\n".join(parts)


def calls_part() -> str:
    x = torch.randn(TINY, TINY, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(TINY, TINY, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(TINY, TINY, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    e4m3 = torch.float8_e4m3fn
    bound = kernels.prepare_cast(one, e4m3)
    calls: dict[str, Callable[[], object]] = {
        "torch.empty(256, 256)": lambda: torch.empty(TINY, TINY, device="cuda"),
        "x.mul(2) (one aten kernel)": lambda: x.mul(2),
        "x.to(float8_e4m3fn)": lambda: x.to(e4m3),
        "torch._scaled_mm 256^3": lambda: torch._scaled_mm(
            a, b, one, one, out_dtype=torch.bfloat16
        ),
        "kernels.cast_fp8(x) (Triton)": lambda: kernels.cast_fp8(x, one, e4m3),
        "kernels.cast_fp8(x, transpose) (Triton)": lambda: kernels.cast_fp8(
            x, one, e4m3, transpose=True
        ),
        "prepare_cast(...)(x) (bound Triton)": lambda: bound(x, False, False),
        "cast_fp8(x, backend=reference)": lambda: kernels.cast_fp8(
            x, one, e4m3, backend="reference"
        ),
    }
    lines = ["| call | host us |", "|---|---|"]
    lines += [f"| {name} | {host_us(call, CALLS):.1f} |" for name, call in calls.items()]
    return "\n".join(lines)


def kernel_table(step: Step) -> str:
    """``torch.profiler``'s table of one ``step`` (after 3 warm-up steps), by device time."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=22)


def kernels_part() -> str:
    parts = []
    for m, k, n in KERNEL_SHAPES:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        base = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        for name, module in (
            ("eager", fp8_linear_like(base)),
            ("compiled", compiled(fp8_linear_like(base))),
        ):
            table = kernel_table(training_step(module, x, dy, DELAYED))
            parts.append(f"## {m}x{k}x{n} fp8kit delayed {name}, 3 steps\n{table}")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out-dir", default="gpu-out", help="folder for profile-<part>.txt")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    args = parser.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--only takes a comma-separated list of {PARTS}, got {args.only!r}")
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_profile profiles GPU steps only")
        return
    runners = {"host": host_part, "calls": calls_part, "kernels": kernels_part}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:
        start = time.perf_counter()
        try:
            text = runners[part]()
        except Exception as exc:  # one failing part must not lose the others
            text = f"failed: {type(exc).__name__}: {exc}"
        (out / f"profile-{part}.txt").write_text(text)
        print(f"\n# {part} ({time.perf_counter() - start:.0f} s)\n{text[:3500]}", flush=True)


if __name__ == "__main__":
    main()
