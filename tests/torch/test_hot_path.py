"""CPU gates of the GPU hot path (docs/performance.md): kernel budget per Linear step and per
update event, no host synchronisation, the bias and activation dtype reaching ``_scaled_mm``.

CI has no GPU, so these count what the CUDA path would launch: aten ops that run a kernel (views
and allocations excluded) plus fp8kit's own fused-kernel calls, with the ``scaled_mm`` CPU GEMM
backend so each GEMM is one ``torch._scaled_mm`` as on CUDA.
"""

from __future__ import annotations

import gc
import warnings
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from fp8kit.torch import gemm, slot_cast
from fp8kit.torch.state import NonfiniteAmaxWarning
from fp8kit.torch.state import apply as update_apply

# aten ops that launch no kernel on a GPU (metadata, views, allocation without a fill).
NO_KERNEL_OPS = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.select.int",
    "aten.slice.Tensor",
    "aten.expand.default",
    "aten.as_strided.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.permute.default",
}
FUSED_KERNELS = ("cast_fp8_current",)  # fp8kit's casting kernels called per cast (slot_cast's)


class _KernelCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops and fp8kit fused-kernel calls while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.active = False  # fused-kernel calls count only inside ``with counter:``

    def __enter__(self) -> _KernelCounter:
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if name not in NO_KERNEL_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], _KernelCounter]]:
    """Yields a factory of counters; fused-kernel calls count as one launch each, and the ops
    they run inside (a pure-torch fallback) do not count."""
    counters: list[_KernelCounter] = []
    for name in FUSED_KERNELS:
        real = getattr(slot_cast, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            for c in _active(counters):
                c.ops[f"fp8kit.{_name}"] += 1
            with _Paused(counters):
                return _real(*args, **kwargs)

        monkeypatch.setattr(slot_cast, name, wrapped)
    real_prepare_cast = slot_cast.prepare_cast

    def wrapped_prepare_cast(*args, **kwargs):  # type: ignore[no-untyped-def]
        cast = real_prepare_cast(*args, **kwargs)  # a delayed-scaling cast: counted per call

        def counted_cast(*cast_args):  # type: ignore[no-untyped-def]
            for c in _active(counters):
                c.ops["fp8kit.cast_fp8"] += 1
            with _Paused(counters):
                return cast(*cast_args)

        return counted_cast

    monkeypatch.setattr(slot_cast, "prepare_cast", wrapped_prepare_cast)
    real_update = update_apply.delayed_update_

    def wrapped_update(*args, **kwargs):  # type: ignore[no-untyped-def]
        for c in _active(counters):
            c.ops["fp8kit.delayed_update_"] += 1
        with _Paused(counters):
            return real_update(*args, **kwargs)

    monkeypatch.setattr(update_apply, "delayed_update_", wrapped_update)
    real_prepare = update_apply.prepare_delayed_update

    def wrapped_prepare(*args, **kwargs):  # type: ignore[no-untyped-def]
        update = real_prepare(*args, **kwargs)  # the steady-state event: counted per call

        def counted_update() -> None:
            for c in _active(counters):
                c.ops["fp8kit.delayed_update_"] += 1
            with _Paused(counters):
                update()

        return counted_update

    monkeypatch.setattr(update_apply, "prepare_delayed_update", wrapped_prepare)
    previous = gemm.cpu_gemm_backend()
    gemm.set_cpu_gemm_backend("scaled_mm")

    def make() -> _KernelCounter:
        c = _KernelCounter()
        counters.append(c)
        return c

    yield make
    gemm.set_cpu_gemm_backend(previous)


def _active(counters: list[_KernelCounter]) -> list[_KernelCounter]:
    return [c for c in counters if c.active]


class _Paused:
    """Stop counting aten ops (a fused kernel's fallback internals) while inside."""

    def __init__(self, counters: list[_KernelCounter]) -> None:
        self.counters = counters
        self.saved: list[Counter[str]] = []

    def __enter__(self) -> None:
        self.saved = [Counter(c.ops) for c in self.counters]

    def __exit__(self, *exc: object) -> None:
        for c, saved in zip(self.counters, self.saved, strict=True):
            fused = {k: v for k, v in c.ops.items() if k.startswith("fp8kit.")}
            c.ops = Counter({k: v for k, v in saved.items() if not k.startswith("fp8kit.")})
            c.ops.update(fused)


def _step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: object) -> None:
    with f8.autocast(recipe=recipe):  # type: ignore[arg-type]
        y = layer(x)
    y.backward(dy)


RECIPES = {
    "delayed": DelayedScaling(amax_history_len=16),
    "delayed-first-step-current": DelayedScaling(amax_history_len=4, first_step_scaling="current"),
    "current": Float8CurrentScaling(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_linear_step_stays_within_eight_kernels(counted, dtype, recipe) -> None:
    """Forward + backward of one Linear (update events excluded): <= 8 kernels, issue 9."""
    torch.manual_seed(0)
    layer = f8.Linear(64, 32, dtype=dtype)
    x = torch.randn(48, 64, dtype=dtype, requires_grad=True)
    dy = torch.randn(48, 32, dtype=dtype)
    for _ in range(2):
        _step(layer, x, dy, recipe)
    x.grad = layer.weight.grad = layer.bias.grad = None  # no gradient accumulation kernels
    c = counted()
    with c:
        y = _LayerCall(layer, recipe)(x)
        y.backward(dy)
    c.ops.pop("fp8kit.delayed_update_", None)  # the backward update event has its own budget
    assert c.ops["aten._scaled_mm.default"] == 3
    assert c.total <= 8, c.ops


def test_backward_under_torch_autocast_converts_each_gradient_once(counted) -> None:
    """float32 parameters under ``torch.autocast(bfloat16)``: dX and dB each reach float32 in one
    conversion (autograd's, undoing the input's and the bias's casts to bfloat16); dW comes out
    of its GEMM in float32. A bias gradient handed back in float32 would be converted to the
    bias input's bfloat16 and back (two more kernels per biased GEMM)."""
    torch.manual_seed(0)
    recipe = RECIPES["delayed"]
    layer = f8.Linear(64, 32)
    x = torch.randn(48, 64, requires_grad=True)
    dy = torch.randn(48, 32, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            _step(layer, x, dy, recipe)
        x.grad = layer.weight.grad = layer.bias.grad = None
        y = _LayerCall(layer, recipe)(x)
    c = counted()
    with c:
        y.backward(dy)
    assert c.ops["aten._scaled_mm.default"] == 2
    assert c.ops["aten._to_copy.default"] == 2, c.ops
    assert layer.bias.grad.dtype == layer.weight.grad.dtype == x.grad.dtype == torch.float32
    assert torch.equal(layer.bias.grad, dy.float().sum(0).bfloat16().float())


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_step_copies_no_activation(counted, batch_first) -> None:
    """Self-attention through ``scaled_dot_product_attention`` (``need_weights=False``): the
    projections take the input in its own layout and the core gets (N, heads, L, d) views of
    the packed projection, so a training step clones nothing."""
    torch.manual_seed(0)
    recipe = RECIPES["delayed"]
    layer = f8.MultiheadAttention(64, 4, batch_first=batch_first)
    x = torch.randn((2, 16, 64) if batch_first else (16, 2, 64), requires_grad=True)

    def step() -> None:
        with f8.autocast(recipe=recipe):
            y, _ = layer(x, x, x, need_weights=False)
        y.backward(torch.ones_like(y))

    for _ in range(2):
        step()
    c = counted()
    with c:
        step()
    assert c.ops["aten._scaled_mm.default"] == 6
    assert c.ops["aten.clone.default"] == 0, c.ops


class _LayerCall:
    """One FP8 call of ``layer`` with the autocast exit (its update event) outside the count."""

    def __init__(self, layer: torch.nn.Module, recipe: object) -> None:
        self.layer, self.recipe = layer, recipe

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ctx = f8.autocast(recipe=self.recipe)  # type: ignore[arg-type]
        ctx.__enter__()
        try:
            return self.layer(x)
        finally:
            # Leave the region without running its event: the count covers the module call only.
            ctx._frames[-1].forward_pending.clear()
            ctx.__exit__(None, None, None)


@pytest.mark.parametrize("num_modules", [3, 40])
def test_update_event_is_at_most_three_kernels(counted, num_modules) -> None:
    """All modules of a (recipe, group, direction) update in one fused kernel, whatever their
    number; the backward event of the same step likewise."""
    recipe = DelayedScaling(amax_history_len=8, margin=1, interval=2)
    layers = [f8.Linear(16, 16) for _ in range(num_modules)]
    x = torch.randn(16, 16, requires_grad=True)
    for _ in range(2):  # the first event lays the states out in one pool
        with f8.autocast(recipe=recipe):
            y = sum(layer(x).sum() for layer in layers)
        y.backward()  # type: ignore[union-attr]
    ctx = f8.autocast(recipe=recipe)
    ctx.__enter__()
    y = sum(layer(x).sum() for layer in layers)
    c = counted()
    with c:
        ctx.__exit__(None, None, None)
    assert c.total <= 3, c.ops
    assert c.ops["fp8kit.delayed_update_"] == 1
    c = counted()
    with c:
        y.backward()  # type: ignore[union-attr]
    # The backward event runs inside backward: its ops are the fused update only.
    assert c.ops["fp8kit.delayed_update_"] == 1


class _HostSyncs(TorchDispatchMode):
    """Records the aten ops that read device values on the host or build tensors from data, and
    ``Tensor.tolist`` calls (a CPU tensor's ``tolist`` runs no aten op)."""

    SYNC_OPS = ("aten._local_scalar_dense.default", "aten.lift_fresh.default")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self._real_tolist = torch.Tensor.tolist

    def __enter__(self) -> _HostSyncs:
        real = self._real_tolist

        def tolist(tensor: torch.Tensor) -> object:
            self.seen.append("Tensor.tolist")
            return real(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._real_tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func) in self.SYNC_OPS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


HOST_SYNC_RECIPES = {
    **RECIPES,
    "interval-most-recent": DelayedScaling(
        amax_history_len=4, amax_compute_algo="most_recent", interval=3
    ),
    "power-2": DelayedScaling(amax_history_len=4, power_2_scale=True, margin=2),
    "callable": DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.amax(0)),
    "no-reduce": DelayedScaling(amax_history_len=4, reduce_amax=False),
}


def _assert_steps_read_nothing(model: torch.nn.Module, x: torch.Tensor, recipe: object) -> None:
    """Three training steps, the second with a non-finite amax, with no host read."""
    for step in range(3):
        xs = x * float("inf") if step == 1 else x  # a non-finite amax enters the history
        with _HostSyncs() as syncs, warnings.catch_warnings():
            warnings.simplefilter("ignore", NonfiniteAmaxWarning)
            with f8.autocast(recipe=recipe):  # type: ignore[arg-type]
                out = model(xs)
            out.square().mean().backward()
        assert syncs.seen == [], f"step {step}: {syncs.seen}"


@pytest.mark.parametrize("recipe", list(HOST_SYNC_RECIPES.values()), ids=list(HOST_SYNC_RECIPES))
def test_training_step_reads_nothing_back_to_the_host(recipe) -> None:
    """No ``.item()``, ``bool(tensor)``, ``.tolist()`` or tensor-from-Python-data in forward,
    backward or the update events, including non-finite amaxes: first with every module
    running (the steady-state event), then with an idle module (its slots are skipped)."""
    gc.collect()  # modules of earlier tests under these recipes leave their registries
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        f8.Linear(32, 32), f8.LayerNormMLP(32, 64), f8.LayerNormLinear(32, 16)
    )
    x = torch.randn(16, 32)
    for _ in range(2):  # the first events lay out the pool and bind the update kernel
        with f8.autocast(recipe=recipe):
            model(x).sum().backward()
    _assert_steps_read_nothing(model, x, recipe)
    idle = f8.Linear(32, 32)  # runs once, then stays idle: its slots are skipped
    with f8.autocast(recipe=recipe):
        (model(x).sum() + idle(x).sum()).backward()
    with f8.autocast(recipe=recipe):  # first event with ``idle`` skipped: its mask is made once
        model(x).sum().backward()
    _assert_steps_read_nothing(model, x, recipe)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_gets_the_bias_and_the_activation_dtype(dtype, monkeypatch) -> None:
    """fprop fuses the bias into ``_scaled_mm`` (cuBLASLt allows it for a bfloat16/float16 output
    only) and every GEMM writes the activation / weight dtype directly."""
    calls: list[dict] = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    previous = gemm.cpu_gemm_backend()
    gemm.set_cpu_gemm_backend("scaled_mm")
    try:
        layer = f8.Linear(32, 48, dtype=dtype)
        x = torch.randn(16, 32, dtype=dtype, requires_grad=True)
        with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
            y = layer(x)
        y.sum().backward()
    finally:
        gemm.set_cpu_gemm_backend(previous)
    fprop, dgrad, wgrad = calls
    assert [c["out_dtype"] for c in calls] == [dtype] * 3
    if dtype == torch.bfloat16:
        assert fprop["bias"] is layer.bias
    else:
        assert fprop["bias"] is None
    assert dgrad["bias"] is None and wgrad["bias"] is None
    assert [c["use_fast_accum"] for c in calls] == [True, False, False]
