"""f8.MultiheadAttention: torch.nn.MultiheadAttention's behaviour, FP8 projections in autocast,
and convert_model on stock attention and encoder layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling

HIGH = DelayedScaling(amax_history_len=2, override_linear_precision=(True, True, True))
FP8 = DelayedScaling(amax_history_len=2)
E, H, L, S, N = 32, 4, 5, 7, 3

CONFIGS = {
    "self-batch-first": dict(batch_first=True),
    "seq-first": dict(),
    "kdim-vdim": dict(kdim=24, vdim=16, batch_first=True),
    "bias-kv-zero-attn": dict(add_bias_kv=True, add_zero_attn=True),
    "no-bias": dict(bias=False, batch_first=True),
}


def _pair(config: dict) -> tuple[nn.MultiheadAttention, f8.MultiheadAttention]:
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(E, H, **config)
    fp8 = f8.MultiheadAttention(E, H, **config)
    fp8.load_state_dict(stock.state_dict(), strict=False)
    return stock, fp8


def _inputs(config: dict, self_attention: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    first = config.get("batch_first", False)
    shape = (lambda t, d: (N, t, d)) if first else (lambda t, d: (t, N, d))
    q = torch.randn(*shape(L, E), generator=gen)
    if self_attention and "kdim" not in config:
        return q, q, q
    k = torch.randn(*shape(S, config.get("kdim", E)), generator=gen)
    v = torch.randn(*shape(S, config.get("vdim", E)), generator=gen)
    return q, k, v


def _masks(self_attention: bool) -> dict:
    src = L if self_attention else S
    gen = torch.Generator().manual_seed(2)
    kpm = torch.zeros(N, src, dtype=torch.bool)
    kpm[0, -2:] = True
    return {
        "none": {},
        "key_padding": {"key_padding_mask": kpm},
        "bool_attn": {"attn_mask": torch.rand(L, src, generator=gen) > 0.7},
        "float_attn+padding": {
            "attn_mask": torch.randn(L, src, generator=gen),
            "key_padding_mask": torch.zeros(N, src).masked_fill(kpm, float("-inf")),
        },
    }


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("self_attention", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_autocast_path_matches_pytorch_with_high_precision_gemms(
    config, self_attention, need_weights
) -> None:
    """The FP8 code path with every GEMM overridden to high precision is PyTorch's attention:
    this checks the masks, layouts, bias_kv / zero_attn and the weights, to float32 rounding."""
    stock, fp8 = _pair(config)
    q, k, v = _inputs(config, self_attention)
    for name, masks in _masks(self_attention and "kdim" not in config).items():
        want, want_w = stock(q, k, v, need_weights=need_weights, **masks)
        with f8.autocast(recipe=HIGH):
            got, got_w = fp8(q, k, v, need_weights=need_weights, **masks)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        if need_weights:
            torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert got_w is None


def test_causal_hint_and_unbatched_inputs_match_pytorch() -> None:
    stock, fp8 = _pair({"batch_first": True})
    q = torch.randn(N, L, E)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    want, _ = stock(q, q, q, attn_mask=causal, is_causal=True, need_weights=False)
    with f8.autocast(recipe=HIGH):
        got, _ = fp8(q, q, q, attn_mask=causal, is_causal=True, need_weights=False)
        with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
            fp8(q, q, q, is_causal=True, need_weights=False)
        single, single_w = fp8(q[0], q[0], q[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want1, want1_w = stock(q[0], q[0], q[0])
    torch.testing.assert_close(single, want1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(single_w, want1_w, rtol=1e-5, atol=1e-6)


def test_outside_autocast_it_is_pytorch_attention() -> None:
    stock, fp8 = _pair({"batch_first": True, "dropout": 0.0})
    q, k, v = _inputs({"batch_first": True}, False)
    for a, b in zip(stock(q, k, v), fp8(q, k, v), strict=True):
        assert torch.equal(a, b)


def test_fp8_projections_train_and_record_every_gemm() -> None:
    """Inside autocast the four projections are FP8 GEMMs: their slots record amaxes; the
    output stays within FP8 rounding of PyTorch's (E4M3 operands: at most 2^-4 relative per
    element, so about 2 * 2^-4 per GEMM before averaging over K = 32 terms; 0.1 bounds the
    norm-wise error of two chained GEMMs with softmax between)."""
    stock, fp8 = _pair({})
    q, k, v = _inputs({}, False)
    want, _ = stock(q, k, v)
    with f8.autocast(recipe=FP8):
        got, _ = fp8(q, k, v, need_weights=False)
    got.square().mean().backward()
    assert ((got - want).norm() / want.norm()).item() < 0.1
    fwd, bwd = fp8.fp8_meta.forward, fp8.fp8_meta.backward
    assert fwd.update_count.tolist() == [1, 1, 0] * 4  # q, k, v, out: INPUT and WEIGHT slots
    assert bwd.update_count.tolist() == [1, 0] * 4
    assert fp8.in_proj_weight.grad is not None and fp8.out_proj.weight.grad is not None


def test_convert_model_converts_encoder_attention_keeping_parameters() -> None:
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    params = {id(p) for p in layer.parameters()}
    x = torch.randn(N, L, E)
    layer.eval()
    with torch.no_grad():
        want = layer(x)
    f8.convert_model(layer)
    assert isinstance(layer.self_attn, f8.MultiheadAttention)
    assert isinstance(layer.linear1, f8.Linear) and isinstance(layer.linear2, f8.Linear)
    assert {id(p) for p in layer.parameters()} == params  # the same Parameter objects
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)  # outside autocast
    layer.train()
    with f8.autocast(recipe=FP8):
        out = layer(x)
    out.sum().backward()
    assert layer.self_attn.fp8_meta.forward.update_count.tolist() == [1, 1, 0] + [0] * 6 + [1, 1, 0]
    assert layer.self_attn.fp8_meta.forward.label == "self_attn.forward"


def test_fp8_inference_of_an_encoder_layer_skips_pytorchs_fast_path() -> None:
    """In eval under no_grad, nn.TransformerEncoderLayer's fused fast path would bypass the
    module's forward (no FP8 projection at all): f8.autocast turns it off, then restores it."""
    torch.manual_seed(4)
    layer = f8.convert_model(
        nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    ).eval()
    x = torch.randn(N, L, E)
    before = torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad(), f8.autocast(recipe=FP8):
        assert not torch.backends.mha.get_fastpath_enabled()
        layer(x)
    assert torch.backends.mha.get_fastpath_enabled() == before
    staged = layer.self_attn.fp8_meta.forward.amax_history[0]
    assert staged[0].item() == x.abs().max().item()  # INPUT of the packed q/k/v projection
