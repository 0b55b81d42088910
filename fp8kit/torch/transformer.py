"""``f8.TransformerLayer``: Transformer Engine's pre-LN transformer layer from fp8kit's blocks.

``y = x + dropout(proj(attention(LayerNormLinear_qkv(x))))``, then
``out = y + dropout(LayerNormMLP(y))``: four FP8 GEMMs per layer inside ``f8.autocast`` (QKV,
projection, fc1, fc2); the attention core (``scaled_dot_product_attention``) in high precision.
Arguments use Transformer Engine's names; see docs/te_modules.md for what differs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.torch.autocast import current_settings
from fp8kit.torch.checkpoint import summarize_fresh_fp8_state
from fp8kit.torch.layers import (
    ACTIVATIONS,
    NORMALIZATIONS,
    LayerNormLinear,
    LayerNormMLP,
    check_choice,
    check_eps,
)
from fp8kit.torch.linear import (
    InitMethod,
    Linear,
    check_bool,
    check_features,
    check_init_method,
    check_is_first_microbatch,
    check_probability,
    resolve_params_dtype,
    torch_autocast_dtype,
)
from fp8kit.torch.quantization import check_high_precision

__all__ = ["ATTN_INPUT_FORMATS", "SELF_ATTN_MASK_TYPES", "TransformerLayer"]

SELF_ATTN_MASK_TYPES = ("causal", "padding", "no_mask")
ATTN_INPUT_FORMATS = ("sbhd", "bshd")  # [seq, batch, hidden] (TE's default) or batch first


class TransformerLayer(nn.Module):
    """Pre-LN self-attention + MLP layer whose four GEMMs run in FP8 inside ``f8.autocast``.

    Args (Transformer Engine's names):
        hidden_size: model width ``h``; num_attention_heads must divide it.
        ffn_hidden_size: MLP width.
        num_attention_heads: attention heads.
        layernorm_epsilon: epsilon of both norms.
        hidden_dropout: dropout after the projection and after the MLP (training only).
        attention_dropout: dropout on the attention probabilities (training only).
        self_attn_mask_type: ``"causal"`` (default, as TE), ``"padding"`` (``attention_mask``
            in forward) or ``"no_mask"``.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``; activation: ``"gelu"``, ``"relu"`` or
            ``"swiglu"``; bias: learn the GEMM biases.
        fuse_qkv_params: accepted for TE compatibility; fp8kit always keeps Q, K and V in one
            parameter (``layernorm_qkv.weight`` ``(3h, h)``, rows q | k | v, one FP8 GEMM), so
            the flag changes no number. TE's own checkpoints use other keys and, fused, another
            row order: they do not load (docs/te_modules.md).
        init_method / output_layer_init_method: fill the QKV and fc1 weights / the projection
            and fc2 weights in place, with zero biases (TE's); None: ``torch.nn.Linear``'s
            initialisation (TE's default differs: docs/te_modules.md).
        attn_input_format: ``"sbhd"`` (``[seq, batch, hidden]``, TE's default) or ``"bshd"``.
        params_dtype (TE) / dtype (PyTorch's name for it; give one) / device: of the
            parameters.

    Submodules: ``layernorm_qkv`` (:class:`LayerNormLinear`), ``proj`` (:class:`Linear`),
    ``layernorm_mlp`` (:class:`LayerNormMLP`), each with its own FP8 state.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        *,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        self_attn_mask_type: str = "causal",
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        bias: bool = True,
        fuse_qkv_params: bool = False,
        attn_input_format: str = "sbhd",
        init_method: InitMethod | None = None,
        output_layer_init_method: InitMethod | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = check_features("hidden_size", hidden_size)
        heads = check_features("num_attention_heads", num_attention_heads)
        if hidden_size % heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must divide hidden_size ({hidden_size})"
            )
        self.num_attention_heads = heads
        self.hidden_dropout = check_probability("hidden_dropout", hidden_dropout)
        self.attention_dropout = check_probability("attention_dropout", attention_dropout)
        self.self_attn_mask_type = check_choice(
            "self_attn_mask_type", self_attn_mask_type, SELF_ATTN_MASK_TYPES
        )
        self.attn_input_format = check_choice(
            "attn_input_format", attn_input_format, ATTN_INPUT_FORMATS
        )
        self.fuse_qkv_params = check_bool("fuse_qkv_params", fuse_qkv_params)
        normalization = check_choice("normalization", normalization, NORMALIZATIONS)
        activation = check_choice("activation", activation, ACTIVATIONS)
        eps = check_eps(layernorm_epsilon, "layernorm_epsilon")
        kw: dict[str, Any] = {"device": device, "dtype": resolve_params_dtype(dtype, params_dtype)}
        init_method = check_init_method("init_method", init_method)
        output_init = check_init_method("output_layer_init_method", output_layer_init_method)
        self.layernorm_qkv = LayerNormLinear(
            hidden_size,
            3 * hidden_size,
            eps,
            bias=bias,
            normalization=normalization,
            init_method=init_method,
            **kw,
        )
        self.proj = Linear(hidden_size, hidden_size, bias=bias, init_method=output_init, **kw)
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            check_features("ffn_hidden_size", ffn_hidden_size),
            eps,
            bias=bias,
            activation=activation,
            normalization=normalization,
            init_method=init_method,
            output_layer_init_method=output_init,
            **kw,
        )
        summarize_fresh_fp8_state(self)  # one log line for a checkpoint without FP8 state

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        """``[s, b, h]`` (or ``[b, s, h]`` with ``attn_input_format="bshd"``) -> same shape.

        ``attention_mask`` (``self_attn_mask_type="padding"`` only): bool, 4-D, broadcastable to
        ``[b, heads, s, s]`` (TE uses ``[b, 1, 1, s]``; another shape raises ValueError); True
        marks a position that is masked out.
        ``is_first_microbatch``: passed to the four GEMM modules (FP8 weight caching across
        microbatches, docs/semantics.md section 4). Under ``torch.autocast`` the input is cast
        to its dtype first, as TE does, so the residual stream and the output have that dtype.
        """
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(
                f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}"
            )
        if current_settings() is not None:  # FP8 GEMMs take 16- and 32-bit floats only
            check_high_precision(hidden_states, "hidden_states")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            layout = "s, b" if self.attn_input_format == "sbhd" else "b, s"
            raise ValueError(
                f"hidden_states must have shape [{layout}, {self.hidden_size}] "
                f"(attn_input_format={self.attn_input_format!r}), got {tuple(hidden_states.shape)}"
            )
        check_is_first_microbatch(is_first_microbatch)
        x = hidden_states
        dtype = torch_autocast_dtype(x)
        if dtype is not None:
            x = x.to(dtype)
        bshd = x if self.attn_input_format == "bshd" else x.transpose(0, 1)
        b, s, h = bshd.shape
        mask = self._sdpa_mask(attention_mask, b, s)
        heads, head_dim = self.num_attention_heads, h // self.num_attention_heads
        qkv = self.layernorm_qkv(bshd, is_first_microbatch=is_first_microbatch)  # [b, s, 3h]
        q, k, v = (t.view(b, s, heads, head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        attn = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=self.self_attn_mask_type == "causal",
            scale=1.0 / math.sqrt(head_dim),
        )
        attn = attn.transpose(1, 2).reshape(b, s, h)
        attn = self.proj(attn, is_first_microbatch=is_first_microbatch)
        y = bshd + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.layernorm_mlp(y, is_first_microbatch=is_first_microbatch)
        out = y + F.dropout(mlp, self.hidden_dropout, self.training)
        return out if self.attn_input_format == "bshd" else out.transpose(0, 1)

    def _sdpa_mask(
        self, attention_mask: torch.Tensor | None, b: int, s: int
    ) -> torch.Tensor | None:
        """TE's mask (True = masked out) as ``scaled_dot_product_attention``'s (True = attend)."""
        if self.self_attn_mask_type != "padding":
            if attention_mask is not None:
                raise ValueError(
                    f"attention_mask is only used with self_attn_mask_type='padding', this layer "
                    f"has {self.self_attn_mask_type!r}"
                )
            return None
        if attention_mask is None:
            raise ValueError("self_attn_mask_type='padding' needs an attention_mask")
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            got = (
                attention_mask.dtype
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise TypeError(f"attention_mask must be a bool tensor (True = masked out), got {got}")
        full = (b, self.num_attention_heads, s, s)
        try:
            fits = torch.broadcast_shapes(attention_mask.shape, full) == full
        except RuntimeError:
            fits = False
        if attention_mask.dim() != 4 or not fits:
            raise ValueError(
                f"attention_mask must have shape [b, 1, 1, s] = [{b}, 1, 1, {s}] or another shape "
                f"that broadcasts to [b, heads, s, s] = {list(full)}, got "
                f"{list(attention_mask.shape)}"
            )
        return ~attention_mask

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads}, "
            f"self_attn_mask_type={self.self_attn_mask_type}, "
            f"attn_input_format={self.attn_input_format}"
        )
