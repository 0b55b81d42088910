"""One small FP8 module of each kind that owns FP8 state (16 input features), by name: what the
copy and pickle tests build in one process and in the two-rank scenarios."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

import fp8kit.torch as f8

FP8_MODULE_KINDS: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: f8.Linear(16, 16),
    "LayerNormMLP": lambda: f8.LayerNormMLP(16, 32),
    "MultiheadAttention": lambda: f8.MultiheadAttention(16, 2),
}
