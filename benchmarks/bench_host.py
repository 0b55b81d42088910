"""Host overhead of a tiny FP8 Linear training step vs ``nn.Linear`` (issue 9, item 3).

At these sizes the GEMMs cost little, so the ratio is the Python and launch work around the
kernels. A third variant, "kernels only", runs the same FP8 step (three casts, three GEMMs, two
update events) from fp8kit's kernel API inside a bare autograd Function, with nothing else: the
floor any frontend built on these kernel calls can reach. A stack of eight 32 x 32 layers in one
autocast (no floor) shows the cost per layer once the autocast and the update events are shared,
as in a real model. A last table times a 64 x 64 step eager and under ``torch.compile``
(fullgraph): the compiled FP8 module's host time (ADR 0254). All are timed round-robin in one
process; the tables give the median and the best of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

import fp8kit.torch as f8
from benchmarks.common import machine_note, markdown_table, round_robin_samples
from fp8kit.formats import E4M3, E5M2
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import kernels
from fp8kit.torch.gemm import fp8_gemm_bias_t
from fp8kit.torch.state import ScalingState


class _KernelsOnly(torch.autograd.Function):
    """``x @ w.T + b`` in FP8 from kernel calls alone (delayed scaling, E4M3 / E5M2 slots)."""

    @staticmethod
    def forward(ctx, x, w, b, casts):  # type: ignore[no-untyped-def, override]
        qx, qw = casts[0](x, True, False), casts[1](w, True, False)
        y = fp8_gemm_bias_t(qx.data, qw.data, qx.scale_inv, qw.scale_inv, x.dtype, b)
        ctx.save_for_backward(qx.data_t, qw.data_t, qx.scale_inv, qw.scale_inv)
        ctx.cast_dy = casts[2]
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def, override]
        x_t, w_t, sx, sw = ctx.saved_tensors
        qdy = ctx.cast_dy(dy.contiguous(), True, True)
        dx = fp8_gemm_bias_t(qdy.data, w_t, qdy.scale_inv, sw, dy.dtype, None)
        dw = fp8_gemm_bias_t(qdy.data_t, x_t, qdy.scale_inv, sx, dy.dtype, None)
        return dx, dw, qdy.dbias, None


def _kernels_only_step(fp8: f8.Linear, x: torch.Tensor) -> Callable[[], None]:
    """One training step of ``fp8``'s parameters through :class:`_KernelsOnly`, with a forward
    and a backward update event (prepared, as the modules' steady state)."""
    state = {d: ScalingState(n, history_len=16) for d, n in (("fwd", 2), ("bwd", 1))}
    slots = ((state["fwd"], 0, E4M3), (state["fwd"], 1, E4M3), (state["bwd"], 0, E5M2))
    casts = [
        kernels.prepare_cast(s.scale[i : i + 1], dtype, amax_out=s.amax_history[0, i : i + 1])
        for s, i, dtype in slots
    ]
    events = [
        kernels.prepare_delayed_update(
            s.amax_history, s.scale, s.scale_inv, s.update_count, fmax=fmax
        )
        for s, fmax in ((state["fwd"], E4M3.max), (state["bwd"], E5M2.max))
    ]

    def step() -> None:
        y = _KernelsOnly.apply(x, fp8.weight, fp8.bias, casts)
        events[0]()
        y.sum().backward()
        events[1]()

    return step


def _training_loops(
    base: torch.nn.Module, fp8: torch.nn.Module, x: torch.Tensor, calls: int
) -> dict[str, Callable[[], None]]:
    """``calls`` training steps of ``base`` (plain) and of ``fp8`` (in an autocast per step)."""
    recipe = DelayedScaling(amax_history_len=16)

    def plain() -> None:
        for _ in range(calls):
            base(x).sum().backward()

    def fp8_step() -> None:
        for _ in range(calls):
            with f8.autocast(recipe=recipe):
                y = fp8(x)
            y.sum().backward()

    return {"nn.Linear": plain, "fp8kit delayed": fp8_step}


def _us_per_step(
    variants: dict[str, Callable[[], None]], repeats: int, calls: int
) -> dict[str, list[float]]:
    samples = round_robin_samples(variants, repeats, warmup=2)
    return {name: [s / calls * 1e6 for s in values] for name, values in samples.items()}


def step_times(size: int, repeats: int, calls: int = 20) -> dict[str, list[float]]:
    """Microseconds per training step of ``nn.Linear``, ``f8.Linear`` and the kernels-only
    floor (size x size), one value per round (interleaved rounds of ``calls`` steps each)."""
    torch.manual_seed(0)
    x = torch.randn(size, size, requires_grad=True)
    base, fp8 = torch.nn.Linear(size, size), f8.Linear(size, size)
    variants = _training_loops(base, fp8, x, calls)
    floor_step = _kernels_only_step(fp8, x)

    def floor() -> None:
        for _ in range(calls):
            floor_step()

    return _us_per_step({**variants, "kernels only": floor}, repeats, calls)


STACK_LAYERS = 8


def stack_step_times(repeats: int, calls: int = 5) -> dict[str, list[float]]:
    """Microseconds per training step of :data:`STACK_LAYERS` 32 x 32 ``nn.Linear`` and
    ``f8.Linear`` layers in sequence (one autocast, one update event per direction), one value
    per round."""
    torch.manual_seed(0)
    x = torch.randn(32, 32, requires_grad=True)
    base = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(STACK_LAYERS)])
    fp8 = torch.nn.Sequential(*[f8.Linear(32, 32) for _ in range(STACK_LAYERS)])
    return _us_per_step(_training_loops(base, fp8, x, calls), repeats, calls)


COMPILED_SIZE = 64


def compiled_step_times(size: int, repeats: int, calls: int = 20) -> dict[str, list[float]]:
    """Microseconds per training step of ``nn.Linear`` and ``f8.Linear`` (size x size), eager
    and under ``torch.compile(fullgraph=True)`` (the autocast around the compiled module, as
    docs/decisions/0233-torch-compile.md asks), one value per round."""
    torch.manual_seed(0)
    x = torch.randn(32, size, requires_grad=True)
    base, fp8 = torch.nn.Linear(size, size), f8.Linear(size, size)
    eager = _training_loops(base, fp8, x, calls)
    torch._dynamo.reset()
    compiled = _training_loops(
        torch.compile(base, fullgraph=True, dynamic=False),
        torch.compile(fp8, fullgraph=True, dynamic=False),
        x,
        calls,
    )
    variants = {**eager, **{f"{name} compiled": fn for name, fn in compiled.items()}}
    return _us_per_step(variants, repeats, calls)


def _compiled_table(times: dict[str, float]) -> str:
    header = ["variant", "us / step", "/ nn.Linear eager", "/ same model eager"]
    rows = []
    for name, us in times.items():
        eager = times[name.removesuffix(" compiled")]
        rows.append([name, f"{us:.0f}", f"{us / times['nn.Linear']:.2f}x", f"{us / eager:.2f}x"])
    return markdown_table(header, rows)


def _table(times: dict[str, dict[str, float]]) -> str:
    header = ["Linear", "nn.Linear us / step", "fp8kit us / step", "kernels only us / step",
              "fp8kit / nn.Linear", "kernels only / nn.Linear"]  # fmt: skip
    rows = []
    for label, t in times.items():
        base, ours, floor = t["nn.Linear"], t["fp8kit delayed"], t.get("kernels only")
        rows.append([label, f"{base:.0f}", f"{ours:.0f}",
                     "-" if floor is None else f"{floor:.0f}", f"{ours / base:.2f}x",
                     "-" if floor is None else f"{floor / base:.2f}x"])  # fmt: skip
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 15
    samples = {f"{n} x {n}": step_times(n, repeats) for n in (32, 256)}
    samples[f"{STACK_LAYERS} layers of 32 x 32"] = stack_step_times(repeats)
    medians = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in samples.items()}
    best = {n: {k: min(v) for k, v in t.items()} for n, t in samples.items()}
    compiled = compiled_step_times(COMPILED_SIZE, repeats)
    text = (
        f"Machine: {machine_note()}\n\n"
        f"Median of {repeats} rounds:\n\n{_table(medians)}\n\n"
        f"Best of {repeats} rounds (less disturbed by other load on a shared machine):\n\n"
        f"{_table(best)}\n\n"
        f"torch.compile(fullgraph=True), {COMPILED_SIZE} x {COMPILED_SIZE} (32 rows), median of "
        f"{repeats} rounds:\n\n"
        f"{_compiled_table({k: statistics.median(v) for k, v in compiled.items()})}"
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
