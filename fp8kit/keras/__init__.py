"""fp8kit for Keras 3: ``import fp8kit.keras as f8``.

FP8 training with delayed scaling on Keras's TensorFlow backend (and its torch backend; the JAX
backend runs FP8 GEMMs with frozen scales), with the recipes, numerics and state layout of
``fp8kit.torch`` and ``fp8kit.jax``:

* :class:`Dense`, :class:`EinsumDense`: drop-in for ``keras.layers.Dense`` / ``EinsumDense``;
* :func:`autocast`: construction-time recipe defaults;
* :func:`convert_model`: swap the Dense / EinsumDense layers of a Functional or Sequential model.

FP8 state is non-trainable variables that the optimizer never sees; a training step updates it
at the same events as ``fp8kit.torch`` (see docs/keras.md).
"""

from fp8kit.keras.autocast import autocast
from fp8kit.keras.convert import convert_model
from fp8kit.keras.layers import Dense, EinsumDense
from fp8kit.keras.state import STATE_VARIABLES, Fp8State
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Format
from fp8kit.slots import BwdSlot, FwdSlot
from fp8kit.unset import UNSET

__all__ = [
    "STATE_VARIABLES",
    "UNSET",
    "BwdSlot",
    "DelayedScaling",
    "Dense",
    "EinsumDense",
    "Float8CurrentScaling",
    "Format",
    "Fp8State",
    "FwdSlot",
    "autocast",
    "convert_model",
]
