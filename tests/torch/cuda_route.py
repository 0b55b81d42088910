"""Training runs for test_cuda_route.py, in a subprocess started with ``TRITON_INTERPRET=1`` and
``FP8KIT_CPU_GEMM=scaled_mm``.

On a CUDA machine the torch frontend's hot path differs from the CPU one in its kernel route:
every cast is the bound Triton cast of :func:`fp8kit.torch.kernels.prepare_cast` (no native
call), the update events run the Triton update kernel, the GEMMs are
``torch._scaled_mm`` and the FP8 output / gradient dequantize in torch ops. :func:`main` trains
the same models once on the CPU route and once with CPU tensors sent down that route (the
Triton kernels under the interpreter, ``_scaled_mm``'s CPU implementation), and saves what each
produced.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from fp8kit.torch.kernels import dispatch, triton_cast, triton_update
from tests.torch.test_hot_path import _KernelCounter, _Paused

STEPS = 3


def _scenarios() -> dict[str, tuple[Callable[[], Recipe], torch.dtype, bool]]:
    """name -> (recipe factory, parameter / input dtype, microbatches with the weight cache)."""
    return {
        "delayed float32": (lambda: DelayedScaling(amax_history_len=4), torch.float32, False),
        "delayed bfloat16": (lambda: DelayedScaling(amax_history_len=4), torch.bfloat16, False),
        "first step current": (
            lambda: DelayedScaling(amax_history_len=2, first_step_scaling="current"),
            torch.float32,
            False,
        ),
        "current scaling": (lambda: Float8CurrentScaling(), torch.bfloat16, False),
        "cached weights": (lambda: DelayedScaling(amax_history_len=4), torch.float32, True),
    }


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        f8.LayerNormMLP(64, 128, params_dtype=dtype),
        f8.Linear(64, 48, params_dtype=dtype, fp8_output=True, fp8_grad=True),
        f8.LayerNormLinear(48, 32, params_dtype=dtype),
    )


def _train(recipe: Recipe, dtype: torch.dtype, microbatches: bool) -> dict[str, object]:
    """:data:`STEPS` steps (an inf in the second step's input); outputs, state and grads."""
    model = _model(dtype)
    gen = torch.Generator().manual_seed(1)
    outputs = []
    for step in range(STEPS):
        x = (torch.randn(2, 16, 64, generator=gen) * (1 + 3 * step)).to(dtype)
        if step == 1:
            x[0, 0, 0] = float("inf")
        for mb in range(2 if microbatches else 1):
            with f8.autocast(recipe=recipe):
                first = (mb == 0) if microbatches else None
                y = model[2](model[1](model[0](x, is_first_microbatch=first)))
            y.float().square().mean().backward()
            outputs.append(y.detach().clone())
    state = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"outputs": outputs, "state": state, "grads": grads}


def _route_cpu_tensors_as_cuda() -> dict[str, int]:
    """Send CPU tensors down the CUDA route; returns the Triton kernels' call counts."""
    backend = dispatch._load_triton()
    if backend is None:
        raise RuntimeError(f"the Triton backend is unavailable: {dispatch.triton_error()}")
    calls = {"cast": 0, "cast_current": 0, "delayed_update": 0, "slot_cast": 0}
    for name in ("cast", "cast_current", "delayed_update"):
        kernel = getattr(backend, name)

        def counted(*args: object, _kernel: Callable = kernel, _name: str = name) -> object:
            calls[_name] += 1
            return _kernel(*args)

        setattr(backend, name, counted)
    prepare_update = backend.prepare_delayed_update

    def prepared_counted(*args: object) -> Callable[[], None]:
        event = prepare_update(*args)

        def counted_event() -> None:  # a prepared event counts as a delayed_update call
            calls["delayed_update"] += 1
            event()

        return counted_event

    backend.prepare_delayed_update = prepared_counted
    slot_cast = backend.prepared_slot_cast

    def slot_counted(*args: object) -> Callable[..., object]:
        prepared = slot_cast(*args)

        def counted_cast(*cast_args: object) -> object:  # a delayed slot's planned cast
            calls["slot_cast"] += 1
            return prepared(*cast_args)

        return counted_cast

    backend.prepared_slot_cast = slot_counted
    dispatch._auto = lambda x: ("triton", backend)  # type: ignore[assignment]
    dispatch.load_native = lambda: None  # type: ignore[assignment]  # no prepared native casts
    return calls


_TRITON_KERNELS = (
    (triton_cast, ("_cast_1d_kernel", "_cast_2d_kernel", "_dbias_kernel", "_amax_kernel")),
    (triton_update, ("_delayed_update_kernel",)),
)


class _CountedKernel:
    """A Triton kernel whose launches ``kernel[grid](...)`` the active counter counts by name;
    the aten ops the interpreter runs inside a launch are not counted (a GPU runs none)."""

    active: _KernelCounter | None = None

    def __init__(self, name: str, kernel: Any) -> None:
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def counted(*args: Any, **kwargs: Any) -> Any:
            counter = _CountedKernel.active
            if counter is None:
                return launch(*args, **kwargs)
            counter.ops[f"triton.{self.name}"] += 1
            with _Paused([counter]):
                return launch(*args, **kwargs)

        return counted


def _count_triton_launches() -> None:
    for module, names in _TRITON_KERNELS:
        for name in names:
            setattr(module, name, _CountedKernel(name, getattr(module, name)))


def launches_per_step(dtype: torch.dtype, recipe: Recipe) -> dict[str, int]:
    """The launches of one steady training step of one biased ``Linear(64, 64)`` on the
    current route, by name: forward, backward (given a dense ``dY``, gradients set to None
    before, so no accumulation op runs) and the two update events."""
    torch.manual_seed(0)
    layer = f8.Linear(64, 64, params_dtype=dtype)
    x = torch.randn(32, 64, dtype=dtype, requires_grad=True)
    dy = torch.randn(32, 64, dtype=dtype)
    counter = _KernelCounter()
    for step in range(3):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        _CountedKernel.active = counter if step == 2 else None
        with counter if step == 2 else contextlib.nullcontext():
            with f8.autocast(recipe=recipe):
                y = layer(x)
            y.backward(dy)
        _CountedKernel.active = None
    return dict(counter.ops)


def main(out_path: str) -> None:
    results: dict[str, object] = {}
    for route in ("cpu", "cuda"):
        calls = _route_cpu_tensors_as_cuda() if route == "cuda" else None
        for name, (recipe, dtype, microbatches) in _scenarios().items():
            results[f"{route}/{name}"] = _train(recipe(), dtype, microbatches)
        if calls is not None:
            results["triton calls"] = calls
            results["triton error"] = dispatch.triton_error()
            _count_triton_launches()
            for dtype in (torch.bfloat16, torch.float32):
                for recipe in (DelayedScaling(amax_history_len=4), Float8CurrentScaling()):
                    key = f"launches/{type(recipe).__name__}/{dtype}"
                    results[key] = launches_per_step(dtype, recipe)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
