"""fp8kit: FP8 training with delayed scaling, one recipe for every framework.

``import fp8kit`` imports no framework. Frontends: ``fp8kit.torch`` (PyTorch), ``fp8kit.jax``
(JAX / Flax).
"""

from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

__version__ = "0.1.0"
__all__ = ["DelayedScaling", "Float8CurrentScaling", "Format", "__version__"]
