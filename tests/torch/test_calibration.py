"""Calibration (``calibrating=True``), Transformer Engine's ``fp8_autocast`` spelling and one
registry per device."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8kit.torch as f8
from fp8kit.formats import E4M3
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from fp8kit.torch.state import ScalingState, update_states
from tests.reference import quantize_reference

E4M3_MAX = 448.0
INPUT, WEIGHT, OUTPUT = 0, 1, 2


def _expected_scale(amax: float) -> np.float32:
    """Delayed-scaling scale for a one-entry window, margin 0 (float32 division)."""
    return np.float32(E4M3_MAX) / np.float32(amax)


def _amax(t: torch.Tensor) -> float:
    return float(t.detach().abs().max())


def test_calibrating_updates_forward_scales_under_no_grad() -> None:
    torch.manual_seed(0)
    layer = f8.Linear(32, 16)
    x = torch.randn(8, 32) * 3
    recipe = DelayedScaling(amax_history_len=1)
    with torch.no_grad():
        with f8.autocast(recipe=recipe):  # plain inference: scales never move
            layer(x)
        assert layer.fp8_meta.forward.update_count.tolist() == [0, 0, 0]
        with f8.autocast(recipe=recipe, calibrating=True):
            layer(x)
    fwd = layer.fp8_meta.forward
    # The staging row held max(amax of both calls) = amax(x); L = 1: scale = fmax / amax.
    assert fwd.scale[INPUT].item() == _expected_scale(_amax(x))
    assert fwd.scale[WEIGHT].item() == _expected_scale(_amax(layer.weight))
    assert fwd.update_count.tolist() == [1, 1, 0]  # OUTPUT never quantized: skipped
    assert layer.fp8_meta.backward.update_count.tolist() == [0, 0]


def test_calibration_without_fp8_computes_in_high_precision_and_records() -> None:
    torch.manual_seed(1)
    layer = f8.Linear(32, 16)
    x = torch.randn(8, 32) * 5
    with (
        torch.no_grad(),
        f8.fp8_autocast(
            enabled=False, calibrating=True, fp8_recipe=DelayedScaling(amax_history_len=4)
        ),
    ):
        y = layer(x)
    assert torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    fwd = layer.fp8_meta.forward
    assert fwd.scale[INPUT].item() == _expected_scale(_amax(x))
    assert fwd.scale[WEIGHT].item() == _expected_scale(_amax(layer.weight))
    assert fwd.amax_history[-1, INPUT].item() == np.float32(_amax(x))


@pytest.mark.parametrize("flags", [(False,), (True, False)], ids=["False", "True-False"])
def test_calibration_without_fp8_ignores_the_weight_cache(flags: tuple[bool, ...]) -> None:
    """No FP8 weight is used in a calibration-only region, so ``is_first_microbatch`` caches
    nothing there and ``False`` on a fresh module is no error: every call computes in high
    precision and records the weight's amax."""
    torch.manual_seed(1)
    layer = f8.Linear(32, 16)
    x = torch.randn(8, 32) * 5
    recipe = DelayedScaling(amax_history_len=4)
    with torch.no_grad(), f8.autocast(enabled=False, calibrating=True, recipe=recipe):
        for flag in flags:
            y = layer(x, is_first_microbatch=flag)
            assert torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert layer.fp8_meta.forward.amax_history[0, WEIGHT].item() == np.float32(
            _amax(layer.weight)
        )
    assert layer._weight_cache == [None]
    with f8.autocast(recipe=recipe), pytest.raises(ValueError, match="is_first_microbatch=True"):
        layer(x, is_first_microbatch=False)  # FP8 now: nothing was cached for it to reuse


def test_calibrated_scales_then_drive_fp8_inference() -> None:
    """Calibration sets each forward slot of a LayerNormMLP to fmax / amax of what it saw, and
    the FP8 pass then quantizes with exactly those scales (float64 model of the two GEMMs)."""
    torch.manual_seed(2)
    block = f8.LayerNormMLP(32, 64)
    x = torch.randn(4, 32) * 7
    recipe = DelayedScaling(amax_history_len=2)
    with torch.no_grad():
        with f8.autocast(enabled=False, recipe=recipe, calibrating=True):
            block(x)
        with f8.autocast(recipe=recipe):
            y = block(x).numpy().astype(np.float64)
        # The high-precision pass computed these (fc1 INPUT, fc1 WEIGHT, fc2 INPUT, fc2 WEIGHT).
        ln = F.layer_norm(x, (32,), block.layer_norm_weight, block.layer_norm_bias, block.eps)
        act = F.gelu(F.linear(ln, block.fc1_weight, block.fc1_bias))
    seen = [ln, block.fc1_weight.detach(), act, block.fc2_weight.detach()]
    assert block.fp8_meta.forward.update_count.tolist() == [1, 1, 0, 1, 1, 0]
    scales = [_expected_scale(_amax(t)) for t in seen]
    assert block.fp8_meta.forward.scale[[0, 1, 3, 4]].tolist() == scales

    def dequantized(t: np.ndarray, scale: np.float32) -> np.ndarray:
        return quantize_reference(t, float(scale), E4M3)[0] / float(scale)

    b1, b2 = (b.detach().numpy().astype(np.float64) for b in (block.fc1_bias, block.fc2_bias))
    w1, w2 = (dequantized(t.numpy(), s) for t, s in ((seen[1], scales[1]), (seen[3], scales[3])))
    h = dequantized(ln.numpy(), scales[0]) @ w1.T + b1
    gelu = 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))
    a2 = dequantized(gelu.astype(np.float32), scales[2])
    want = a2 @ w2.T + b2
    # float32 accumulation of K = 64 products: error <= K * 2^-24 * sum |terms| per element. The
    # fixed seed puts no activation within float32 noise of an FP8 rounding midpoint.
    bound = 64 * 2.0**-24 * (np.abs(a2) @ np.abs(w2).T + np.abs(b2))
    assert np.all(np.abs(y - want) <= bound)


@pytest.mark.parametrize("enabled", [False, True])
def test_calibration_under_inference_mode_leaves_ordinary_buffers(enabled: bool) -> None:
    """A calibration pass under ``torch.inference_mode`` (with a history resize on the way):
    the FP8 buffers stay ordinary tensors, so training, another pass, a load and a reset work
    afterwards."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(f8.LayerNormMLP(32, 64), f8.LayerNormLinear(32, 16))
    saved = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    recipe = DelayedScaling(amax_history_len=16)
    x = torch.randn(4, 32)
    with torch.inference_mode(), f8.autocast(enabled=enabled, calibrating=True, recipe=recipe):
        model(x)
    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    assert states[0].update_count.max().item() == 1
    for state in states:
        assert not any(b.is_inference() for b in state.buffers()), state.label
    with torch.no_grad(), f8.autocast(calibrating=True, recipe=recipe):
        model(x)
    with f8.autocast(recipe=recipe):
        model(x).sum().backward()
    model.load_state_dict(saved, strict=False)
    model[1].reset_parameters()


def test_fp8_autocast_is_autocast_with_te_argument_names() -> None:
    recipe = DelayedScaling(amax_history_len=3)
    ctx = f8.fp8_autocast(enabled=True, calibrating=False, fp8_recipe=recipe, fp8_group=None)
    assert isinstance(ctx, f8.autocast)
    assert (ctx.enabled, ctx.recipe, ctx.group, ctx.calibrating) == (True, recipe, None, False)
    layer = f8.Linear(16, 16)
    with ctx:
        layer(torch.randn(4, 16))
    assert layer.fp8_meta.forward.update_count.tolist() == [1, 1, 0]


def test_bad_calibrating_arguments_name_the_parameter() -> None:
    with pytest.raises(TypeError, match="calibrating must be a bool, got 1"):
        f8.autocast(calibrating=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="calibrating=True needs a DelayedScaling recipe"):
        f8.autocast(recipe=Float8CurrentScaling(), calibrating=True)


def test_one_recipe_on_two_devices_updates_each_on_its_own() -> None:
    """States of one recipe on different devices get one registry (and pool) per device."""
    recipe = DelayedScaling(amax_history_len=2)
    cpu_state = ScalingState(1, history_len=2)
    meta_state = ScalingState(1, history_len=2, device="meta")
    cpu_state.record_amax(0, torch.tensor(4.0))
    update_states([cpu_state, meta_state], recipe, E4M3_MAX, direction="forward")
    assert cpu_state.scale.item() == _expected_scale(4.0)
    assert cpu_state.amax_history[:, 0].tolist() == [0.0, 4.0]
    assert meta_state.scale.device.type == "meta"


def test_calibration_without_fp8_ignores_nan_in_the_recorded_amax() -> None:
    """Kills Q03 (quantizer.py `FP8Run.record_forward`: `max |x|` with NaN propagating instead of
    `nan_ignoring_amax`). SPEC 2: the amax recorded is max|x| with NaN elements ignored; SPEC 9:
    NaN never enters the amax, never yields a NaN scale. The calibration-only path (enabled=False,
    calibrating=True) records without casting, so it needs its own check."""
    torch.manual_seed(0)
    layer = f8.Linear(16, 16)
    x = torch.full((2, 16), 0.5)
    x[0, 1], x[1, 2] = -3.0, float("nan")
    recipe = DelayedScaling(amax_history_len=2)
    with torch.no_grad(), f8.autocast(enabled=False, calibrating=True, recipe=recipe):
        layer(x)
    fwd = layer.fp8_meta.forward
    expected = float(np.nanmax(np.abs(x.numpy())))  # 3.0
    assert fwd.amax_history[-1, INPUT].item() == expected
    assert fwd.scale[INPUT].item() == np.float32(E4M3_MAX) / np.float32(expected)
    assert torch.isfinite(fwd.scale).all()


def test_calibration_without_fp8_keeps_the_max_of_several_calls_spec_13() -> None:
    """Kills B04 (buffers.py `record_amax`: the staging entry overwritten instead of
    max-accumulated). SPEC 10.13: amaxes 3, 5, 2 into one slot before one update -> one
    history entry 5, scale 89.6. The calibration-only path records without the casting kernel."""
    layer = f8.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=2)
    with torch.no_grad(), f8.autocast(enabled=False, calibrating=True, recipe=recipe):
        for amax in (3.0, 5.0, 2.0):
            layer(torch.full((2, 16), amax))
    fwd = layer.fp8_meta.forward
    assert fwd.amax_history[:, INPUT].tolist() == [0.0, 5.0]
    assert fwd.scale[INPUT].item() == np.float32(448.0) / np.float32(5.0)  # 89.6
