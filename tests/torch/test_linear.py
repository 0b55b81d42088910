"""docs/semantics.md section 4: f8.Linear's three FP8 GEMMs against float64 references."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8kit.torch as f8
from fp8kit.formats import E4M3, E5M2, FP8Format
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from fp8kit.torch import gemm
from tests.reference import current_scale_reference, fp8_round

INPUT, WEIGHT, OUTPUT = f8.FwdSlot.INPUT, f8.FwdSlot.WEIGHT, f8.FwdSlot.OUTPUT
GRAD_OUTPUT, GRAD_INPUT = f8.BwdSlot.GRAD_OUTPUT, f8.BwdSlot.GRAD_INPUT


def qdq(x: torch.Tensor, scale: float, fmt: FP8Format) -> np.ndarray:
    """Reference fake-quantization in float64: fp8_round(float32(x) * float32(scale)) / scale."""
    x32 = x.detach().to(torch.float32).numpy()
    s32 = np.float32(scale)
    return fp8_round((x32 * s32).astype(np.float64), fmt) * np.float64(np.float32(1) / s32)


class CountGemms:
    """Counts FP8 GEMMs at fp8kit's one GEMM entry ``gemm.fp8_gemm`` (both CPU backends and
    CUDA end there), recording each call's keyword arguments."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.kwargs: list[dict] = []
        real_scaled_mm, real_dequant_mm = torch._scaled_mm, gemm._dequant_mm

        def counting_scaled_mm(*args, **kwargs):
            self.calls += 1
            self.kwargs.append(kwargs)
            return real_scaled_mm(*args, **kwargs)

        def counting_dequant_mm(a, b, sa, sb, out_dtype, bias, b_transposed=False):
            self.calls += 1
            self.kwargs.append({"out_dtype": out_dtype, "bias": bias})
            return real_dequant_mm(a, b, sa, sb, out_dtype, bias, b_transposed)

        monkeypatch.setattr(torch, "_scaled_mm", counting_scaled_mm)
        monkeypatch.setattr(gemm, "_dequant_mm", counting_dequant_mm)


def _rel(a: torch.Tensor | np.ndarray, b: np.ndarray) -> float:
    a = a.detach().to(torch.float64).numpy() if isinstance(a, torch.Tensor) else a
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _train_step(layer: f8.Linear, x: torch.Tensor, g: torch.Tensor, recipe) -> torch.Tensor:
    with f8.autocast(recipe=recipe):
        y = layer(x)
    y.backward(g)
    return y


@pytest.mark.parametrize(("m", "k", "n"), [(64, 32, 48), (5, 17, 33), (1, 1, 1), (48, 128, 16)])
def test_fprop_dgrad_wgrad_equal_the_fp8_reference(
    m: int, k: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two steps: step 1 uses scale 1, step 2 the scales produced by event 1 (docs/semantics.md
    section 3)."""
    torch.manual_seed(m * 1000 + k * 10 + n)
    recipe = DelayedScaling(amax_history_len=16)
    layer = f8.Linear(k, n)
    for step in range(2):
        x = (torch.randn(m, k) * 3).requires_grad_()
        g = torch.randn(m, n) * 0.01
        fwd, bwd = layer.fp8_meta.forward, layer.fp8_meta.backward
        s_x, s_w = fwd.scale[INPUT].item(), fwd.scale[WEIGHT].item()
        s_g = bwd.scale[GRAD_OUTPUT].item()
        if step == 0:
            assert (s_x, s_w, s_g) == (1.0, 1.0, 1.0)
        layer.weight.grad = None
        layer.bias.grad = None
        counter = CountGemms(monkeypatch)
        y = _train_step(layer, x, g, recipe)
        assert counter.calls == 3  # fprop, dgrad, wgrad all were FP8 GEMMs
        xq, wq, gq = qdq(x, s_x, E4M3), qdq(layer.weight, s_w, E4M3), qdq(g, s_g, E5M2)
        bias = layer.bias.detach().double().numpy()
        y_ref = xq @ wq.T + bias
        dx_ref, dw_ref = gq @ wq, gq.T @ xq
        # Only float32 accumulation/rounding differs from the float64 reference.
        assert _rel(y, y_ref) < 1e-5
        assert _rel(x.grad, dx_ref) < 1e-5
        assert _rel(layer.weight.grad, dw_ref) < 1e-5
        np.testing.assert_allclose(
            layer.bias.grad.double().numpy(), g.double().sum(0).numpy(), rtol=1e-5, atol=1e-7
        )
    assert fwd.scale[INPUT].item() != 1.0 and bwd.scale[GRAD_OUTPUT].item() != 1.0


def test_relative_error_against_unquantized_float64() -> None:
    """Error bounds from FP8 precision: E4M3 rounds with relative error <= 2^-4 (RMS about
    2^-4/sqrt(3) = 0.036 per operand), E5M2 <= 2^-3 (RMS 0.072). A GEMM of two independently
    rounded operands has RMS relative error about sqrt(e_a^2 + e_b^2): fprop ~0.05,
    dgrad/wgrad ~0.08. Bounds leave ~1.5x headroom."""
    torch.manual_seed(0)
    layer = f8.Linear(256, 192)
    recipe = DelayedScaling(amax_history_len=8)
    for _ in range(3):  # let the scales settle
        x = torch.randn(128, 256).requires_grad_()
        g = torch.randn(128, 192)
        layer.zero_grad()
        y = _train_step(layer, x, g, recipe)
    x64, w64, g64 = (t.detach().double().numpy() for t in (x, layer.weight, g))
    errs = {
        "fprop": _rel(y - layer.bias, x64 @ w64.T),
        "dgrad": _rel(x.grad, g64 @ w64),
        "wgrad": _rel(layer.weight.grad, g64.T @ x64),
    }
    assert errs["fprop"] < 0.06, errs
    assert errs["dgrad"] < 0.12, errs
    assert errs["wgrad"] < 0.12, errs
    assert min(errs.values()) > 1e-3, errs  # really quantized, not a high-precision path


def test_saved_activations_are_fp8() -> None:
    layer = f8.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), f8.autocast():
        layer(x).sum().backward()
    # x is kept as FP8 x^T, the row-major layout wgrad reads.
    activation_like = [t for t in saved if t.numel() == x.numel()]
    assert activation_like and all(t.dtype == torch.float8_e4m3fn for t in activation_like)
    assert any(t.shape == (64, 32) for t in activation_like)
    assert not any(t is x for t in saved)


@pytest.mark.parametrize(
    "override",
    [(True, False, False), (False, True, False), (False, False, True), (True, True, True)],
)
def test_override_linear_precision_runs_chosen_gemms_in_high_precision(
    override: tuple[bool, bool, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(1)
    layer = f8.Linear(32, 48)
    x = torch.randn(16, 32, requires_grad=True)
    g = torch.randn(16, 48)
    counter = CountGemms(monkeypatch)
    y = _train_step(layer, x, g, DelayedScaling(override_linear_precision=override))
    assert counter.calls == 3 - sum(override)
    fprop_hp, dgrad_hp, wgrad_hp = override
    exact = {
        "y": F.linear(x, layer.weight, layer.bias),
        "dx": g @ layer.weight,
        "dw": g.t() @ x,
    }
    for name, got, hp in (
        ("y", y, fprop_hp),
        ("dx", x.grad, dgrad_hp),
        ("dw", layer.weight.grad, wgrad_hp),
    ):
        same = torch.equal(got.detach(), exact[name].detach())
        assert same == hp, name
    state = layer.fp8_meta.forward
    input_quantized = not (fprop_hp and wgrad_hp)
    assert (state.amax_history[:, INPUT].abs().sum().item() > 0) == input_quantized


def test_is_first_microbatch_caches_the_fp8_weight() -> None:
    torch.manual_seed(2)
    layer = f8.Linear(32, 32)
    x = torch.randn(8, 32)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y1 = layer(x, is_first_microbatch=True)
        staged_weight = layer.fp8_meta.forward.amax_history[0, WEIGHT].item()
        with torch.no_grad():
            layer.weight.mul_(4.0)  # the cached FP8 copy must not see this
        y2 = layer(x, is_first_microbatch=False)
        assert layer.fp8_meta.forward.amax_history[0, WEIGHT].item() == staged_weight
        y3 = layer(x)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    assert not torch.allclose(y3, y1)
    with pytest.raises(ValueError, match="is_first_microbatch=True"):
        fresh = f8.Linear(32, 32)
        with f8.autocast():
            fresh(x, is_first_microbatch=False)
    with pytest.raises(TypeError, match="is_first_microbatch"):
        layer(x, is_first_microbatch=1)


def test_fp8_output_and_fp8_grad() -> None:
    torch.manual_seed(3)
    layer = f8.Linear(32, 32, fp8_output=True, fp8_grad=True)
    recipe = DelayedScaling(amax_history_len=4)
    for _ in range(2):
        x = torch.randn(16, 32, requires_grad=True)
        s_out = layer.fp8_meta.forward.scale[OUTPUT].item()
        s_gi = layer.fp8_meta.backward.scale[GRAD_INPUT].item()
        y = _train_step(layer, x, torch.randn(16, 32), recipe)
        on_grid = fp8_round(y.detach().double().numpy() * s_out, E4M3) / s_out
        np.testing.assert_allclose(y.detach().double().numpy(), on_grid, rtol=1e-6)
        g_grid = fp8_round(x.grad.double().numpy() * s_gi, E5M2) / s_gi
        np.testing.assert_allclose(x.grad.double().numpy(), g_grid, rtol=1e-6)
    assert layer.fp8_meta.forward.update_count[OUTPUT].item() == 2
    assert layer.fp8_meta.backward.update_count[GRAD_INPUT].item() == 2
    plain = f8.Linear(32, 32)
    _train_step(plain, torch.randn(4, 32, requires_grad=True), torch.randn(4, 32), recipe)
    assert plain.fp8_meta.forward.update_count[OUTPUT].item() == 0  # never quantized: untouched
    assert plain.fp8_meta.forward.scale[OUTPUT].item() == 1.0


def test_any_leading_shape() -> None:
    layer = f8.Linear(24, 40)
    x = torch.randn(2, 3, 5, 24, requires_grad=True)
    with f8.autocast():
        y = layer(x)
    assert y.shape == (2, 3, 5, 40)
    y.sum().backward()
    assert x.grad.shape == x.shape
    ref = qdq(x.reshape(-1, 24), 1.0, E4M3) @ qdq(layer.weight, 1.0, E4M3).T
    assert _rel(y.reshape(-1, 40) - layer.bias, ref) < 1e-5


@pytest.mark.parametrize("rows", [4, 16])
@pytest.mark.parametrize(
    "make",
    [
        lambda: f8.Linear(16, 32),
        lambda: f8.Linear(16, 24),
        lambda: f8.Linear(20, 16, bias=False),
        lambda: f8.LayerNormLinear(16, 32),
        lambda: f8.LayerNormMLP(16, 32),
    ],
    ids=["Linear", "Linear-unaligned-N", "Linear-unaligned-K", "LayerNormLinear", "LayerNormMLP"],
)
def test_output_accepts_in_place_ops(make, rows: int) -> None:
    """A drop-in layer's output takes ``nn.ReLU(inplace=True)`` for every row count, also the
    ones the GEMM pads to 16 (ADR 0248), with the gradients of the out-of-place op."""
    torch.manual_seed(rows)
    layer = make()
    twin = copy.deepcopy(layer)
    x = torch.randn(rows, layer.weight.shape[1] if isinstance(layer, f8.Linear) else 16)
    grads = []
    for module, in_place in ((layer, True), (twin, False)):
        with f8.autocast():
            y = module(x)
        y = y.relu_() if in_place else torch.relu(y)
        (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        grads.append([p.grad for p in module.parameters()])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bfloat16_parameters_and_activations() -> None:
    torch.manual_seed(4)
    layer = f8.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(16, 32, dtype=torch.bfloat16)
    y = _train_step(layer, x, g, DelayedScaling())
    assert y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    xq, wq, gq = qdq(x, 1.0, E4M3), qdq(layer.weight, 1.0, E4M3), qdq(g, 1.0, E5M2)
    bias = layer.bias.detach().double().numpy()
    assert _rel(y, xq @ wq.T + bias) < 2**-8  # bf16 output rounding only
    assert _rel(x.grad, gq @ wq) < 2**-8
    assert _rel(layer.weight.grad, gq.T @ xq) < 2**-8


@pytest.mark.parametrize("power_2_scale", [False, True])
def test_current_scaling_recipe(power_2_scale: bool) -> None:
    """Every cast uses fmax / amax of its own tensor, or (power_2_scale) that ratio's
    power-of-two floor: the three GEMMs' results against float64 with those scales."""
    torch.manual_seed(5)
    layer = f8.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True) * 1000
    g = torch.randn(8, 16) * 1e-3
    x.retain_grad()
    y = _train_step(layer, x, g, Float8CurrentScaling(power_2_scale=power_2_scale))

    def refs(power_2: bool) -> dict[str, np.ndarray]:
        def cs(t: torch.Tensor, fmt: FP8Format) -> float:
            return current_scale_reference(t.detach().abs().max().item(), fmt.max, power_2)

        xq = qdq(x, cs(x, E4M3), E4M3)
        wq = qdq(layer.weight, cs(layer.weight, E4M3), E4M3)
        gq = qdq(g, cs(g, E5M2), E5M2)
        return {"y": xq @ wq.T, "dx": gq @ wq, "dw": gq.T @ xq}

    want, other = refs(power_2_scale), refs(not power_2_scale)
    got = {"y": y - layer.bias, "dx": x.grad, "dw": layer.weight.grad}
    for name, value in got.items():
        assert _rel(value, want[name]) < 1e-5, name  # float32 accumulation only
        # The other scale rule gives FP8 operands a quantum apart: it would fail the bound.
        assert _rel(want[name], other[name]) > 1e-3, name
    assert layer.fp8_meta.forward.amax_history.abs().sum().item() == 0  # no state involved


def test_outside_autocast_it_is_nn_linear() -> None:
    layer = f8.Linear(8, 4)
    assert isinstance(layer, torch.nn.Linear)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    with f8.autocast(enabled=False):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.fp8_meta.forward.amax_history.abs().sum().item() == 0
    # nn.Linear's argument name, in and outside FP8
    assert torch.equal(layer(input=x), layer(x))
    with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
        assert torch.equal(layer(input=x), layer(x))


def test_bad_input() -> None:
    layer = f8.Linear(8, 4)
    with f8.autocast():
        with pytest.raises(TypeError, match=r"^input must have dtype"):
            layer(torch.ones(2, 8, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"^input must have shape \(\*, 8\)"):
            layer(torch.randn(2, 7))
        with pytest.raises(ValueError, match="parameters are on cpu"):
            layer(torch.randn(2, 8, device="meta"))
        with pytest.raises(TypeError, match=r"parameters have dtype torch\.float64"):
            f8.Linear(8, 4, dtype=torch.float64)(torch.randn(2, 8))
    with pytest.raises(TypeError, match="fp8_output must be a bool"):
        f8.Linear(8, 4, fp8_output="yes")
    with pytest.raises(TypeError, match="in_features must be a positive int, got True"):
        f8.Linear(True, 4)
    with pytest.raises(ValueError, match="in_features must be a positive int, got -1"):
        f8.Linear(-1, 4)
    with pytest.raises(ValueError, match="out_features must be a positive int, got 0"):
        f8.Linear(16, 0)
    with pytest.raises(TypeError, match="bias must be a bool"):
        f8.Linear(16, 4, bias=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="recipe must be"):
        f8.autocast(recipe="hybrid")
    with pytest.raises(TypeError, match="enabled must be a bool"):
        f8.autocast(enabled=1)
    with pytest.raises(TypeError, match=r"amax_reduction_group must be None .* got str"):
        f8.autocast(amax_reduction_group="world")
    with pytest.raises(TypeError, match=r"amax_reduction_group must be None .* got int"):
        f8.autocast(amax_reduction_group=0)
    with pytest.raises(TypeError, match=r"fp8_group must be None .* got int"):
        f8.fp8_autocast(fp8_group=0)
    # What torch.distributed.new_group returns on a rank outside the group: that rank never
    # reduces (docs/distributed.md), so the same call works on every rank.
    outside = torch.distributed.GroupMember.NON_GROUP_MEMBER
    with f8.autocast(amax_reduction_group=outside):
        f8.Linear(16, 16)(torch.randn(4, 16)).sum().backward()


def test_double_backward_raises_instead_of_dropping_the_second_derivative() -> None:
    """A gradient penalty through an FP8 Linear (``create_graph=True``): the first derivatives
    are those of a plain backward; differentiating them again raises, where it silently
    contributed nothing before."""
    torch.manual_seed(0)
    layer = f8.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    recipe = DelayedScaling(amax_history_len=4)
    grads = []
    for create_graph in (False, True):
        with f8.autocast(recipe=recipe, calibrating=False):
            y = layer(x)
        grads.append(torch.autograd.grad(y.square().sum(), x, create_graph=create_graph)[0])
        layer.fp8_meta.reset_values()  # the same scales for both passes
    assert torch.equal(grads[0], grads[1].detach())
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (y.sum() + grads[1].square().sum()).backward()
    # A constant upstream gradient (that of y.sum()) leaves dx depending on the weight: the
    # penalty still raises instead of silently losing its weight term.
    with f8.autocast(recipe=recipe):
        y = layer(x)
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (y.sum() + dx.square().sum()).backward()


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(8, 32, 16), (64, 256, 256), (60, 200, 136)],
    ids=["small-gemm", "above-small-gemm", "padded"],
)
@pytest.mark.parametrize("backend", gemm.CPU_GEMM_BACKENDS)
def test_under_torch_autocast_the_gemm_computes_in_its_dtype(
    m: int, k: int, n: int, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.autocast(bfloat16) around float32 parameters: input and bias are cast to bfloat16
    as nn.Linear's are there, so the step equals, bit for bit, the same layer fed a bfloat16
    input with a bfloat16 bias outside torch.autocast, with backward() called inside the
    autocast; the gradients of the float32 leaves are float32. The FP8 GEMMs keep float32
    products under torch.autocast: torch.mm of upcast values (above SMALL_GEMM_MACS) and torch's
    CPU _scaled_mm both multiply with an mm that autocast would run in bfloat16."""
    monkeypatch.setattr(gemm, "_cpu_backend", [backend])
    torch.manual_seed(0)
    layer = f8.Linear(k, n)
    twin = f8.Linear(k, n)
    with torch.no_grad():
        twin.weight.copy_(layer.weight)
    twin.bias = torch.nn.Parameter(layer.bias.detach().to(torch.bfloat16))
    x = torch.randn(m, k, requires_grad=True)
    x16 = x.detach().to(torch.bfloat16).requires_grad_()
    recipe = DelayedScaling(amax_history_len=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with f8.autocast(recipe=recipe):
            y = layer(x)
        y.float().square().sum().backward()
    with f8.autocast(recipe=recipe):
        y16 = twin(x16)
    y16.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.equal(y, y16)
    assert x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
    assert torch.equal(x.grad, x16.grad.float())
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    for a, b in ((layer.fp8_meta.forward, twin.fp8_meta.forward),
                 (layer.fp8_meta.backward, twin.fp8_meta.backward)):  # fmt: skip
        assert torch.equal(a.amax_history, b.amax_history)


def test_high_precision_gradients_do_not_depend_on_where_backward_runs() -> None:
    """override_linear_precision's dgrad and wgrad are float32 products, as the FP8 GEMMs':
    backward() called inside torch.autocast gives the gradients it gives outside."""
    recipe = DelayedScaling(amax_history_len=4, override_linear_precision=(True, True, True))
    grads = []
    for inside in (False, True):
        torch.manual_seed(0)
        layer = f8.Linear(64, 32)
        x = torch.randn(48, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
            with torch.autocast("cpu", dtype=torch.bfloat16), f8.autocast(recipe=recipe):
                y = layer(x)
            y.float().square().sum().backward()
        grads.append((x.grad, layer.weight.grad, layer.bias.grad))
    for outside, inside in zip(*grads, strict=True):
        assert outside.dtype == torch.float32 and torch.equal(outside, inside)


def test_history_length_follows_the_recipe() -> None:
    layer = f8.Linear(16, 16)
    assert layer.fp8_meta.forward.amax_history.shape == (1024, 3)
    assert layer.fp8_meta.backward.amax_history.shape == (1024, 2)
    x = torch.randn(4, 16, requires_grad=True)
    _train_step(layer, x, torch.randn(4, 16), DelayedScaling(amax_history_len=5))
    assert layer.fp8_meta.forward.amax_history.shape == (5, 3)
    assert layer.fp8_meta.backward.amax_history.shape == (5, 2)
    with pytest.warns(UserWarning, match="from 5 to 3"):
        _train_step(layer, x, torch.randn(4, 16), DelayedScaling(amax_history_len=3))


def test_backward_update_runs_once_per_backward_pass() -> None:
    torch.manual_seed(6)
    model = torch.nn.Sequential(f8.Linear(16, 16), torch.nn.ReLU(), f8.Linear(16, 16))
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 16)
    with f8.autocast(recipe=recipe):
        loss = model(x).square().sum()
    for layer in (model[0], model[2]):
        assert layer.fp8_meta.backward.update_count.tolist() == [0, 0]
    loss.backward()
    for layer in (model[0], model[2]):
        assert layer.fp8_meta.backward.update_count.tolist() == [1, 0]
        assert layer.fp8_meta.backward.amax_history[0].tolist() == [0, 0]


def test_frozen_first_layer_still_updates_backward_states() -> None:
    """The update is queued on the autograd engine, so it does not depend on which module's
    backward runs last (a frozen first layer has no backward at all)."""
    model = torch.nn.Sequential(f8.Linear(16, 16), f8.Linear(16, 16))
    model[0].requires_grad_(False)
    with f8.autocast():
        loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    assert model[1].fp8_meta.backward.update_count[GRAD_OUTPUT].item() == 1
    assert model[0].fp8_meta.backward.update_count[GRAD_OUTPUT].item() == 0


def test_weight_cache_not_needed_when_no_gemm_uses_the_fp8_weight() -> None:
    layer = f8.Linear(16, 16)
    x = torch.randn(4, 16)
    recipe = DelayedScaling(override_linear_precision=(True, True, False))
    with f8.autocast(recipe=recipe):
        first = layer(x, is_first_microbatch=True)
        second = layer(x, is_first_microbatch=False)  # no FP8 weight is needed: no error
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert layer.fp8_meta.forward.amax_history[:, WEIGHT].abs().sum().item() == 0


@pytest.mark.parametrize(
    "backend,m,k,n",
    [("dequant", 3, 20, 24), ("scaled_mm", 16, 32, 32)],
    ids=["unaligned", "aligned scaled_mm"],
)
def test_a_float32_bias_is_added_before_the_one_rounding_to_bfloat16(
    monkeypatch: pytest.MonkeyPatch, backend: str, m: int, k: int, n: int
) -> None:
    """SPEC 4: the bias is added in high precision and the sum rounded once, on the padded path
    for sizes that are not multiples of 16 and in the ``scaled_mm`` backend (the path CUDA
    takes), neither of which can fuse a float32 bias into a bfloat16 GEMM. Integers |x| <= 16
    and |w| <= 8 are exact in E4M3 at the first step's scale 1, and their products and sums
    are exact in float32, so the reference is exact."""
    monkeypatch.setattr(gemm, "_cpu_backend", [backend])
    layer = f8.Linear(k, n)
    with torch.no_grad():
        layer.weight.copy_(torch.randint(-8, 9, (n, k)).float())
        layer.bias.fill_(0.75)
    x = torch.randint(-16, 17, (m, k)).to(torch.bfloat16)
    with f8.autocast(recipe=DelayedScaling()):
        y = layer(x)
    exact = x.double() @ layer.weight.detach().double().T + 0.75  # exact in float32 as well
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, exact.float().to(torch.bfloat16), rtol=0, atol=0)


def test_a_frozen_weight_needs_no_fp8_input_for_wgrad():
    """Kills L02 (linear.py `_LinearFunction.forward`: `wgrad_fp8 = wgrad_fp8 and
    weight.requires_grad` removed). With W frozen there is no wgrad, so with fprop in high
    precision (override) no FP8 GEMM reads x: x is never quantized, its slot keeps history 0
    (SPEC 3, "a slot that is never quantized keeps history 0 and scale 1"), and backward keeps
    no FP8 copy of x^T (SPEC 4: only what the FP8 GEMMs need is saved)."""
    torch.manual_seed(0)
    layer = f8.Linear(32, 16)
    layer.weight.requires_grad_(False)
    x = torch.randn(8, 32, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    recipe = DelayedScaling(amax_history_len=4, override_linear_precision=(True, False, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), f8.autocast(recipe=recipe):
        y = layer(x)
    y.sum().backward()
    fwd = layer.fp8_meta.forward
    assert torch.all(fwd.amax_history[:, INPUT] == 0)
    assert fwd.scale[INPUT].item() == 1.0
    assert fwd.update_count[INPUT].item() == 0
    assert fwd.update_count[WEIGHT].item() == 1  # dgrad still runs in FP8 from W
    fp8_saved = [shape for dtype, shape in saved if dtype.itemsize == 1]
    assert fp8_saved == [(32, 16)]  # W^T for dgrad only, no (32, 8) x^T
    assert x.grad is not None


def test_bias_gradient_is_the_float32_sum_rounded_to_dy_dtype_with_or_without_fp8() -> None:
    """db is the column sum of dY in float32 rounded once to dY's dtype (docs/semantics.md,
    section 4), whether the fused cast of dY computes it or, with both gradient GEMMs overridden
    to high precision, the backward sums dY itself: 256 + 1 = 257 becomes bfloat16's 256 in both,
    as under ``torch.autocast``."""
    grads = []
    for override in ((False, False, False), (False, True, True)):
        layer = f8.Linear(16, 16)
        x = torch.randn(3, 16).to(torch.bfloat16).requires_grad_()
        with f8.autocast(recipe=DelayedScaling(override_linear_precision=override)):
            y = layer(x)
        g = torch.zeros(3, 16, dtype=torch.bfloat16)
        g[0], g[1] = 256.0, 1.0
        y.backward(g)
        grads.append(layer.bias.grad)
    want = float(torch.tensor(257.0).to(torch.bfloat16))
    assert want == 256.0
    for grad in grads:
        assert grad.dtype == torch.float32
        assert grad.tolist() == [want] * 16


@pytest.mark.parametrize("differentiated", [(True, False), (False, True)], ids=["x", "w"])
@pytest.mark.parametrize("override", list(itertools.product([False, True], repeat=3)))
def test_only_operands_an_fp8_gemm_reads_are_cast(
    override: tuple[bool, bool, bool], differentiated: tuple[bool, bool]
) -> None:
    """The rule every frontend follows (tests/jax/test_dot.py and tests/keras/test_layers.py
    have the same table): x is cast for an FP8 fprop, or an FP8 wgrad that runs; W for an FP8
    fprop or dgrad; dY for an FP8 dgrad whose dX is needed or an FP8 wgrad whose dW is. A slot
    nothing casts records no amax and keeps its count."""
    need_dx, need_dw = differentiated
    layer = f8.Linear(24, 8, bias=False)
    layer.weight.requires_grad_(need_dw)
    x = torch.randn(12, 24, requires_grad=need_dx)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=2, override_linear_precision=override)):
        y = layer(x)
    y.sum().backward()
    fprop, dgrad, wgrad = (not hp for hp in override)
    fwd, bwd = layer.fp8_meta.forward.update_count, layer.fp8_meta.backward.update_count
    assert bool(fwd[INPUT]) == (fprop or (wgrad and need_dw))
    assert bool(fwd[WEIGHT]) == (fprop or dgrad)
    assert bool(bwd[0]) == ((dgrad and need_dx) or (wgrad and need_dw))
