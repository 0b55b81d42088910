"""Backend plumbing for the FP8 GEMM's custom gradient: one small module per Keras backend.

Each module exposes ``fp8_einsum(plan, state, x, w, training, out_dtype, kernel_trainable) -> y``:
the forward and backward math of :mod:`fp8kit.keras.gemm`, wired into that framework's
custom-gradient mechanism, delivering the amaxes of a training call to
:meth:`fp8kit.keras.state.Fp8State.observe` at the end of its backward pass (see
``docs/decisions/0601-keras-update-events.md``). ``kernel_trainable`` is the Keras flag: a frozen
kernel gets no gradient, so an FP8 wgrad does not run for it (:data:`fp8kit.keras.gemm.Needs`).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

import keras

__all__ = ["fp8_einsum_for_backend", "gradients_recorded"]

_MODULES = {
    "tensorflow": "fp8kit.keras.backends.tf_grad",
    "jax": "fp8kit.keras.backends.jax_grad",
    "torch": "fp8kit.keras.backends.torch_grad",
}


def fp8_einsum_for_backend() -> Callable[..., Any]:
    """The ``fp8_einsum`` of the active Keras backend (imported on first use: each module
    imports its framework, and a process only ever has one Keras backend)."""
    name = keras.backend.backend()
    if name not in _MODULES:
        raise NotImplementedError(
            f"fp8kit.keras supports the Keras backends {sorted(_MODULES)}, not {name!r}"
        )
    return import_module(_MODULES[name]).fp8_einsum


def gradients_recorded() -> bool:
    """Whether the active backend records this call for a gradient where that is known without
    guessing: a TensorFlow ``GradientTape`` that could record it. False on the other backends
    (torch records by default, inference included; JAX has no tape)."""
    if keras.backend.backend() != "tensorflow":
        return False
    return bool(import_module(_MODULES["tensorflow"]).tape_recording())
