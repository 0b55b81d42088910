"""fp8kit for JAX and Flax: ``import fp8kit.jax as f8``.

FP8 training with delayed scaling where FP8 state is never a parameter:

* functional core: :func:`quantize` / :func:`dequantize`, the observing FP8 :func:`dot_general`,
  a pure :func:`update` (docs/semantics.md section 3) on :class:`Fp8Meta` pytrees;
* :func:`value_and_grad`: loss, parameter gradients (no FP8 leaves) and observations;
* Flax Linen :class:`Dense` / :class:`DenseGeneral` (collection ``"fp8_meta"``), Flax NNX
  :class:`fp8kit.jax.nnx.Linear` (variable type ``Fp8MetaVariable``);
* :func:`autocast`: construction-time defaults (the recipe is static, see docs/jax.md).

``import fp8kit.jax`` imports jax and, when it is installed, flax (whose serialization registry
the FP8 meta joins, for checkpoints), never torch.
"""

from typing import Any

from fp8kit.jax.autocast import autocast, current_defaults
from fp8kit.jax.dot import dot_general, dot_general_chained
from fp8kit.jax.gemm import fp8_matmul
from fp8kit.jax.grad import split_grads, tie_to_loss, value_and_grad
from fp8kit.jax.meta import (
    BwdSlot,
    Fp8Meta,
    FwdSlot,
    Observations,
    ScalingState,
    init_meta,
    observations_of,
    with_recipe,
    zero_observations,
)
from fp8kit.jax.quantization import (
    Float8Array,
    dequantize,
    quantize,
    quantize_current,
)
from fp8kit.jax.updates import (
    SummedObservationsError,
    check_step,
    combine_observations,
    stage,
    update,
)
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format
from fp8kit.unset import UNSET

__all__ = [
    "UNSET",
    "BwdSlot",
    "DelayedScaling",
    "Dense",
    "DenseGeneral",
    "Float8Array",
    "Float8CurrentScaling",
    "Format",
    "Fp8Meta",
    "FwdSlot",
    "Observations",
    "ScalingState",
    "SummedObservationsError",
    "autocast",
    "check_step",
    "combine_observations",
    "current_defaults",
    "dequantize",
    "dot_general",
    "dot_general_chained",
    "fp8_matmul",
    "init_meta",
    "observations_of",
    "quantize",
    "quantize_current",
    "split_grads",
    "stage",
    "tie_to_loss",
    "update",
    "value_and_grad",
    "with_recipe",
    "zero_observations",
]


def __getattr__(name: str) -> Any:
    # The Linen layers' module loads on first use (flax, when installed, is imported by
    # fp8kit.jax.meta).
    if name in ("Dense", "DenseGeneral"):
        from fp8kit.jax import linen

        return getattr(linen, name)
    raise AttributeError(f"module 'fp8kit.jax' has no attribute {name!r}")
