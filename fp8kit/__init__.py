"""fp8kit: FP8 training with delayed scaling, one recipe for every framework.

``import fp8kit`` imports no framework. Frontends: ``fp8kit.torch`` (PyTorch), ``fp8kit.jax``
(JAX / Flax) and ``fp8kit.keras`` (Keras 3 on TensorFlow, JAX or torch).
"""

from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format

__version__ = "0.1.0"
__all__ = ["DelayedScaling", "Float8CurrentScaling", "Format", "__version__"]
