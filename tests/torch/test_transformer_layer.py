"""f8.TransformerLayer against an independent float64 re-implementation of TE's pre-LN layer."""

from __future__ import annotations

import math

import pytest
import torch

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import layers, linear
from tests.torch.fp8_gemm_spy import assert_e4m3_gemm, spy_fp8_linear

H, F_, HEADS, S, B = 32, 64, 4, 6, 3
EPS = 1e-5


def _norm64(t: torch.Tensor, kind: str, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if kind == "RMSNorm":
        return t / torch.sqrt((t**2).mean(-1, keepdim=True) + EPS) * w
    mu = t.mean(-1, keepdim=True)
    var = ((t - mu) ** 2).mean(-1, keepdim=True)
    return (t - mu) / torch.sqrt(var + EPS) * w + b


def _act64(h: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    if kind == "relu":
        return h.clamp(min=0)
    a, g = h.chunk(2, -1)
    return a / (1 + torch.exp(-a)) * g


def _attention64(qkv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[b, s, 3h] -> [b, s, h]: softmax(q k^T / sqrt(d)) v per head; ``mask`` True = masked
    out (TE's convention, [b, 1, 1, s]); None = causal."""
    b, s, _ = qkv.shape
    d = H // HEADS
    q, k, v = (t.reshape(b, s, HEADS, d).transpose(1, 2) for t in qkv.chunk(3, -1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if mask is None:
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, H)


def _reference(layer: f8.TransformerLayer, x: torch.Tensor, mask: torch.Tensor | None):
    """float64 math of the layer from its parameters ([s, b, h] or [b, s, h] as the layer's
    attn_input_format, dropout off)."""
    p = {n: t.detach().double() for n, t in layer.named_parameters()}
    get = lambda name: p.get(name, torch.zeros(()))  # noqa: E731 (no bias: adds zero)
    norm, act = layer.layernorm_qkv.normalization, layer.layernorm_mlp.activation
    sbhd = layer.attn_input_format == "sbhd"
    x = x.double().transpose(0, 1) if sbhd else x.double()  # [b, s, h]
    h = _norm64(
        x, norm, p["layernorm_qkv.layer_norm_weight"], p.get("layernorm_qkv.layer_norm_bias")
    )
    attn = _attention64(h @ p["layernorm_qkv.weight"].T + get("layernorm_qkv.bias"), mask)
    y = x + attn @ p["proj.weight"].T + get("proj.bias")
    h = _norm64(
        y, norm, p["layernorm_mlp.layer_norm_weight"], p.get("layernorm_mlp.layer_norm_bias")
    )
    h = _act64(h @ p["layernorm_mlp.fc1_weight"].T + get("layernorm_mlp.fc1_bias"), act)
    out = y + h @ p["layernorm_mlp.fc2_weight"].T + get("layernorm_mlp.fc2_bias")
    return out.transpose(0, 1) if sbhd else out


def _padding_mask() -> torch.Tensor:
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., -2:] = True  # the last two tokens of sequence 0 are padding
    mask[2, ..., -1:] = True
    return mask


def _randomize_norms(layer: f8.TransformerLayer) -> None:
    """Norm weights and biases away from 1 and 0, so the reference checks they are used."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "layer_norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen) if "weight" in name
                        else 0.3 * torch.randn(p.shape, generator=gen))  # fmt: skip


CASES = {
    "causal-layernorm-gelu": {},
    "padding": {"self_attn_mask_type": "padding"},
    "rmsnorm-swiglu-no-bias": {"normalization": "RMSNorm", "activation": "swiglu", "bias": False},
    "relu-bshd-padding": {"activation": "relu", "attn_input_format": "bshd",
                          "self_attn_mask_type": "padding"},
}  # fmt: skip


@pytest.mark.parametrize("kwargs", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("in_autocast", [False, True], ids=["plain", "autocast-high-precision"])
def test_high_precision_forward_equals_the_float64_reference(kwargs, in_autocast) -> None:
    """Outside autocast, and inside with every GEMM overridden to high precision (the FP8 code
    path's structure: masks, layout, residuals), the layer is the float64 math to 1e-5."""
    torch.manual_seed(0)
    layer = f8.TransformerLayer(H, F_, HEADS, hidden_dropout=0.0, attention_dropout=0.0, **kwargs)
    _randomize_norms(layer)
    bshd = kwargs.get("attn_input_format") == "bshd"
    x = torch.randn(B, S, H) if bshd else torch.randn(S, B, H)
    mask = _padding_mask() if kwargs.get("self_attn_mask_type") == "padding" else None
    high = DelayedScaling(amax_history_len=2, override_linear_precision=(True, True, True))
    with f8.autocast(enabled=in_autocast, recipe=high):
        got = layer(x, mask)
    torch.testing.assert_close(got.double(), _reference(layer, x, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_type", ["causal", "padding"])
def test_fp8_gemms_are_e4m3_gemms_and_the_rest_is_float64_math(monkeypatch, mask_type) -> None:
    """Inside autocast: QKV, proj, fc1 and fc2 are E4M3 GEMMs of the operands they got (each
    checked against float64 math, tests/torch/fp8_gemm_spy.py), and every high-precision step
    between them (norms, attention, GELU, residuals) is the float64 math of its inputs to
    float32 rounding (1e-5). Training records every forward and backward slot in use."""
    torch.manual_seed(1)
    layer = f8.TransformerLayer(H, F_, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type=mask_type)  # fmt: skip
    _randomize_norms(layer)
    x = torch.randn(S, B, H, requires_grad=True)
    mask = _padding_mask() if mask_type == "padding" else None
    calls = spy_fp8_linear(monkeypatch, layers, linear)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
        out = layer(x, mask)
    out.square().mean().backward()

    qkv, proj, fc1, fc2 = calls
    for call in calls:
        assert_e4m3_gemm(call)
    assert (qkv.weight.shape, proj.weight.shape) == ((3 * H, H), (H, H))
    assert (fc1.weight.shape, fc2.weight.shape) == ((F_, H), (H, F_))
    p = {n: t.detach().double() for n, t in layer.named_parameters()}
    xb = x.detach().double().transpose(0, 1)  # [b, s, h]

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    close(qkv.x, _norm64(xb, "LayerNorm", p["layernorm_qkv.layer_norm_weight"],
                         p["layernorm_qkv.layer_norm_bias"]))  # fmt: skip
    close(proj.x, _attention64(qkv.y.double(), mask))
    y = xb + proj.y.double()
    close(fc1.x, _norm64(y, "LayerNorm", p["layernorm_mlp.layer_norm_weight"],
                         p["layernorm_mlp.layer_norm_bias"]))  # fmt: skip
    close(fc2.x, _act64(fc1.y.double(), "gelu"))
    close(out.detach().transpose(0, 1), y + fc2.y.double())

    for module in (layer.layernorm_qkv, layer.proj):
        assert module.fp8_meta.forward.update_count.tolist() == [1, 1, 0]
        assert module.fp8_meta.backward.update_count.tolist() == [1, 0]
    assert layer.layernorm_mlp.fp8_meta.forward.update_count.tolist() == [1, 1, 0] * 2
    assert layer.layernorm_mlp.fp8_meta.backward.update_count.tolist() == [1, 0] * 2
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is not None for p in layer.parameters())


def test_bshd_layout_and_te_arguments() -> None:
    torch.manual_seed(2)
    sbhd = f8.TransformerLayer(H, F_, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    bshd = f8.TransformerLayer(H, F_, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                               attn_input_format="bshd", fuse_qkv_params=True,
                               params_dtype=torch.float32)  # fmt: skip
    bshd.load_state_dict(sbhd.state_dict())
    x = torch.randn(S, B, H)
    torch.testing.assert_close(bshd(x.transpose(0, 1)).transpose(0, 1), sbhd(x))
    rms = f8.TransformerLayer(H, F_, HEADS, normalization="RMSNorm", activation="swiglu")
    assert rms.layernorm_mlp.fc1_weight.shape == (2 * F_, H)
    assert rms.layernorm_qkv.layer_norm_bias is None


def test_te_init_methods_fill_the_weights_and_zero_the_biases() -> None:
    """TE's init_method (QKV, fc1) and output_layer_init_method (projection, fc2): the weights
    are what the callables make, the biases 0, again after reset_parameters."""
    layer = f8.TransformerLayer(
        H, F_, HEADS, init_method=torch.nn.init.ones_, output_layer_init_method=torch.nn.init.zeros_
    )
    for _ in range(2):
        mlp, qkv, proj = layer.layernorm_mlp, layer.layernorm_qkv, layer.proj
        assert torch.equal(qkv.weight, torch.ones_like(qkv.weight))
        assert torch.equal(mlp.fc1_weight, torch.ones_like(mlp.fc1_weight))
        assert not proj.weight.any() and not mlp.fc2_weight.any()
        for bias in (qkv.bias, proj.bias, mlp.fc1_bias, mlp.fc2_bias):
            assert not bias.any()
        for module in (qkv, proj, mlp):
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)
            module.reset_parameters()
    plain = f8.TransformerLayer(H, F_, HEADS)  # torch.nn.Linear's initialisation
    assert plain.proj.bias.any() and plain.layernorm_mlp.fc2_bias.any()


def test_is_first_microbatch_reaches_every_gemm_and_torch_autocast_sets_the_dtype() -> None:
    """TE's forward(..., is_first_microbatch): False reuses the FP8 weights cached by True in all
    four GEMMs. Under torch.autocast the input is cast first (TE), so the output has its
    dtype."""
    torch.manual_seed(5)
    layer = f8.TransformerLayer(H, F_, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(S, B, H)
    recipe = DelayedScaling(amax_history_len=2)
    with f8.autocast(recipe=recipe):
        first = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            for p in layer.parameters():
                if p.dim() == 2:
                    p.mul_(3.0)  # the cached FP8 weights must not see this
        again = layer(x, is_first_microbatch=False)
        fresh = layer(x)
    assert torch.equal(first, again) and not torch.equal(first, fresh)
    with pytest.raises(TypeError, match="is_first_microbatch"):
        layer(x, is_first_microbatch=1)
    with torch.autocast("cpu", dtype=torch.bfloat16), f8.autocast(recipe=recipe):
        assert layer(x).dtype == torch.bfloat16


def test_a_meta_layer_runs_forward_outside_autocast() -> None:
    """A meta-device layer (shape tracing, deferred initialisation) has no autocast state to ask:
    its forward runs and keeps the device."""
    layer = f8.TransformerLayer(H, F_, HEADS, device="meta")
    assert layer(torch.empty(S, B, H, device="meta")).device.type == "meta"


def test_modules_saved_before_init_method_existed_still_reset() -> None:
    """A module unpickled from an older fp8kit has no init_method attribute: reset_parameters
    falls back to torch.nn.Linear's initialisation."""
    for module in (f8.Linear(8, 4), layers.LayerNormLinear(8, 4), layers.LayerNormMLP(8, 16)):
        module.__dict__.pop("init_method")
        module.__dict__.pop("output_layer_init_method", None)
        module.reset_parameters()
        assert all(torch.isfinite(p).all() for p in module.parameters())


def test_dropout_is_active_in_training_only() -> None:
    torch.manual_seed(3)
    layer = f8.TransformerLayer(H, F_, HEADS, hidden_dropout=0.5, attention_dropout=0.5)
    x = torch.randn(S, B, H)
    layer.eval()
    torch.testing.assert_close(layer(x).double(), _reference(layer, x, None), rtol=1e-5, atol=1e-5)
    layer.train()
    assert not torch.allclose(layer(x), layer(x))


def test_a_checkpoint_without_fp8_state_is_said_once(caplog) -> None:
    torch.manual_seed(4)
    trained = f8.TransformerLayer(H, F_, HEADS)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
        trained(torch.randn(S, B, H)).sum().backward()
    fresh = f8.TransformerLayer(H, F_, HEADS)
    with caplog.at_level("INFO", logger="fp8kit"):
        fresh.load_state_dict(f8.plain_state_dict(trained), strict=True)
    assert [r.getMessage() for r in caplog.records] == [
        "fp8kit: the loaded state_dict has no FP8 state for 3 FP8 module(s) "
        "(layernorm_qkv.fp8_meta, proj.fp8_meta, layernorm_mlp.fp8_meta): they start fresh "
        "(amax history 0, scale 1)"
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_attention_heads": 5}, ValueError, r"num_attention_heads \(5\) must divide"),
        ({"self_attn_mask_type": "arbitrary"}, ValueError, "self_attn_mask_type must be one of"),
        ({"hidden_dropout": 1.0}, ValueError, r"hidden_dropout must be a float in \[0, 1\)"),
        ({"attention_dropout": "0.1"}, TypeError, r"attention_dropout must be a float in \[0, 1\)"),
        ({"attn_input_format": "thd"}, ValueError, "attn_input_format must be one of"),
        ({"normalization": "BatchNorm"}, ValueError, "normalization must be one of"),
        ({"activation": "tanh"}, ValueError, "activation must be one of"),
        ({"fuse_qkv_params": 1}, TypeError, "fuse_qkv_params must be a bool"),
        (
            {"layernorm_epsilon": 0.0},
            ValueError,
            "layernorm_epsilon must be a positive finite float",
        ),
        ({"ffn_hidden_size": 0}, ValueError, "ffn_hidden_size must be a positive int"),
        ({"init_method": 0.02}, TypeError, "init_method must be None or a callable"),
        ({"output_layer_init_method": "normal"}, TypeError, "output_layer_init_method must be"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, error, match) -> None:
    args = {"hidden_size": H, "ffn_hidden_size": F_, "num_attention_heads": HEADS, **kwargs}
    with pytest.raises(error, match=match):
        f8.TransformerLayer(**args)


def test_masks_and_inputs_are_checked() -> None:
    causal = f8.TransformerLayer(H, F_, HEADS)
    padding = f8.TransformerLayer(H, F_, HEADS, self_attn_mask_type="padding")
    x = torch.randn(S, B, H)
    with pytest.raises(ValueError, match="only used with self_attn_mask_type='padding'"):
        causal(x, torch.zeros(B, 1, 1, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs an attention_mask"):
        padding(x)
    with pytest.raises(TypeError, match="attention_mask must be a bool tensor"):
        padding(x, torch.zeros(B, 1, 1, S))
    with pytest.raises(TypeError, match=r"attention_mask must be a bool tensor .* got list"):
        padding(x, [[True]])  # an AttributeError before
    with pytest.raises(
        ValueError, match=r"attention_mask must have shape \[b, 1, 1, s\] = \[3, 1, 1, 6\]"
    ):
        padding(x, torch.zeros(B, S, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got \[3, 1, 1, 5\]"):
        padding(x, torch.zeros(B, 1, 1, S - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"hidden_states must have shape \[s, b, 32\]"):
        causal(torch.randn(S, B, H + 1))
    with pytest.raises(TypeError, match=r"hidden_states must be a torch\.Tensor, got list"):
        causal([[0.0] * H])
    with f8.autocast(), pytest.raises(TypeError, match="hidden_states must have dtype"):
        causal(torch.randn(S, B, H, dtype=torch.float64))
