"""f8.MultiheadAttention: torch.nn.MultiheadAttention's behaviour, FP8 projections in autocast,
and convert_model on stock attention and encoder layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import attention
from tests.torch.fp8_gemm_spy import assert_e4m3_gemm, spy_fp8_linear

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
    fp8.load_state_dict(stock.state_dict(), strict=True)  # a plain state_dict loads strictly
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
        "per_head_attn+padding": {  # (N * heads, L, S): one mask per batch entry and head
            "attn_mask": torch.randn(N * H, L, src, generator=gen),
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


def _attention64(q, k, v, heads: int, mask=None) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(d) + mask) v per head: q (L, N, E), k and v (S, N, E) ->
    (L * N, E)."""
    tgt, n, e = q.shape
    d = e // heads
    q, k, v = (t.double().reshape(t.shape[0], n * heads, d).transpose(0, 1) for t in (q, k, v))
    scores = q @ k.transpose(1, 2) / d**0.5
    if mask is not None:
        scores = scores + mask
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(tgt * n, e)


@pytest.mark.parametrize("self_attention", [True, False])
def test_fp8_projections_are_e4m3_gemms_and_the_core_is_float64_attention(
    monkeypatch, self_attention
) -> None:
    """Inside autocast the input projection (one packed GEMM for self-attention, else three)
    and the output projection are E4M3 GEMMs of their operands (checked one by one against
    float64 math, tests/torch/fp8_gemm_spy.py), the attention core between them is PyTorch's
    attention in high precision (float32 against float64: 1e-5), and training records every
    forward and backward slot of the GEMMs used."""
    config = {} if self_attention else {"kdim": 24, "vdim": 16}
    _, fp8 = _pair(config)
    q, k, v = _inputs(config, self_attention)
    kpm = torch.zeros(N, q.shape[0] if self_attention else k.shape[0], dtype=torch.bool)
    kpm[1, -2:] = True
    calls = spy_fp8_linear(monkeypatch, attention)
    assert fp8.fp8_meta.forward.scale.eq(1).all()  # fresh state: every cast at scale 1
    with f8.autocast(recipe=FP8):
        got, _ = fp8(q, k, v, key_padding_mask=kpm, need_weights=False)
    got.square().mean().backward()

    in_proj, out_proj = calls[:-1], calls[-1]
    assert [c.gemm for c in calls] == ([0, 3] if self_attention else [0, 1, 2, 3])
    for call in calls:
        assert_e4m3_gemm(call)
    if self_attention:
        projected = in_proj[0].y.chunk(3, dim=-1)
    else:
        projected = tuple(c.y for c in in_proj)
        for call, operand in zip(in_proj, (q, k, v), strict=True):
            assert torch.equal(call.x, operand)
    mask = torch.zeros(N, 1, 1, kpm.shape[1], dtype=torch.float64).masked_fill(
        kpm[:, None, None, :], float("-inf")
    )
    mask = mask.expand(N, H, 1, -1).reshape(N * H, 1, -1)
    core = _attention64(*projected, heads=H, mask=mask)
    assert out_proj.x.shape == q.shape  # the projections take the input's own layout
    torch.testing.assert_close(out_proj.x.double().reshape(-1, E), core, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.reshape(-1, E), out_proj.y.reshape(-1, E))
    used = [0, 3] if self_attention else [0, 1, 2, 3]
    fwd = fp8.fp8_meta.forward.update_count.view(4, 3)
    bwd = fp8.fp8_meta.backward.update_count.view(4, 2)
    for g in range(4):  # INPUT and WEIGHT slots forward, GRAD_OUTPUT backward; OUTPUT unused
        assert fwd[g].tolist() == ([1, 1, 0] if g in used else [0, 0, 0]), g
        assert bwd[g].tolist() == ([1, 0] if g in used else [0, 0]), g
    assert fp8.out_proj.weight.grad is not None
    params = [fp8.in_proj_weight] if self_attention else [fp8.q_proj_weight, fp8.k_proj_weight]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def test_need_weights_in_fp8_are_the_softmax_of_the_fp8_projections(monkeypatch) -> None:
    """need_weights=True inside autocast: the weights are the high-precision probabilities
    softmax(q k^T / sqrt(d)) of the FP8-projected q and k, averaged over heads by default."""
    _, fp8 = _pair({"batch_first": True})
    q, _, _ = _inputs({"batch_first": True}, True)
    calls = spy_fp8_linear(monkeypatch, attention)
    with f8.autocast(recipe=FP8):
        _, weights = fp8(q, q, q)
        _, per_head = fp8(q, q, q, average_attn_weights=False)
    qkv = calls[0].y.double()  # the packed projection in the input's layout: (N, L, 3E)
    assert qkv.shape == (N, L, 3 * E)
    d = E // H
    qh, kh, _ = (t.reshape(N, L, H, d).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    probs = (qh @ kh.transpose(-1, -2) / d**0.5).softmax(-1)  # (N, H, L, L)
    torch.testing.assert_close(per_head.double(), probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.double(), probs.mean(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_in_training_draws_as_pytorch(need_weights) -> None:
    """Same generator state, same dropout mask: the FP8 code path (GEMMs overridden to high
    precision) equals PyTorch's attention in training mode with dropout."""
    stock, fp8 = _pair({"batch_first": True, "dropout": 0.5})
    q, k, v = _inputs({"batch_first": True}, False)
    torch.manual_seed(7)
    want, want_w = stock(q, k, v, need_weights=need_weights)
    torch.manual_seed(7)
    with f8.autocast(recipe=HIGH):
        got, got_w = fp8(q, k, v, need_weights=need_weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if need_weights:
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (((N, L, E), (N, S, E), (N, S, E, 1)), ValueError,
         r"value must have as many dimensions as query \(3\), got shape \(3, 7, 32, 1\)"),
        (((N, L, E), (N, S, 24), (N, S, E)), ValueError,
         r"key must have 32 features in its last dimension \(kdim=32\), got shape \(3, 7, 24\)"),
        (((N, L, E), (N, S, E), (N, S - 1, E)), ValueError,
         r"key and value must agree in all but the last dimension"),
        (((N, L, E), (N + 1, S, E), (N + 1, S, E)), ValueError,
         r"query and key must have the same batch size"),
        (((N, L, E, 1), (N, S, E), (N, S, E)), ValueError,
         r"query must be 2-D \(L, E\) unbatched or 3-D batched \(\(N, L, E\)\)"),
        (((N, L, 16), (N, S, E), (N, S, E)), ValueError,
         r"query must have embed_dim=32 features"),
    ],
)  # fmt: skip
def test_bad_inputs_in_autocast_name_the_argument(args, error, match) -> None:
    _, fp8 = _pair({"batch_first": True})
    q, k, v = (torch.randn(*shape) for shape in args)
    with f8.autocast(recipe=FP8), pytest.raises(error, match=match):
        fp8(q, k, v)


def test_bad_masks_and_dtypes_in_autocast_name_the_argument() -> None:
    _, fp8 = _pair({"batch_first": True})
    q = torch.randn(N, L, E)
    with f8.autocast(recipe=FP8):
        with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(3, 5\)"):
            fp8(q, q, q, key_padding_mask=torch.zeros(N, L + 1, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"attn_mask must have shape \(5, 5\) or \(12, 5, 5\)"):
            fp8(q, q, q, attn_mask=torch.zeros(N, L, L, dtype=torch.bool))
        with pytest.raises(TypeError, match=r"key must have dtype torch\.float32, torch\.bfloat16"):
            fp8(q, q.double(), q)
        with pytest.raises(TypeError, match=r"key must have query's dtype torch\.float32, got"):
            fp8(q, q.bfloat16(), q.bfloat16())
        with pytest.raises(TypeError, match=r"value must have query's dtype torch\.float32"):
            fp8(q, q, q.half())
        with pytest.raises(TypeError, match=r"attn_mask must be a bool mask or a float mask"):
            fp8(q, q, q, attn_mask=torch.zeros(L, L, dtype=torch.float64))
        with pytest.raises(TypeError, match=r"attn_mask must be a bool mask or a float mask"):
            fp8(q, q, q, attn_mask=torch.zeros(L, L, dtype=torch.int64))
        with pytest.raises(TypeError, match=r"key_padding_mask must be a bool mask or a float"):
            fp8(q, q, q, key_padding_mask=torch.zeros(N, L, dtype=torch.float16))
    assert fp8.fp8_meta.forward.amax_history.abs().sum() == 0  # nothing ran


@pytest.mark.parametrize("need_weights", [True, False])
def test_mixed_dtypes_match_pytorch_under_torch_autocast(need_weights) -> None:
    """Under ``torch.autocast`` PyTorch's attention takes float32 queries with bfloat16 keys and
    values and a float32 float mask (``generate_square_subsequent_mask``), and its outputs and
    weights come out in the autocast dtype: so do fp8kit's."""
    stock, fp8 = _pair({"batch_first": True})
    q, k, v = _inputs({"batch_first": True}, False)
    k, v = k.bfloat16(), v.bfloat16()
    masks = {
        "causal": {"attn_mask": torch.zeros(L, S).masked_fill(torch.ones(L, S).triu(1) > 0, -1e4)},
        "float-padding": _masks(False)["float_attn+padding"],
    }
    for name, mask in masks.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, want_w = stock(q, k, v, need_weights=need_weights, **mask)
            with f8.autocast(recipe=HIGH):
                got, got_w = fp8(q, k, v, need_weights=need_weights, **mask)
        assert got.dtype == want.dtype == torch.bfloat16, name
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)
        if need_weights:
            assert got_w.dtype == want_w.dtype == torch.bfloat16, name
            torch.testing.assert_close(got_w, want_w, rtol=2e-2, atol=1e-2, msg=name)


def test_a_bfloat16_model_takes_a_float32_causal_mask() -> None:
    """A bfloat16 encoder with ``nn.Transformer.generate_square_subsequent_mask`` (float32):
    PyTorch's attention takes it (scaled_dot_product_attention casts a float mask to the
    query's dtype); fp8kit casts it the same way, with or without the weights."""
    stock, fp8 = _pair({"batch_first": True})
    stock.bfloat16(), fp8.bfloat16()
    q = torch.randn(N, L, E, dtype=torch.bfloat16)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    want, _ = stock(q, q, q, attn_mask=causal, need_weights=False)
    with f8.autocast(recipe=HIGH):
        got, _ = fp8(q, q, q, attn_mask=causal, need_weights=False)
        got_with_weights, weights = fp8(q, q, q, attn_mask=causal)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_with_weights, want, rtol=2e-2, atol=2e-2)
    assert weights.dtype == torch.bfloat16
    assert (weights.triu(1) == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_mask_of_a_half_precision_model_is_added_in_float32_as_pytorch_does(
    dtype,
) -> None:
    """Outside torch.autocast PyTorch adds a float32 mask to half-precision scores without
    rounding it (an ALiBi-like bias loses bits in bfloat16; a fully masked row of -1e9 would be
    -inf in float16, and its output 0 or NaN): fp8kit too, and its weights are the float32
    softmax, rounded once."""
    stock, fp8 = _pair({"batch_first": True})
    stock.to(dtype), fp8.to(dtype)
    q = torch.randn(N, L, E, dtype=dtype)
    bias = -torch.arange(L * L, dtype=torch.float32).reshape(L, L) * 1.7  # down to -40.8
    bias[0] = -1e9  # a fully masked row, finite in float32
    want, _ = stock(q, q, q, attn_mask=bias, need_weights=False)
    with f8.autocast(recipe=HIGH):
        got, _ = fp8(q, q, q, attn_mask=bias, need_weights=False)
        _, weights = fp8(q, q, q, attn_mask=bias, average_attn_weights=False)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    assert weights.dtype == dtype and torch.isfinite(weights).all()


def test_params_dtype_is_te_spelling_of_dtype() -> None:
    mha = f8.MultiheadAttention(E, H, kdim=24, vdim=16, params_dtype=torch.bfloat16)
    assert {p.dtype for p in mha.parameters()} == {torch.bfloat16}
    assert mha.fp8_meta.forward.scale.dtype == torch.float32
    layer = f8.TransformerLayer(E, 64, H, params_dtype=torch.bfloat16)
    assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}
    for make in (
        lambda **kw: f8.MultiheadAttention(E, H, **kw),
        lambda **kw: f8.TransformerLayer(E, 64, H, **kw),
    ):
        with pytest.raises(
            ValueError, match=r"dtype=torch\.float32 and params_dtype=torch\.bfloat16"
        ):
            make(dtype=torch.float32, params_dtype=torch.bfloat16)
        with pytest.raises(TypeError, match=r"^params_dtype must be a torch\.dtype \(torch"):
            make(params_dtype="bf16")


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
    # A random projection of the output: the layer ends in a LayerNorm, whose output has a
    # constant sum and a constant sum of squares (their gradients are zero).
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    assert layer.self_attn.fp8_meta.forward.update_count.tolist() == [1, 1, 0] + [0] * 6 + [1, 1, 0]
    assert layer.self_attn.fp8_meta.backward.update_count.tolist() == [1, 0] + [0] * 4 + [1, 0]
    for linear in (layer.linear1, layer.linear2):  # every projection of the layer ran in FP8
        assert linear.fp8_meta.forward.update_count.tolist() == [1, 1, 0]
        assert linear.fp8_meta.backward.update_count.tolist() == [1, 0]
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


def _encoder(layers: int) -> nn.Module:
    torch.manual_seed(4)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=True) if layers else layer


def _fp8_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (f8.Linear, f8.MultiheadAttention))]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layers", [0, 2], ids=["layer", "encoder"])
def test_converted_encoder_runs_fp8_in_eval_and_calibrates_under_no_grad(layers) -> None:
    """In eval mode without grad PyTorch's encoder fast path calls one fused kernel with the
    submodules' parameters (and the encoder packs a padded batch into a nested tensor): inside
    f8.autocast the converted model must still run its FP8 modules, so calibration works."""
    stock = _encoder(layers).eval()
    model = f8.convert_model(_encoder(layers)).eval()
    x = torch.randn(N, L, E)
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[0, -2:] = True
    with torch.no_grad():
        # outside autocast: PyTorch's own result (the encoder keeps its fused path)
        want = stock(x, src_key_padding_mask=kpm)
        got = model(x, src_key_padding_mask=kpm)
        assert torch.equal(got, want)
        with f8.autocast(recipe=FP8, calibrating=True):
            calibrated = model(x, src_key_padding_mask=kpm)
    assert torch.backends.mha.get_fastpath_enabled()  # restored
    assert not calibrated.is_nested
    for module in _fp8_modules(model):  # every projection recorded and updated its forward slots
        counts = module.fp8_meta.forward.update_count.view(-1, 3)
        assert counts[0].tolist() == [1, 1, 0], module.fp8_meta.forward.label
    # same math as the unfused high-precision path, up to FP8 rounding
    rows = ~kpm.reshape(-1)  # padded rows are zeros on the fused path, computed on the other
    err = (calibrated - want).reshape(-1, E)[rows].norm() / want.reshape(-1, E)[rows].norm()
    assert 0 < err.item() < 0.1


def test_the_fast_path_flag_is_restored_when_the_call_raises() -> None:
    model = f8.convert_model(_encoder(0)).eval()
    torch.backends.mha.set_fastpath_enabled(True)
    with torch.no_grad(), f8.autocast(recipe=FP8), pytest.raises(ValueError, match="query must"):
        model(torch.randn(N, L, E + 1))
    assert torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # a user's choice is kept too
    try:
        with torch.no_grad(), f8.autocast(recipe=FP8):
            model(torch.randn(N, L, E))
        assert not torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_first": "False"}, TypeError, r"^batch_first must be a bool, got 'False'"),
        ({"bias": "no"}, TypeError, r"^bias must be a bool"),
        ({"add_bias_kv": 1}, TypeError, r"^add_bias_kv must be a bool"),
        ({"add_zero_attn": None}, TypeError, r"^add_zero_attn must be a bool"),
        ({"dropout": 10}, ValueError, r"^dropout must be a float in \[0, 1\], got 10"),
        ({"dropout": -0.1}, ValueError, r"^dropout must be a float in \[0, 1\]"),
        ({"dropout": "0.1"}, TypeError, r"^dropout must be a float in \[0, 1\]"),
        ({"kdim": 0}, ValueError, r"^kdim must be a positive int, got 0"),
        ({"vdim": 8.0}, TypeError, r"^vdim must be a positive int"),
        ({"num_heads": 0}, ValueError, r"^num_heads must be a positive int"),
        ({"embed_dim": True}, TypeError, r"^embed_dim must be a positive int"),
    ],
)
def test_constructor_refuses_bad_arguments_naming_them(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """What torch.nn.MultiheadAttention would read by truthiness ("False" is true) or accept
    until a forward pass fails is refused where it enters, naming the argument."""
    args = {"embed_dim": E, "num_heads": H, **kwargs}
    with pytest.raises(error, match=message):
        f8.MultiheadAttention(args.pop("embed_dim"), args.pop("num_heads"), **args)


@pytest.mark.parametrize("flag", ["need_weights", "average_attn_weights", "is_causal"])
def test_forward_refuses_non_bool_flags(flag: str) -> None:
    mha = f8.MultiheadAttention(E, H)
    q = torch.randn(L, N, E)
    for fp8 in (False, True):
        with f8.autocast(enabled=fp8), pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
            mha(q, q, q, **{flag: "no"})


def test_a_wrong_query_width_is_named_with_and_without_fp8() -> None:
    mha = f8.MultiheadAttention(E, H)
    q = torch.randn(L, N, E + 1)
    for fp8 in (False, True):
        with (
            f8.autocast(enabled=fp8),
            pytest.raises(ValueError, match=rf"^query must have .*embed_dim={E}"),
        ):
            mha(q, q, q)


class _Rewrap(torch.autograd.Function):
    """Returns its inputs as new objects with one autograd node, as FSDP2's pre-forward hook
    does to the inputs of a sharded module."""

    @staticmethod
    def forward(ctx, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return xs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return grads


def test_self_attention_rewrapped_by_a_wrapper_stays_one_packed_gemm() -> None:
    """``fully_shard(mha)`` then ``mha(x, x, x)``: query, key and value arrive as three objects
    of one tensor, which ran three q/k/v GEMMs with their own scales (outputs 0.018 off the
    unwrapped module after two steps). They are one input: one packed GEMM, the same numbers."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=4)
    direct, wrapped = f8.MultiheadAttention(16, 2), f8.MultiheadAttention(16, 2)
    wrapped.load_state_dict(direct.state_dict())
    for step in range(3):
        x = torch.randn(6, 2, 16) * (step + 1)
        outs = []
        for mha, rewrap in ((direct, False), (wrapped, True)):
            xi = x.clone().requires_grad_()
            q, k, v = _Rewrap.apply(xi, xi, xi) if rewrap else (xi, xi, xi)
            with f8.autocast(recipe=recipe):
                out, _ = mha(q, k, v, need_weights=False)
            out.square().sum().backward()
            outs.append((out.detach(), xi.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for (name, a), b in zip(
        direct.state_dict().items(), wrapped.state_dict().values(), strict=True
    ):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    assert direct.fp8_meta.forward.update_count.tolist()[3:9] == [0] * 6  # k and v never ran


def test_an_alias_with_its_own_autograd_history_is_another_input() -> None:
    """``x.detach().requires_grad_()`` shares x's memory but is its own leaf: it keeps its own
    projection and gets its own gradient, also when a wrapper re-wraps the three inputs (they
    then share one autograd node, but come from two upstream tensors)."""
    grads = []
    for rewrap in (False, True):
        torch.manual_seed(0)
        mha = f8.MultiheadAttention(16, 2)
        x = torch.randn(6, 2, 16, requires_grad=True)
        k = x.detach().requires_grad_()
        q, kk, vv = _Rewrap.apply(x, k, k) if rewrap else (x, k, k)
        with f8.autocast():
            out, _ = mha(q, kk, vv, need_weights=False)
        out.sum().backward()
        assert mha.fp8_meta.forward.update_count.tolist()[3:5] == [1, 1]  # the k GEMM ran
        grads.append((x.grad, k.grad))
    (x0, k0), (x1, k1) = grads
    assert k0.abs().sum() > 0 and torch.equal(k0, k1) and torch.equal(x0, x1)
