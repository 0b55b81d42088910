"""Host work of the CUDA route of a tiny FP8 Linear step, measured on the CPU (issue 9, item 3).

On a GPU a small layer's training step is bound by the host: on the H200 of 2026-11-28 a
``Linear(256)`` step took 1152-1612 us of wall time against bf16's 194-299 us
(docs/runs/2026-11-28-h200.md), while its kernels take tens of microseconds. That host time is
fp8kit's Python around the kernels, torch's op dispatch and allocations, autograd, and the
launches themselves. All but the last run the same on any host, so they can be measured here.

This benchmark sends CPU tensors down the route a CUDA tensor takes (the prepared Triton casts,
the Triton update kernel, ``torch._scaled_mm`` GEMMs; as ``tests/torch/cuda_route.py`` does)
with the device work stubbed out: every Triton kernel, once "compiled", hands back a launcher
that returns at once, and ``torch._scaled_mm`` returns an uninitialised output. The tables are
:mod:`benchmarks.bench_host`'s (``nn.Linear``, the FP8 module, the kernels-only floor) on that
route, for 32 x 32 layers, whose real ``nn.Linear`` GEMMs cost the CPU a few microseconds. Not
counted: the Triton launcher's own C work and the CUDA driver's launch calls. One CPU-only
branch stays in: the non-finite watch reads the counts after each event on the CPU (on CUDA it
starts a copy every 8th event). The stubs change global state, so the measurement runs in a
child process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

import fp8kit.torch as f8
from benchmarks import bench_host
from benchmarks.common import machine_note
from fp8kit.torch.kernels import dispatch, triton_cast, triton_update

_TRITON_KERNELS = (
    (triton_cast, ("_cast_1d_kernel", "_cast_2d_kernel", "_dbias_kernel", "_amax_kernel")),
    (triton_update, ("_delayed_update_kernel",)),
)
launches = 0
"""Launches the stubs received (the child's count)."""


def _no_device_work(*args: object) -> None:
    global launches
    launches += 1


class _StubCompiled:
    """What ``kernel[grid](...)`` returns on a GPU, reduced to what
    :mod:`fp8kit.torch.kernels.triton_launch` keeps: a launcher per grid."""

    launch_metadata = None

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return _no_device_work


class _StubKernel:
    """A ``triton.jit`` function whose launches do no device work."""

    def __getitem__(self, grid: object) -> Callable[..., _StubCompiled]:
        def first_launch(*args: object, **options: object) -> _StubCompiled:
            _no_device_work()
            return _StubCompiled()

        return first_launch


def _stub_scaled_mm(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch._scaled_mm``'s output allocation, without the product."""
    return torch.empty(a.shape[0], b.shape[1], dtype=kwargs["out_dtype"])


def route_cpu_tensors_as_cuda() -> None:
    """Send CPU tensors down the CUDA route with stubbed device work (irreversible)."""
    backend = dispatch._load_triton()
    if backend is None:
        raise RuntimeError(f"the Triton backend is unavailable: {dispatch.triton_error()}")
    for module, names in _TRITON_KERNELS:
        for name in names:
            setattr(module, name, _StubKernel())
    dispatch._auto = lambda x: ("triton", backend)  # type: ignore[assignment]
    dispatch.load_native = lambda: None  # type: ignore[assignment]  # no prepared native casts
    torch._scaled_mm = _stub_scaled_mm  # type: ignore[assignment]


def _child(repeats: int) -> str:
    """The tables, measured in this process after :func:`route_cpu_tensors_as_cuda`."""
    route_cpu_tensors_as_cuda()
    # 32 x 32 only: nn.Linear's GEMMs run for real on the CPU, the stubbed ones do not
    samples = {"32 x 32": bench_host.step_times(32, repeats)}
    samples[f"{bench_host.STACK_LAYERS} layers of 32 x 32"] = bench_host.stack_step_times(repeats)
    medians = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in samples.items()}
    best = {n: {k: min(v) for k, v in t.items()} for n, t in samples.items()}
    torch.manual_seed(0)
    x = torch.randn(32, 32, requires_grad=True)
    step = bench_host._training_loops(torch.nn.Linear(32, 32), f8.Linear(32, 32), x, calls=1)
    step["fp8kit delayed"]()  # the first step compiles (here: keeps the stub launchers)
    before = launches
    step["fp8kit delayed"]()
    return (
        f"Machine: {machine_note()}\n\n"
        f"CUDA route, device work stubbed: {launches - before} launches per steady 32 x 32 step "
        f"(Triton kernels; plus 3 torch._scaled_mm)\n\n"
        f"Median of {repeats} rounds:\n\n{bench_host._table(medians)}\n\n"
        f"Best of {repeats} rounds:\n\n{bench_host._table(best)}"
    )


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 15
    if args.child:
        text = _child(repeats)
    else:
        if not dispatch.triton_available():
            text = "triton is not installed: the CUDA route cannot be followed on this machine"
            print(text)
            return text
        env = {**os.environ, "FP8KIT_CPU_GEMM": "scaled_mm", "PYTHONWARNINGS": "ignore"}
        command = [sys.executable, "-m", "benchmarks.bench_cuda_host", "--child"]
        proc = subprocess.run(
            command + (["--quick"] if args.quick else []),
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode:
            raise RuntimeError(f"the measuring child failed:\n{proc.stdout}\n{proc.stderr}")
        text = proc.stdout.rstrip()
    print(text)
    return text


if __name__ == "__main__":
    main()
