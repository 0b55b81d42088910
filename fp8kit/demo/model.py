"""A small decoder-only GPT built from fp8kit blocks (byte-level, vocabulary 256).

Each block is pre-norm: ``x + proj(attention(LayerNormLinear_qkv(x)))`` then
``x + LayerNormMLP(x)``. The qkv, attention-projection, fc1 and fc2 GEMMs run in FP8 inside
``f8.autocast``; attention itself (``scaled_dot_product_attention``), the embeddings, the final
norm and the LM head (tied to the token embedding) stay in high precision: the LM head's
logits feed the loss directly, and keeping it out of FP8 is the usual Transformer Engine
practice.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.torch.layers import LayerNormLinear, LayerNormMLP
from fp8kit.torch.linear import Linear

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Model size. ``n_embd`` must be a multiple of ``n_head``."""

    vocab_size: int = 256
    block_size: int = 128  # context length in tokens (bytes)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    ffn_mult: int = 4

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention and an MLP, both residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.qkv = LayerNormLinear(d, 3 * d)
        self.proj = Linear(d, d)
        self.mlp = LayerNormMLP(d, cfg.ffn_mult * d, activation="gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        heads = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(x)


class GPT(nn.Module):
    """Byte-level GPT: token and position embeddings, ``n_layer`` blocks, norm, tied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be a multiple of n_head={cfg.n_head}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02) weights, zero biases, residual outputs scaled by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc2_weight")):
                nn.init.normal_(p, std=residual_std)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith(("layer_norm_weight", "norm.weight")):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for byte ids ``idx`` ``(B, T)``, or the mean cross-entropy
        (nats per byte, 0-d) when ``targets`` ``(B, T)`` is given."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm(x), self.tok_emb.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
