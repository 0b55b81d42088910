"""``f8.MultiheadAttention``: ``torch.nn.MultiheadAttention`` with FP8 projections.

Inside an enabled :class:`fp8kit.torch.autocast` the input projection (one packed q/k/v GEMM for
self-attention, three GEMMs otherwise) and the output projection are FP8 GEMMs on the module's
own parameters; the attention core (``scaled_dot_product_attention``, or the explicit softmax when
``need_weights=True``) runs in high precision. Outside it the module *is*
``torch.nn.MultiheadAttention``. Masks, ``batch_first``, ``add_bias_kv``, ``add_zero_attn``,
dropout and the returned weights follow PyTorch's definitions (docs/te_modules.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.torch.autocast import current_settings
from fp8kit.torch.linear import (
    FP8StateOwner,
    check_bool,
    check_features,
    check_probability,
    fp8_linear,
    fp8_run_for,
    resolve_params_dtype,
    torch_autocast_dtype,
)
from fp8kit.torch.quantization import check_high_precision
from fp8kit.torch.quantizer import FP8Run
from fp8kit.torch.state import FP8Meta

__all__ = ["MultiheadAttention", "to_fp8_attention"]

# GEMM indices of the FP8 state (forward slots 3g.., backward 2g..): q (or packed q/k/v), k, v,
# out. Self-attention with a packed weight uses GEMM 0 only for its input projection.
_Q, _K, _V, _OUT = 0, 1, 2, 3


def _one_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one input: the same object, or (eager) two objects that a
    wrapper passed on from one tensor. FSDP2's pre-forward hook passes every input through one
    autograd Function that returns its inputs, so ``mha(x, x, x)`` of a sharded module arrives
    as three objects (docs/te_modules.md). Both must hold the same values (memory, shape,
    strides, dtype, no negative or conjugate view bit) and, with autograd, come out of one node
    from one upstream edge: the inputs of their positions are one tensor. An alias with its
    own autograd history (``x.detach().requires_grad_()``, a gradient-reversal view) stays
    apart, re-wrapped or not."""
    if a is b:
        return True
    if torch.compiler.is_compiling() or a.device.type == "meta":
        return False
    same_values = (  # the data pointer first: it tells cross-attention's inputs apart at once
        a.data_ptr() == b.data_ptr()
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.is_neg() == b.is_neg()
        and a.is_conj() == b.is_conj()
        and a.requires_grad == b.requires_grad
    )
    if not same_values or not a.requires_grad:
        return same_values
    node = a.grad_fn
    if node is None or node is not b.grad_fn:
        return False
    edges = node.next_functions  # one per tensor input of the node
    if max(a.output_nr, b.output_nr) >= len(edges):
        return False  # outputs that are not its inputs passed on (a split, an unbind)
    (node_a, nr_a), (node_b, nr_b) = edges[a.output_nr], edges[b.output_nr]
    return node_a is not None and node_a is node_b and nr_a == nr_b


class MultiheadAttention(FP8StateOwner, nn.MultiheadAttention):
    """Drop-in ``torch.nn.MultiheadAttention`` whose four projections run in FP8 in autocast.

    Args: those of ``torch.nn.MultiheadAttention`` (``embed_dim, num_heads, dropout, bias,
    add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype``) plus ``params_dtype``
    (Transformer Engine's name for ``dtype``). Same parameters and ``state_dict`` keys (plus
    ``fp8_meta.*``), same ``forward`` signature and return value.

    State: ``fp8_meta`` with four GEMMs (q or packed q/k/v, k, v, out): forward ``(L, 12)``,
    backward ``(L, 8)``.
    """

    fp8_gemm_names = ("q", "k", "v", "out")  # the inspector's names; "q" also holds packed q/k/v

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        dtype = resolve_params_dtype(dtype, params_dtype)
        check_features("embed_dim", embed_dim)
        check_features("num_heads", num_heads)
        for name, value in (("kdim", kdim), ("vdim", vdim)):
            if value is not None:
                check_features(name, value)
        check_probability("dropout", dropout, one_allowed=True)  # as torch's dropout
        flags = {"bias": bias, "add_bias_kv": add_bias_kv, "add_zero_attn": add_zero_attn,
                 "batch_first": batch_first}  # fmt: skip
        for name, flag in flags.items():
            check_bool(name, flag)
        super().__init__(
            embed_dim,
            num_heads,
            dropout=dropout,
            bias=bias,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            kdim=kdim,
            vdim=vdim,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
        )
        self.fp8_meta = FP8Meta(
            num_gemms=4, device=device, label=f"MultiheadAttention({embed_dim}, {num_heads})"
        )
        self._init_fp8_owner()

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``torch.nn.MultiheadAttention.forward``; FP8 projections inside ``f8.autocast``."""
        for name, flag in (("need_weights", need_weights), ("is_causal", is_causal),
                           ("average_attn_weights", average_attn_weights)):  # fmt: skip
            check_bool(name, flag)
        weight = self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight
        if current_settings() is not None:
            self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        run = fp8_run_for(self, query, self.embed_dim, weight, "query", "embed_dim")
        if run is None:
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        if _one_tensor(query, key) and _one_tensor(key, value):
            key = value = query  # self-attention: one packed q/k/v GEMM (_project_inputs)
        if query.dim() == 2:  # unbatched: a batch of one, then drop that dimension again
            dim = 0 if self.batch_first else 1
            q = query.unsqueeze(dim)
            k = q if key is query else key.unsqueeze(dim)
            v = k if value is key else value.unsqueeze(dim)
            kpm = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
            out, weights = self._fp8_forward(
                run, q, k, v, kpm, need_weights, attn_mask, average_attn_weights, is_causal
            )
            return out.squeeze(dim), None if weights is None else weights.squeeze(0)
        return self._fp8_forward(
            run, query, key, value, key_padding_mask, need_weights, attn_mask,
            average_attn_weights, is_causal,
        )  # fmt: skip

    def _check_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> None:
        """Shapes and dtypes of an FP8 call, checked before any GEMM (ValueError / TypeError).

        As in PyTorch: under ``torch.autocast`` query, key and value may differ in dtype (each
        projection runs in the autocast dtype); a float mask may be float32 or the dtype the
        attention runs in (the autocast dtype, else the query's); :func:`_mask_in` adds it.
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            check_high_precision(t, name)
        autocast_dtype = torch_autocast_dtype(query)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if autocast_dtype is None and t.dtype != query.dtype:
                raise TypeError(
                    f"{name} must have query's dtype {query.dtype}, got {t.dtype}: cast the "
                    "inputs to one dtype (or run under torch.autocast)"
                )
        dtype = autocast_dtype or query.dtype
        allowed = sorted({str(d) for d in (torch.bool, torch.float32, dtype)})
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if mask is not None and mask.dtype not in (torch.bool, torch.float32, dtype):
                raise TypeError(
                    f"{name} must be a bool mask or a float mask of dtype torch.float32 or the "
                    f"attention's dtype {dtype} (one of {allowed}), got {mask.dtype}"
                )
        if query.dim() not in (2, 3):
            raise ValueError(
                "query must be 2-D (L, E) unbatched or 3-D batched "
                f"({'(N, L, E)' if self.batch_first else '(L, N, E)'}), got shape "
                f"{tuple(query.shape)}"
            )
        if query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query must have embed_dim={self.embed_dim} features in its last dimension, got "
                f"shape {tuple(query.shape)}"
            )
        for name, t, dim in (("key", key, self.kdim), ("value", value, self.vdim)):
            if t.dim() != query.dim():
                raise ValueError(
                    f"{name} must have as many dimensions as query ({query.dim()}), got shape "
                    f"{tuple(t.shape)}"
                )
            if t.shape[-1] != dim:
                raise ValueError(
                    f"{name} must have {dim} features in its last dimension "
                    f"({'kdim' if name == 'key' else 'vdim'}={dim}), got shape {tuple(t.shape)}"
                )
        seq, batch = (1, 0) if self.batch_first else (0, 1)
        if query.dim() == 2:
            seq, batch = 0, None
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key and value must agree in all but the last dimension, got shapes "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        n = 1 if batch is None else query.shape[batch]
        if batch is not None and key.shape[batch] != n:
            raise ValueError(
                f"query and key must have the same batch size, got shapes {tuple(query.shape)} "
                f"and {tuple(key.shape)} (batch_first={self.batch_first})"
            )
        tgt, src = query.shape[seq], key.shape[seq]
        if key_padding_mask is not None:
            want = (src,) if batch is None else (n, src)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(
                    f"key_padding_mask must have shape {want} (batch, source length), got "
                    f"{tuple(key_padding_mask.shape)}"
                )
        if attn_mask is not None:
            wants = ((tgt, src), (n * self.num_heads, tgt, src))
            if tuple(attn_mask.shape) not in wants:
                raise ValueError(
                    f"attn_mask must have shape {wants[0]} or {wants[1]} (batch * num_heads, "
                    f"target length, source length), got {tuple(attn_mask.shape)}"
                )

    def _project_inputs(
        self, run: FP8Run, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``(L|S, N, E)`` from the FP8 input projections (sequence-first inputs)."""
        if self._qkv_same_embed_dim:
            if query is key and key is value:  # self-attention: one packed GEMM
                qkv = fp8_linear(query, self.in_proj_weight, self.in_proj_bias, run, gemm=_Q)
                q, k, v = qkv.chunk(3, dim=-1)
                return q, k, v
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        return (
            fp8_linear(query, weights[0], biases[0], run, gemm=_Q),
            fp8_linear(key, weights[1], biases[1], run, gemm=_K),
            fp8_linear(value, weights[2], biases[2], run, gemm=_V),
        )

    def _fp8_forward(
        self,
        run: FP8Run,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        attn_mask: torch.Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The projections take the inputs in their own layout ((L, N, E), or (N, L, E) with
        # batch_first); the attention core works on (N, heads, length, head_dim) views of them,
        # so no activation is copied to change layout (docs/performance.md).
        bsz, embed_dim = query.shape[0 if self.batch_first else 1], query.shape[2]
        heads, head_dim = self.num_heads, self.head_dim
        to_core = (0, 2, 1, 3) if self.batch_first else (1, 2, 0, 3)
        from_core = (0, 2, 1, 3) if self.batch_first else (2, 0, 1, 3)
        autocast_dtype = torch_autocast_dtype(query)
        dtype = autocast_dtype or query.dtype  # what the projections write, the core runs in
        key_padding_mask = _mask_in(
            autocast_dtype,
            F._canonical_mask(
                mask=key_padding_mask,
                mask_name="key_padding_mask",
                other_type=F._none_or_dtype(attn_mask),
                other_name="attn_mask",
                target_type=dtype,
            ),
        )
        attn_mask = _mask_in(
            autocast_dtype,
            F._canonical_mask(
                mask=attn_mask,
                mask_name="attn_mask",
                other_type=None,
                other_name="",
                target_type=dtype,
                check_other=False,
            ),
        )
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint (as torch.nn.MultiheadAttention)"
            )
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # scaled_dot_product_attention applies the causal mask itself
        else:
            is_causal = False
        if attn_mask is not None:  # (L, S) -> (1, 1, L, S); (N * heads, L, S) -> (N, heads, L, S)
            per_head = heads if attn_mask.dim() == 3 else 1
            attn_mask = attn_mask.view(-1, per_head, *attn_mask.shape[-2:])
        if key_padding_mask is not None:  # (N, S) -> (N, 1, 1, S)
            key_padding_mask = key_padding_mask.view(bsz, 1, 1, -1)

        q, k, v = (
            t.view(*t.shape[:2], heads, head_dim).permute(to_core)
            for t in self._project_inputs(run, query, key, value)
        )  # (N, heads, L | S, head_dim)
        if self.bias_k is not None and self.bias_v is not None:
            k, v = (
                torch.cat([t, b.view(1, heads, 1, head_dim).expand(bsz, -1, -1, -1)], dim=2)
                for t, b in ((k, self.bias_k), (v, self.bias_v))
            )
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        if self.add_zero_attn:
            zeros = q.new_zeros((bsz, heads, 1, head_dim))
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        if key_padding_mask is not None:
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0

        weights = None
        if need_weights:
            scores = (q * math.sqrt(1.0 / head_dim)) @ k.transpose(-2, -1)  # (N, heads, L, S)
            if attn_mask is not None:
                scores = scores + attn_mask  # float32 for a float32 mask outside torch.autocast
            weights = torch.softmax(scores, dim=-1).to(q.dtype)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = weights @ v
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = out.permute(from_core).reshape(*query.shape[:2], embed_dim)
        out = fp8_linear(out, self.out_proj.weight, self.out_proj.bias, run, gemm=_OUT)
        return out, weights


def _mask_in(autocast_dtype: torch.dtype | None, mask: torch.Tensor | None) -> torch.Tensor | None:
    """A canonical (float) mask as PyTorch's attention adds it: under ``torch.autocast`` cast to
    ``autocast_dtype`` (autocast casts ``baddbmm``'s and ``scaled_dot_product_attention``'s
    float inputs so); outside it (None) as it is, so a float32 mask of a half-precision model is
    added in float32, unrounded (and the weights are the float32 softmax, rounded once)."""
    return mask if mask is None or autocast_dtype is None else mask.to(autocast_dtype)


def to_fp8_attention(old: nn.MultiheadAttention) -> MultiheadAttention:
    """An :class:`MultiheadAttention` holding ``old``'s very Parameter objects (and out_proj).
    Its FP8 state is labelled by ``convert_model`` (:func:`~fp8kit.torch.label_fp8_modules`)."""
    new = MultiheadAttention(
        old.embed_dim,
        old.num_heads,
        dropout=old.dropout,
        bias=old.in_proj_bias is not None,
        add_bias_kv=old.bias_k is not None,
        add_zero_attn=old.add_zero_attn,
        kdim=old.kdim,
        vdim=old.vdim,
        batch_first=old.batch_first,
        device="meta",
        dtype=old.out_proj.weight.dtype,
    )
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
        setattr(new, name, getattr(old, name))
    for name in ("in_proj_bias", "bias_k", "bias_v"):
        setattr(new, name, getattr(old, name))
    new.out_proj = old.out_proj
    device = old.out_proj.weight.device
    new.fp8_meta = FP8Meta(num_gemms=4, device=device)
    new.train(old.training)
    return new
