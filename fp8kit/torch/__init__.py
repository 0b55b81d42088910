"""fp8kit for PyTorch: ``import fp8kit.torch as f8``.

Delayed-scaling FP8 training: :class:`autocast`, the drop-in :class:`Linear`,
:func:`convert_model`, and the low-level :func:`quantize` / :func:`fp8_matmul`.
"""

from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format
from fp8kit.torch.attention import MultiheadAttention
from fp8kit.torch.autocast import autocast, current_recipe, fp8_autocast, is_fp8_enabled
from fp8kit.torch.checkpoint import (
    from_per_rank_fp8_state_dict,
    init_fp8_state,
    per_rank_fp8_state_dict,
    plain_state_dict,
)
from fp8kit.torch.convert import convert_model, label_fp8_modules
from fp8kit.torch.ddp import ddp_ignore_fp8_state
from fp8kit.torch.distributed import AmaxReductionError
from fp8kit.torch.gemm import Fp8GemmContractError, fp8_matmul, scaled_mm
from fp8kit.torch.graphs import make_graphed_callables
from fp8kit.torch.inspect import Inspector
from fp8kit.torch.layers import LayerNormLinear, LayerNormMLP
from fp8kit.torch.linear import Linear
from fp8kit.torch.quantization import Float8Tensor, dequantize, quantize, quantize_current
from fp8kit.torch.recompute import activation_checkpoint
from fp8kit.torch.state import BwdSlot, FP8Meta, FwdSlot, NonfiniteAmaxWarning, ScalingState
from fp8kit.torch.transformer import TransformerLayer

__all__ = [
    "AmaxReductionError",
    "BwdSlot",
    "DelayedScaling",
    "FP8Meta",
    "Float8CurrentScaling",
    "Float8Tensor",
    "Format",
    "Fp8GemmContractError",
    "FwdSlot",
    "Inspector",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "NonfiniteAmaxWarning",
    "ScalingState",
    "TransformerLayer",
    "activation_checkpoint",
    "autocast",
    "convert_model",
    "current_recipe",
    "ddp_ignore_fp8_state",
    "dequantize",
    "fp8_autocast",
    "fp8_matmul",
    "from_per_rank_fp8_state_dict",
    "init_fp8_state",
    "is_fp8_enabled",
    "label_fp8_modules",
    "make_graphed_callables",
    "per_rank_fp8_state_dict",
    "plain_state_dict",
    "quantize",
    "quantize_current",
    "scaled_mm",
]
