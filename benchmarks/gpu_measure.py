"""How ``make bench-gpu`` builds and measures a step: CUDA-event and wall clocks, profiler
counts, host-sync counts, and the modules it times (bf16, fp8kit, torchao, the 3-GEMM floor).

Only fp8kit's public API is used (``fp8kit.torch``); the internal kernels package is looked up
per call (:func:`kernels_cast_transpose`). The functions taking a ``device`` run on the CPU too
(``tests/test_benchmarks.py`` checks them there); the clocks need CUDA.
"""

from __future__ import annotations

import importlib
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fp8kit.torch as f8
from benchmarks.gpu_common import count_profile_events, repeats_for
from fp8kit.demo.model import GPT, GPTConfig

DELAYED = f8.DelayedScaling()  # Transformer Engine's defaults: HYBRID, history 1024, "max"
CURRENT = f8.Float8CurrentScaling()
Step = Callable[[], object]

# ---------------------------------------------------------------------------------------------
# Clocks and counters


def cuda_time_ms(step: Step, warmup: int = 3, target_ms: float = 1000.0) -> float:
    """Median milliseconds per ``step`` from CUDA events around each of N back-to-back runs
    (no host wait between them, as in a training loop); N from a first timed run so that the
    cell measures for about ``target_ms`` (10 to 100 runs). Warm-up runs (compilation included)
    are not timed."""
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    step()
    end.record()
    end.synchronize()
    n = repeats_for(start.elapsed_time(end), target_ms)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(n)
    ]
    for begin, finish in events:
        begin.record()
        step()
        finish.record()
    torch.cuda.synchronize()
    return statistics.median(begin.elapsed_time(finish) for begin, finish in events)


def wall_us(step: Step, warmup: int = 10, target_ms: float = 1000.0) -> float:
    """Wall microseconds per ``step`` (``time.perf_counter`` over 20-500 steps, the device
    synchronised before and after)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    n = repeats_for((time.perf_counter() - start) / 5 * 1e3, target_ms, lo=20, hi=500)
    start = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def profile_counts(step: Step, warmup: int = 3) -> dict[str, int]:
    """Kernels, copies and aten calls of one ``step`` after ``warmup`` (see
    :func:`benchmarks.gpu_common.count_profile_events`)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    return count_profile_events(prof.events())


def count_syncs(step: Step) -> int:
    """Host synchronisations ``torch.cuda.set_sync_debug_mode("warn")`` reports in one ``step``
    (warnings raised in the autograd engine's thread are replayed to the caller)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def strict_step(step: Step) -> str:
    """Run ``step`` under ``set_sync_debug_mode("error")``: "pass", or "fail: <the error>"."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "pass"
    except Exception as exc:  # the sync error (or any other) is the result
        return f"fail: {' '.join(str(exc).split())[:160]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------------------
# Modules and steps


def training_step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: Any) -> Step:
    """``module(x).backward(dy)`` (inside ``f8.autocast(recipe)`` unless ``recipe`` is None), the
    gradients of ``x`` and of the parameters set to None first (no accumulation kernels)."""
    leaves = [x, *module.parameters()]

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        if recipe is None:
            y = module(x)
        else:
            with f8.autocast(recipe=recipe):
                y = module(x)
        y.backward(dy)

    return step


GPT_MODES = ("eager", "compiled", "graphed")
"""How :func:`gpt_training_step` runs the model: as it is, through :func:`compiled`, or
captured in CUDA graphs (:func:`graphed`)."""


def gpt_training_step(
    config: GPTConfig,
    batch: int,
    recipe: Any,
    mode: str = "eager",
    device: str = "cuda",
) -> tuple[Step, GPT]:
    """One AdamW step of the demo GPT on random tokens (``batch`` x ``config.block_size``),
    ``torch.autocast`` bf16 around it and ``f8.autocast(recipe)`` unless ``recipe`` is None;
    ``mode`` (:data:`GPT_MODES`) how the model runs. Returns ``(step, model)``; a step returns
    its loss (0-d, detached).

    Raises:
        ValueError: ``mode`` outside :data:`GPT_MODES`.
    """
    if mode not in GPT_MODES:
        raise ValueError(f"mode must be one of {', '.join(GPT_MODES)}, got {mode!r}")
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds instead of a minute on the host
        model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), device=device)
    idx, targets = tokens[:, :-1], tokens[:, 1:]

    def bf16() -> torch.autocast:
        # a capture refuses autocast's weight cache (torch.cuda.make_graphed_callables)
        return torch.autocast(
            torch.device(device).type, dtype=torch.bfloat16, cache_enabled=mode != "graphed"
        )

    forward: nn.Module = model
    if mode == "compiled":
        forward = compiled(model)
    elif mode == "graphed":
        with bf16():
            forward = graphed(model, (idx, targets), recipe)

    def step() -> torch.Tensor:
        with bf16(), f8.autocast(enabled=recipe is not None, recipe=recipe):
            loss = forward(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model


def compiled(module: nn.Module) -> nn.Module:
    """``torch.compile(module)`` for static shapes, after clearing Dynamo's caches (each variant
    compiles afresh: no recompile limit, no automatic dynamic shapes from an earlier shape)."""
    torch._dynamo.reset()
    return torch.compile(module, dynamic=False)  # type: ignore[return-value]


def graphed(module: nn.Module, args: tuple[torch.Tensor, ...], recipe: Any) -> nn.Module:
    """``module`` captured in CUDA graphs, forward and backward, for calls like ``module(*args)``
    (one output): ``f8.make_graphed_callables`` under ``recipe``, torch's function when
    ``recipe`` is None. Replays take tensors of the same shapes and dtypes."""
    if recipe is None:
        (module,) = torch.cuda.make_graphed_callables((module,), (args,))
        return module
    return f8.make_graphed_callables(module, args, fp8_enabled=True, fp8_recipe=recipe)  # type: ignore[return-value]


def fp8_linear_like(base: nn.Linear) -> f8.Linear:
    """An ``f8.Linear`` with ``base``'s weight and bias (a fresh FP8 state)."""
    layer = f8.Linear(
        base.in_features,
        base.out_features,
        bias=base.bias is not None,
        device=base.weight.device,
        dtype=base.weight.dtype,
    )
    layer.load_state_dict(base.state_dict(), strict=False)
    return layer


def torchao_problem() -> str | None:
    """None when ``torchao.float8`` imports, else why not (the cells then read "n/a")."""
    try:
        importlib.import_module("torchao.float8")
    except Exception as exc:  # optional package: any import failure means absent
        return f"{type(exc).__name__}: {exc}"
    return None


def torchao_linear_like(base: nn.Linear) -> nn.Module:
    """``base``'s copy converted with ``torchao.float8.convert_to_float8_training`` (default
    tensorwise config: dynamic scaling, E4M3 forward, E5M2 gradients)."""
    float8 = importlib.import_module("torchao.float8")
    model = nn.Sequential(
        nn.Linear(
            base.in_features,
            base.out_features,
            bias=base.bias is not None,
            device=base.weight.device,
            dtype=base.weight.dtype,
        )
    )
    model[0].load_state_dict(base.state_dict())
    float8.convert_to_float8_training(model)
    return model


def check_scaled_mm_dims(m: int, k: int, n: int) -> None:
    """``torch._scaled_mm`` on CUDA needs every GEMM dimension divisible by 16.

    Raises:
        ValueError: naming the dimensions that are not.
    """
    bad = {name: v for name, v in (("M", m), ("K", k), ("N", n)) if v % 16}
    if bad:
        raise ValueError(f"_scaled_mm needs M, K, N divisible by 16, got {bad}")


@dataclass(frozen=True)
class FloorOperands:
    """Pre-quantized operands of one Linear step's three GEMMs, in the layouts
    ``torch._scaled_mm(A, B)`` wants: A row-major, B column-major (``B = C.t()`` of a row-major
    ``C``). Shapes: ``x`` (M, K) E4M3, ``w`` (N, K) E4M3, ``dy`` (M, N) E5M2, their row-major
    transposes ``x_t`` (K, M), ``w_t`` (K, N), ``dy_t`` (N, M); ``bias`` (N,) bfloat16; ``one``
    the float32 0-d unit scale."""

    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    x_t: torch.Tensor
    w_t: torch.Tensor
    dy_t: torch.Tensor
    bias: torch.Tensor
    one: torch.Tensor

    @classmethod
    def random(cls, m: int, k: int, n: int, device: str = "cuda") -> FloorOperands:
        check_scaled_mm_dims(m, k, n)
        x = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        dy = torch.randn(m, n, device=device).to(torch.float8_e5m2)
        return cls(
            x=x,
            w=w,
            dy=dy,
            x_t=x.t().contiguous(),
            w_t=w.t().contiguous(),
            dy_t=dy.t().contiguous(),
            bias=torch.randn(n, device=device, dtype=torch.bfloat16),
            one=torch.ones((), device=device, dtype=torch.float32),
        )


def floor_gemms(ops: FloorOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three FP8 GEMMs of a Linear step, bf16 outputs, accumulation as :data:`DELAYED`'s
    ``fast_accumulation`` default (fast fprop only):

    - fprop ``y = x @ w.T + bias`` (E4M3 x E4M3, bias fused), (M, N);
    - dgrad ``dx = dy @ w`` (E5M2 x E4M3), (M, K);
    - wgrad ``dw = dy.T @ x`` (E5M2 x E4M3), (N, K).
    """
    fast_fprop, fast_dgrad, fast_wgrad = DELAYED.fast_accumulation
    kw: dict[str, Any] = {"scale_a": ops.one, "scale_b": ops.one, "out_dtype": torch.bfloat16}
    y = torch._scaled_mm(ops.x, ops.w.t(), bias=ops.bias, use_fast_accum=fast_fprop, **kw)
    dx = torch._scaled_mm(ops.dy, ops.w_t.t(), use_fast_accum=fast_dgrad, **kw)
    dw = torch._scaled_mm(ops.dy_t, ops.x_t.t(), use_fast_accum=fast_wgrad, **kw)
    return y, dx, dw


def floor_step(m: int, k: int, n: int, device: str = "cuda") -> Step:
    """The floor of an M x K x N Linear step: its three FP8 GEMMs alone (:func:`floor_gemms`) on
    operands quantized beforehand."""
    ops = FloorOperands.random(m, k, n, device)
    return lambda: floor_gemms(ops)


def kernels_cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Any:
    """``fp8kit.torch.kernels.cast_fp8(x, scale, dtype, transpose=True)``: FP8 data, its
    transpose and the amax in one pass. The kernels package is internal and being rewritten, so
    it is looked up per call: a rename costs this one cell, not the script."""
    return importlib.import_module("fp8kit.torch.kernels").cast_fp8(x, scale, dtype, transpose=True)
