"""f8.TransformerLayer against an independent float64 re-implementation of TE's pre-LN layer."""

from __future__ import annotations

import math

import pytest
import torch

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling

H, F_, HEADS, S, B = 32, 64, 4, 6, 3


def _reference(layer: f8.TransformerLayer, x: torch.Tensor, mask: torch.Tensor | None):
    """float64 math of the layer from its parameters ([s, b, h] in and out, dropout off)."""
    p = {n: t.detach().double() for n, t in layer.named_parameters()}
    x = x.double().transpose(0, 1)  # [b, s, h]

    def norm(t, w, b):
        mu = t.mean(-1, keepdim=True)
        var = ((t - mu) ** 2).mean(-1, keepdim=True)
        return (t - mu) / torch.sqrt(var + 1e-5) * w + b

    h = norm(x, p["layernorm_qkv.layer_norm_weight"], p["layernorm_qkv.layer_norm_bias"])
    qkv = h @ p["layernorm_qkv.weight"].T + p["layernorm_qkv.bias"]
    d = H // HEADS
    q, k, v = (t.reshape(B, S, HEADS, d).transpose(1, 2) for t in qkv.chunk(3, -1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if mask is None:  # causal
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    else:
        scores = scores.masked_fill(mask, float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, H)
    y = x + attn @ p["proj.weight"].T + p["proj.bias"]
    h = norm(y, p["layernorm_mlp.layer_norm_weight"], p["layernorm_mlp.layer_norm_bias"])
    h = h @ p["layernorm_mlp.fc1_weight"].T + p["layernorm_mlp.fc1_bias"]
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    out = y + h @ p["layernorm_mlp.fc2_weight"].T + p["layernorm_mlp.fc2_bias"]
    return out.transpose(0, 1)


@pytest.mark.parametrize("mask_type", ["causal", "padding"])
def test_high_precision_forward_equals_the_float64_reference(mask_type) -> None:
    torch.manual_seed(0)
    layer = f8.TransformerLayer(H, F_, HEADS, self_attn_mask_type=mask_type, hidden_dropout=0.0,
                                attention_dropout=0.0)  # fmt: skip
    x = torch.randn(S, B, H)
    mask = None
    if mask_type == "padding":
        mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
        mask[0, ..., -2:] = True  # the last two tokens of sequence 0 are padding
    got = layer(x, mask)
    torch.testing.assert_close(got.double(), _reference(layer, x, mask), rtol=1e-5, atol=1e-5)


def test_fp8_forward_backward_records_all_four_gemms_within_rounding() -> None:
    """Inside autocast: QKV, proj, fc1, fc2 are FP8 GEMMs. Each E4M3 operand is off by at most
    2^-4 relative per element; four chained GEMMs with softmax and GELU between keep the output
    (dominated by the residual path) within 0.05 of the float64 result, norm-wise."""
    torch.manual_seed(1)
    layer = f8.TransformerLayer(H, F_, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(S, B, H, requires_grad=True)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
        out = layer(x)
    out.square().mean().backward()
    ref = _reference(layer, x.detach(), None)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.05
    for module in (layer.layernorm_qkv, layer.proj):
        assert module.fp8_meta.forward.update_count.tolist() == [1, 1, 0]
    assert layer.layernorm_mlp.fp8_meta.forward.update_count.tolist() == [1, 1, 0] * 2
    assert x.grad is not None and layer.layernorm_qkv.weight.grad is not None


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


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_attention_heads": 5}, ValueError, r"num_attention_heads \(5\) must divide"),
        ({"self_attn_mask_type": "arbitrary"}, ValueError, "self_attn_mask_type must be one of"),
        ({"hidden_dropout": 1.0}, ValueError, r"hidden_dropout must be a float in \[0, 1\)"),
        ({"attn_input_format": "thd"}, ValueError, "attn_input_format must be one of"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, error, match) -> None:
    args = {"hidden_size": H, "ffn_hidden_size": F_, "num_attention_heads": HEADS, **kwargs}
    with pytest.raises(error, match=match):
        f8.TransformerLayer(**args)


def test_masks_are_checked_against_the_mask_type() -> None:
    causal = f8.TransformerLayer(H, F_, HEADS)
    padding = f8.TransformerLayer(H, F_, HEADS, self_attn_mask_type="padding")
    x = torch.randn(S, B, H)
    with pytest.raises(ValueError, match="only used with self_attn_mask_type='padding'"):
        causal(x, torch.zeros(B, 1, 1, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs an attention_mask"):
        padding(x)
    with pytest.raises(TypeError, match="attention_mask must be a bool tensor"):
        padding(x, torch.zeros(B, 1, 1, S))
