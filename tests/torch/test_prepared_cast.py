"""``kernels.prepare_cast``: a slot's cast with its scale and amax entry bound once gives the
bits of ``kernels.cast_fp8`` (itself checked against the numpy reference in test_kernels), and
a slot's prepared casts follow its buffers when they are replaced."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch

import fp8kit.torch as f8
from fp8kit.formats import E4M3, E5M2
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import kernels
from fp8kit.torch.kernels import dispatch
from tests.reference import fp8_round
from tests.torch.test_kernels import _matrix

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]  # NaN bits compare
    return torch.equal(*bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_prepared_cast_matches_cast_fp8(dtype: torch.dtype, fp8_dtype: torch.dtype) -> None:
    """Every combination of transpose, dbias, amax folding and first-step current scaling, on
    inputs with zeros, subnormals and a 10^6 range, twice in a row (the second call folds into
    an amax entry the first one wrote), and a scale that overflows some values."""
    x = _matrix(24, 40, dtype, seed=3)
    x[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    for first_step in (False, True):
        for fold in (False, True):
            scale = torch.tensor([0.73])
            count = torch.zeros(1, dtype=torch.int64) if first_step else None
            amax = [torch.zeros(1), torch.zeros(1)] if fold else [None, None]
            cast = kernels.prepare_cast(
                scale, fp8_dtype, amax_out=amax[0], first_step_current=count
            )
            for transpose in (False, True):
                for dbias in (False, True):
                    for _ in range(2):
                        got = cast(x, transpose, dbias)
                        want = kernels.cast_fp8(
                            x,
                            scale,
                            fp8_dtype,
                            transpose=transpose,
                            amax_out=amax[1],
                            dbias=dbias,
                            first_step_current=count,
                        )
                        what = (first_step, fold, transpose, dbias)
                        for g, w in zip(got, want, strict=True):
                            assert _same(g, w), what
                        assert _same(amax[0], amax[1]), what


def test_prepared_cast_takes_every_x_cast_fp8_takes() -> None:
    """An x the bound native call cannot take goes to cast_fp8: its result or its error."""
    scale, staging = torch.tensor(2.0), torch.zeros(1)
    cast = kernels.prepare_cast(scale, E5M2, amax_out=staging)
    empty = cast(torch.zeros(0, 8), True, True)
    assert empty.data.shape == (0, 8) and empty.data_t.shape == (8, 0)
    x3 = torch.randn(2, 3, 4)
    for x in (x3, torch.tensor(-3.5)):  # 3-D and 0-d: the bound call, data of x's shape
        got, want = cast(x, False, False), kernels.cast_fp8(x, scale, E5M2)
        assert got.data.shape == x.shape and torch.equal(got.data.float(), want.data.float())
    with pytest.raises(ValueError, match=r"transpose=True needs a 2-D x"):
        cast(x3, True, False)
    with pytest.raises(TypeError, match="x must have dtype"):
        cast(torch.randn(4, 4, dtype=torch.float64), False, False)


def test_prepare_cast_errors_name_the_parameter() -> None:
    s = torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"scale must be a torch\.float32 tensor with one element"):
        kernels.prepare_cast(torch.ones(2), E4M3)
    with pytest.raises(TypeError, match=r"scale must be a torch\.float32 tensor with one element"):
        kernels.prepare_cast(1.0, E4M3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fp8_dtype must be"):
        kernels.prepare_cast(s, torch.float16)
    with pytest.raises(TypeError, match=r"amax_out must be a torch\.float32 tensor"):
        kernels.prepare_cast(s, E4M3, amax_out=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"first_step_current must be a torch\.int64 tensor"):
        kernels.prepare_cast(s, E4M3, first_step_current=torch.zeros(1))


def test_prepared_casts_follow_replaced_buffers() -> None:
    """A module's casts fold their amaxes into its current staging row after its history was
    resized (new buffers): the prepared casts of the old buffers are dropped with them (a cast
    still bound to the old staging row would leave the new one at 0)."""
    layer = f8.Linear(16, 16)
    x = torch.randn(8, 16)
    for _ in range(2):  # the first event moves the state into its pool (new buffers)
        with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
            y = layer(x)
        y.sum().backward()
    state = layer.fp8_meta.forward
    assert state.slot_derived(0)  # the input slot's cast is prepared
    longer = DelayedScaling(amax_history_len=8)  # binding it resizes the histories
    # the warning names the state's owner (a model may hold many)
    message = r"resizing an amax history from 4 to 8 entries \(Linear\(16, 16\)\.forward, "
    resized = pytest.warns(UserWarning, match=message)
    with resized, f8.autocast(recipe=longer):  # a training call binds (an evaluation does not)
        layer(x * 3)
        assert state.amax_history.shape[0] == 8
        assert state.amax_history[0, 0].item() == (x * 3).abs().max().item()


def test_prepared_casts_and_events_follow_share_memory() -> None:
    """``Module.share_memory()`` moves the buffers' storage in place (same tensors, new
    addresses): later steps record into and update the moved buffers, exactly as an unshared
    copy trained on the same inputs does. Prepared casts and update events bound to the old
    addresses left the staging rows at 0 and wrote into freed memory. Three layers: their pooled
    buffers are views of one storage, which the first layer's call moves for all."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=4)
    shared = torch.nn.Sequential(f8.Linear(32, 32), f8.Linear(32, 32), f8.Linear(32, 16))
    inputs = [torch.randn(8, 32) * 10**k for k in range(5)]

    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=recipe):
            y = model(x)
        y.sum().backward()
        return y.detach()

    for x in inputs[:2]:  # the first event moves the states into their pool; casts prepared
        step(shared, x)
    plain = copy.deepcopy(shared)
    shared.share_memory()
    assert shared[2].fp8_meta.forward.amax_history.is_shared()
    with torch.no_grad(), f8.autocast(recipe=recipe):
        shared(inputs[2])
        plain(inputs[2])
    for a, b in zip(shared, plain, strict=True):
        staging = a.fp8_meta.forward.amax_history[0]
        assert staging[0].item() > 0  # every layer recorded its input
        assert torch.equal(staging, b.fp8_meta.forward.amax_history[0])
    for x in inputs[3:]:
        assert torch.equal(step(shared, x), step(plain, x))
    for a, b in zip(shared, plain, strict=True):
        for direction in ("forward", "backward"):
            sa, sb = getattr(a.fp8_meta, direction), getattr(b.fp8_meta, direction)
            for name in ("amax_history", "scale", "scale_inv", "update_count"):
                assert torch.equal(getattr(sa, name), getattr(sb, name)), (direction, name)


def _route_to_failing_triton(monkeypatch: pytest.MonkeyPatch, failing: object) -> None:
    """Route CPU tensors as CUDA ones to ``failing`` as the Triton backend, until a failure
    switches the process to the torch kernels."""
    monkeypatch.setitem(dispatch._triton_state, "backend", failing)
    monkeypatch.setitem(dispatch._triton_state, "error", None)

    def auto(x: torch.Tensor) -> tuple[str, object]:
        on = dispatch._triton_state["backend"] is failing
        return ("triton", failing) if on else ("reference", dispatch.reference)

    monkeypatch.setattr(dispatch, "_auto", auto)


class _FailingTriton:
    """A Triton backend whose cast fails once it is launched (a compile or launch error)."""

    def __init__(self) -> None:
        self.launches = 0

    def cast(self, *args: object) -> None:
        self.launches += 1
        raise RuntimeError("PTX JIT compilation failed")

    def prepared_slot_cast(self, *bound: object) -> Callable[..., None]:
        """A delayed slot's planned cast (ADR 0262): fails as ``cast`` does."""
        return self.cast


def test_prepared_triton_cast_falls_back_once_a_launch_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the Triton route a failing launch warns once, gives the torch kernels' bits, and
    every later call of any prepared cast skips Triton (as ``cast_fp8`` does)."""
    failing = _FailingTriton()
    _route_to_failing_triton(monkeypatch, failing)
    monkeypatch.setattr(dispatch, "load_native", lambda: None)  # cast_fp8: the torch kernels
    scale, amax = torch.tensor([0.5]), torch.zeros(1)
    cast = kernels.prepare_cast(scale, E4M3, amax_out=amax)
    assert type(cast).__name__ == "_PreparedTritonCast"
    x = _matrix(16, 24, torch.bfloat16, seed=5)
    with pytest.warns(kernels.NativeKernelWarning, match="PTX JIT compilation failed"):
        got = cast(x, True, True)
    want = kernels.cast_fp8(x, scale, E4M3, transpose=True, dbias=True, backend="reference")
    for name in ("data", "data_t", "scale_inv", "dbias"):
        assert _same(getattr(got, name), getattr(want, name)), name
    assert float(amax) == float(x.float().abs().max())
    again = cast(x, False, False)  # the backend is off now: no second launch, no warning
    assert failing.launches == 1 and _same(again.data, want.data)
    assert "PTX JIT" in (kernels.triton_error() or "")


class _FailingTritonUpdate:
    """A Triton backend whose bound update event fails when it first launches."""

    def __init__(self) -> None:
        self.launches = 0

    def prepare_delayed_update(self, *args: object) -> Callable[[], None]:
        def event() -> None:
            self.launches += 1
            raise RuntimeError("PTX JIT compilation failed")

        return event


def test_prepared_triton_update_falls_back_once_a_launch_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the Triton route the bound update event (ADR 0262) that fails warns once and updates
    with the torch kernels (the same numbers); later events skip Triton."""
    failing = _FailingTritonUpdate()
    _route_to_failing_triton(monkeypatch, failing)
    history = torch.tensor([[3.0, 0.0, 7.0], [1.0, 2.0, 0.5]])
    tensors = [history, torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.int64)]
    want = [t.clone() for t in tensors]
    kernels.delayed_update_(*want, fmax=448.0, backend="reference")
    event = kernels.prepare_delayed_update(*tensors, fmax=448.0)
    assert type(event).__name__ == "_PreparedTritonUpdate"
    with pytest.warns(kernels.NativeKernelWarning, match="PTX JIT compilation failed"):
        event()
    for got, expected in zip(tensors, want, strict=True):
        assert torch.equal(got, expected)
    kernels.delayed_update_(*want, fmax=448.0, backend="reference")
    event()  # the backend is off now: the torch kernels, no second launch
    assert failing.launches == 1
    for got, expected in zip(tensors, want, strict=True):
        assert torch.equal(got, expected)


def test_prepared_triton_update_takes_the_torch_kernels_inside_a_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bound event called while torch.compile traces launches nothing: it runs what
    ``delayed_update_`` runs there (the torch kernels), as before ADR 0262."""
    failing = _FailingTritonUpdate()
    _route_to_failing_triton(monkeypatch, failing)
    tensors = [torch.tensor([[3.0, 7.0], [1.0, 0.5]]), torch.ones(2), torch.ones(2)]
    tensors.append(torch.zeros(2, dtype=torch.int64))
    want = [t.clone() for t in tensors]
    kernels.delayed_update_(*want, fmax=448.0, backend="reference")
    event = kernels.prepare_delayed_update(*tensors, fmax=448.0)
    tracing = dispatch._auto

    def auto(x: torch.Tensor) -> tuple[str, object]:  # _auto's rule: a trace takes torch
        return ("reference", dispatch.reference) if compiling[0] else tracing(x)

    compiling = [True]
    monkeypatch.setattr(dispatch, "_auto", auto)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling[0])
    event()
    assert failing.launches == 0
    for got, expected in zip(tensors, want, strict=True):
        assert torch.equal(got, expected)


def _current_qdq(t: torch.Tensor) -> np.ndarray:
    """Float64 fake-quantization with current scaling (fmax / max|t|), float32 scale."""
    t32 = t.detach().float().numpy()
    s = np.float32(E4M3.max) / np.float32(np.abs(t32).max())
    return fp8_round((t32 * s).astype(np.float64), E4M3) / np.float64(s)


def test_a_cast_prepared_under_unity_first_step_is_not_reused_under_current():
    """Kills S03 (slot_cast.py: the prepared-cast key leaves out `first_step_current`). A slot's
    cast prepared by an evaluation under first_step_scaling="unity" (same history length, so
    the buffers and prepared casts stay) must not serve a training call under "current": SPEC 1,
    a slot without history is quantized with fmax / its own amax on that first step."""
    torch.manual_seed(0)
    layer = f8.Linear(32, 16, bias=False)
    unity = DelayedScaling(amax_history_len=4)
    current = DelayedScaling(amax_history_len=4, first_step_scaling="current")
    f8.init_fp8_state(layer, unity)
    x = torch.randn(8, 32) * 1000  # scale 1 would saturate most of x at 448
    with torch.no_grad(), f8.autocast(recipe=unity):
        layer(x)  # prepares the casts; no update event, the slots keep no history
    with f8.autocast(recipe=current):
        y = layer(x)
    ref = _current_qdq(x) @ _current_qdq(layer.weight).T
    np.testing.assert_allclose(y.detach().double().numpy(), ref, rtol=1e-5, atol=1e-3)
