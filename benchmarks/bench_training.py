"""Training-step speed: fp8kit FP8 Linear vs fp32 / bf16 nn.Linear, torchao and the GEMM floor.

Run: ``python -m benchmarks.bench_training`` (``--quick`` for a smoke run with small shapes).

A step is forward + backward + SGD update of a single Linear (4096 tokens x 2048 -> 2048) or an
MLP block (4096 tokens x 1024 -> 4096 -> GELU -> 1024). All variants of a shape are timed in the
same process, round-robin, and reported as medians with ratios to fp32 and to the floor:

- ``fp32 nn.Linear`` / ``bf16 nn.Linear``: plain PyTorch (bf16 is skipped, with the measured
  slowdown, where this CPU has no fast bf16 matmul).
- ``fp8kit delayed``: ``f8.convert_model`` + ``f8.autocast(DelayedScaling())``.
- ``fp8kit current``: the same with ``Float8CurrentScaling()``.
- ``fp8kit delayed, bf16 model``: ``fp8kit delayed`` on the bfloat16 model of the ``bf16
  nn.Linear`` row (bfloat16 parameters, input and gradients; run where that row runs).
- ``torchao Float8Linear`` (tensorwise dynamic scaling; ``_scaled_mm``) and its ``emulate=True``
  mode, when torchao is installed (``pip install torchao``). Skipped with the measured rate where
  ``_scaled_mm`` E4M3 x E4M3 is pathologically slow on this CPU (see docs/decisions/0001).
- ``floor: FP8 GEMMs only``: the same fprop/dgrad/wgrad GEMMs through fp8kit's GEMM entry
  (contract check, layout, CPU backend) on pre-quantized operands: what a step cannot go below.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

import fp8kit.torch as f8
from benchmarks.common import machine_note, markdown_table, round_robin
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from fp8kit.torch.gemm import cpu_gemm_backend, padded_mm

Step = Callable[[], None]


def _layers(kind: str, sizes: dict[str, int]) -> nn.Module:
    if kind == "linear":
        return nn.Linear(sizes["hidden"], sizes["hidden"])
    return nn.Sequential(
        nn.Linear(sizes["hidden"], sizes["ffn"]),
        nn.GELU(),
        nn.Linear(sizes["ffn"], sizes["hidden"]),
    )


def _train_step(
    model: nn.Module, x: torch.Tensor, grad: torch.Tensor, recipe: object | None
) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        if recipe is None:
            y = model(x)
        else:
            with f8.autocast(recipe=recipe):
                y = model(x)
        y.backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _floor_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Step:
    """The FP8 GEMMs of one step on operands quantized once, outside the timing, in the layouts
    the GEMMs read (x, W^T-as-column-major W, dY, dY^T, x^T: what f8.Linear's casts produce)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    gemms = []
    act = x
    for lin in linears:
        g = grad if lin is linears[-1] else torch.randn(act.shape[0], lin.out_features)
        act = act.detach()
        xq = f8.quantize(act, 1.0, e4)
        wq = f8.quantize(lin.weight.detach(), 1.0, e4)
        gq = f8.quantize(g, 1.0, e5)
        xt = f8.quantize(act.t().contiguous(), 1.0, e4)
        wt = f8.quantize(lin.weight.detach().t().contiguous(), 1.0, e4)
        gt = f8.quantize(g.t().contiguous(), 1.0, e5)
        gemms.append((xq, wq.t(), gq, wt.t(), gt, xt.t()))
        act = torch.randn(act.shape[0], lin.out_features)

    def step() -> None:
        for xq, w_cm, gq, wt_cm, gt, x_cm in gemms:
            padded_mm(xq, w_cm, torch.float32)  # fprop: x @ W^T
            padded_mm(gq, wt_cm, torch.float32)  # dgrad: dY @ W
            padded_mm(gt, x_cm, torch.float32)  # wgrad: dY^T @ x

    return step


def _slowdown(dtype_fn: Callable[[], None], fp32_fn: Callable[[], None]) -> float:
    times = round_robin({"probe": dtype_fn, "fp32": fp32_fn}, repeats=3)
    return times["probe"] / times["fp32"]


def _bf16_slowdown(n: int = 512) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    ab, bb = a.bfloat16(), b.bfloat16()
    return _slowdown(lambda: ab @ bb, lambda: a @ b)


def _scaled_mm_slowdown(n: int = 128) -> float:
    a = torch.randn(n, n).to(torch.float8_e4m3fn)
    b = torch.randn(n, n).to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.tensor(1.0)
    fa, fb = torch.randn(n, n), torch.randn(n, n)
    return _slowdown(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32),
        lambda: fa @ fb,
    )


def build_variants(kind: str, sizes: dict[str, int]) -> tuple[dict[str, Step], list[str]]:
    """The step function of every variant that runs here, and notes on those that don't."""
    tokens, hidden = sizes["tokens"], sizes["hidden"]
    x = torch.randn(tokens, hidden, requires_grad=True)  # dX is computed, as inside a network
    grad = torch.randn(tokens, hidden)
    notes: list[str] = []
    torch.manual_seed(0)
    base = _layers(kind, sizes)
    variants: dict[str, Step] = {"fp32 nn.Linear": _train_step(base, x, grad, None)}

    bf16_slow = _bf16_slowdown()
    if bf16_slow < 8:
        variants["bf16 nn.Linear"] = _train_step(
            _layers(kind, sizes).bfloat16(),
            x.detach().bfloat16().requires_grad_(),
            grad.bfloat16(),
            None,
        )
    else:
        notes.append(
            f"bf16 nn.Linear skipped: a bf16 matmul is {bf16_slow:.0f}x slower than "
            "fp32 on this CPU"
        )

    for name, recipe in (
        ("fp8kit delayed", DelayedScaling()),
        ("fp8kit current", Float8CurrentScaling()),
    ):
        torch.manual_seed(0)
        model = f8.convert_model(_layers(kind, sizes))
        variants[name] = _train_step(model, x, grad, recipe)

    if "bf16 nn.Linear" in variants:  # FP8 GEMMs of a bfloat16 model: bfloat16 epilogues
        torch.manual_seed(0)
        model = f8.convert_model(_layers(kind, sizes).bfloat16())
        x16 = x.detach().bfloat16().requires_grad_()
        variants["fp8kit delayed, bf16 model"] = _train_step(
            model, x16, grad.bfloat16(), DelayedScaling()
        )

    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        notes.append("torchao not installed: its rows are skipped (pip install torchao)")
    else:
        sm_slow = _scaled_mm_slowdown()
        if sm_slow < 8:
            model = convert_to_float8_training(_layers(kind, sizes))
            variants["torchao Float8Linear"] = _train_step(model, x, grad, None)
        else:
            notes.append(
                f"torchao Float8Linear (_scaled_mm) skipped: E4M3 _scaled_mm is "
                f"{sm_slow:.0f}x slower than an fp32 matmul on this CPU"
            )
        config = Float8LinearConfig(emulate=True)
        model = convert_to_float8_training(_layers(kind, sizes), config=config)
        variants["torchao Float8Linear emulate"] = _train_step(model, x, grad, None)

    variants["floor: FP8 GEMMs only"] = _floor_step(_layers(kind, sizes), x, grad)
    return variants, notes


SHAPES = {
    "linear": {"tokens": 4096, "hidden": 2048, "ffn": 0},
    "mlp": {"tokens": 4096, "hidden": 1024, "ffn": 4096},
}
QUICK_SHAPES = {
    "linear": {"tokens": 256, "hidden": 256, "ffn": 0},
    "mlp": {"tokens": 256, "hidden": 128, "ffn": 512},
}


def describe(kind: str, sizes: dict[str, int]) -> str:
    if kind == "linear":
        return f"Linear, {sizes['tokens']} tokens x {sizes['hidden']} -> {sizes['hidden']}"
    h, f = sizes["hidden"], sizes["ffn"]
    return f"MLP, {sizes['tokens']} tokens x {h} -> {f} -> GELU -> {h}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (median is reported)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    repeats = 2 if args.quick else args.repeats
    out = [f"Machine: {machine_note()}; FP8 GEMM CPU backend: {cpu_gemm_backend()}", ""]
    for kind, sizes in shapes.items():
        started = time.perf_counter()
        variants, notes = build_variants(kind, sizes)
        times = round_robin(variants, repeats)
        fp32, floor = times["fp32 nn.Linear"], times["floor: FP8 GEMMs only"]
        rows = [
            [name, f"{t * 1e3:.1f}", f"{t / fp32:.2f}x", f"{t / floor:.2f}x"]
            for name, t in times.items()
        ]
        out.append(
            f"### {describe(kind, sizes)} (median of {repeats}, "
            f"{time.perf_counter() - started:.0f} s)"
        )
        out.append(markdown_table(["variant", "ms / step", "vs fp32", "vs floor"], rows))
        out += [f"- {n}" for n in notes]
        out.append("")
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main()
