"""Keras FP8 layers: drop-in :class:`Dense` and :class:`EinsumDense`.

Subclasses of ``keras.layers.Dense`` / ``keras.layers.EinsumDense`` with the same constructor
arguments, variables, initialisation, regularizers, constraints, activation and dtype policies
(``"mixed_bfloat16"`` included), plus:

* ``recipe``: an ``fp8kit.recipe`` object, None for high precision, or left unset to take the
  :func:`fp8kit.keras.autocast` active at construction (``DelayedScaling()`` outside one);
* ``gradient_accumulation_steps``: backward passes per update event (left unset: the active
  autocast's value, else 1).

The GEMM ``x @ kernel`` runs in FP8 (:mod:`fp8kit.keras.gemm`); the bias and activation are
added as Keras does. The FP8 state is seven non-trainable float32 variables per layer
(:mod:`fp8kit.keras.state`), updated by training calls only (see docs/keras.md).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import keras
import numpy as np

from fp8kit.keras.autocast import resolve
from fp8kit.keras.backends import fp8_einsum_for_backend, gradients_recorded
from fp8kit.keras.gemm import GemmPlan, plan_einsum
from fp8kit.keras.state import STATE_VARIABLES, Fp8State
from fp8kit.recipe import Recipe, check_rebuildable, recipe_from_dict
from fp8kit.unset import UNSET

try:  # Keras's symbolic (build-time) call scope; no public name, so guarded
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
except ImportError:  # pragma: no cover - a Keras that moved it: warn in symbolic calls too

    def in_symbolic_scope() -> bool:
        return False


logger = logging.getLogger("fp8kit")

__all__ = ["INPUT_DTYPES", "Dense", "EinsumDense"]

INPUT_DTYPES = ("float16", "bfloat16", "float32", "float64")  # what the FP8 GEMM casts from


def _recipe_arg(recipe: Any) -> Any:
    """A recipe given as its ``to_dict()`` (a saved config) becomes the recipe object."""
    return recipe_from_dict(recipe) if isinstance(recipe, dict) else recipe


def _is_training_flag(training: Any) -> bool:
    """What Keras layers take as ``training``: None, a bool or a 0-d boolean tensor (a string
    such as "False" would be truthy)."""
    if training is None or isinstance(training, (bool, np.bool_)):
        return True
    return (
        keras.ops.is_tensor(training)
        and keras.backend.standardize_dtype(training.dtype) == "bool"
        and len(training.shape) == 0
    )


def _unwatched_if_frozen(variable: Any) -> Any:
    """A weight as the call uses it; a frozen one (``trainable`` False) behind a stop-gradient.

    A GradientTape watches every TensorFlow variable created trainable, a frozen layer's too,
    so without it the output of a frozen FP8 layer would count as differentiated downstream
    and the next FP8 layer would cast dY for a dgrad whose dX nobody needs (docs/semantics.md
    section 4). Autograd (torch) and Keras's JAX trainer leave frozen weights undifferentiated
    already; there it changes nothing."""
    return variable if variable.trainable else keras.ops.stop_gradient(variable)


class _Fp8LayerMixin:
    """What Dense and EinsumDense share: recipe resolution, FP8 state, the FP8 GEMM."""

    recipe: Recipe | None
    gradient_accumulation_steps: int
    fp8_state: Fp8State | None
    _fp8_plan: GemmPlan | None

    def _init_fp8(self, recipe: Any, gradient_accumulation_steps: Any) -> None:
        recipe, steps = resolve(_recipe_arg(recipe), gradient_accumulation_steps)
        self.recipe = recipe
        self.gradient_accumulation_steps = steps
        self.fp8_state = None
        self._fp8_plan = None
        self._warned_training_unset = False
        lora_rank = getattr(self, "lora_rank", None)
        if lora_rank:
            self._refuse_lora(f"lora_rank={lora_rank}")

    def add_weight(self, *args: Any, **kwargs: Any) -> Any:
        """Keras's ``add_weight``; an FP8 layer's kernel is created with ``autocast=False``:
        its FP8 cast reads the float32 master copy, as fp8kit.torch's does under
        ``torch.autocast``. Under ``mixed_bfloat16`` Keras would otherwise hand the GEMM a
        bfloat16 copy (a second rounding before the FP8 one, and a bfloat16 weight amax), and
        the kernel gradient would come back rounded to bfloat16."""
        if kwargs.get("name") == "kernel" and getattr(self, "recipe", None) is not None:
            kwargs["autocast"] = False
        return super().add_weight(*args, **kwargs)  # type: ignore[misc]

    def _build_fp8(self, equation: str) -> None:
        if self.recipe is None:  # Keras's layer, Keras's quantization modes included
            return
        mode = self.quantization_mode  # type: ignore[attr-defined]
        if mode is not None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: dtype policy "  # type: ignore[attr-defined]
                f"{self.dtype_policy.name!r} (Keras quantization mode {mode!r}) cannot be "  # type: ignore[attr-defined]
                "combined with fp8kit's FP8 GEMM; use a float policy such as 'float32' or "
                "'mixed_bfloat16' and choose FP8 with recipe=, or recipe=None for Keras's "
                "quantization"
            )
        self._fp8_plan = plan_einsum(equation, self.recipe)
        self.fp8_state = Fp8State(self, self.recipe, 1, self.gradient_accumulation_steps)

    def _refuse_lora(self, given: str) -> None:
        """LoRA and an FP8 recipe do not combine (docs/decisions/0600): a ValueError where LoRA
        enters, the constructor's ``lora_rank`` or ``enable_lora`` (not NotImplementedError,
        which ``keras.Sequential`` swallows while it builds: the layer would train in high
        precision)."""
        if self.recipe is not None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: {given} (LoRA) cannot be combined with "  # type: ignore[attr-defined]
                "an FP8 recipe; construct the layer with recipe=None to use LoRA"
            )

    def enable_lora(self, rank: int, *args: Any, **kwargs: Any) -> None:
        """Keras's ``enable_lora``, refused for a layer with an FP8 recipe."""
        self._refuse_lora(f"enable_lora(rank={rank})")
        super().enable_lora(rank, *args, **kwargs)  # type: ignore[misc]

    def quantize(self, mode: Any = None, type_check: bool = True, **kwargs: Any) -> None:
        """Keras's own quantization (``layer.quantize`` / ``Model.quantize``: int8, float8, ...)
        is refused for a layer with an FP8 recipe: it would stack Keras's quantized kernel and
        its float8 scales on fp8kit's GEMM and state (``type_check=False`` got past Keras's
        subclass check). ``Model.quantize`` turns this error into its usual warning and leaves
        the layer as it is. With ``recipe=None`` the layer is Keras's and quantizes as Keras's
        (Keras's own check refuses every subclass, so it is not asked)."""
        if getattr(self, "recipe", None) is not None:
            raise NotImplementedError(
                f"{type(self).__name__} {self.name!r} computes in FP8 with fp8kit's recipe; "  # type: ignore[attr-defined]
                f"Keras quantization mode {mode!r} cannot be added to it (construct the layer "
                "with recipe=None to quantize it with Keras)"
            )
        super().quantize(mode=mode, type_check=False, **kwargs)  # type: ignore[misc]

    def _fp8_gemm(self, inputs: Any, kernel: Any, training: Any) -> Any:
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        if dtype not in INPUT_DTYPES:
            raise TypeError(
                f"{type(self).__name__} {self.name!r}: inputs must have a high-precision float "  # type: ignore[attr-defined]
                f"dtype ({', '.join(INPUT_DTYPES)}), got {dtype}"
            )
        if not _is_training_flag(training):
            raise TypeError(
                f"{type(self).__name__} {self.name!r}: training must be None, a bool or a 0-d "  # type: ignore[attr-defined]
                f"boolean tensor, got {training!r}"
            )
        try:
            is_training = bool(training)
        except TypeError:  # a symbolic tensor (tf.function argument, JAX tracer)
            raise TypeError(
                f"{type(self).__name__} {self.name!r}: training must be a Python bool or a "  # type: ignore[attr-defined]
                "concrete tensor when an FP8 layer is traced: whether this call observes "
                "amaxes for the next update is decided when the step is traced (pass the flag "
                "as a Python value, as Model.fit does)"
            ) from None
        if (
            training is None
            and self.trainable  # type: ignore[attr-defined]  # frozen: inference anyway
            and not self._warned_training_unset
            and not in_symbolic_scope()
            and gradients_recorded()
        ):
            # Not in a symbolic call (Keras building a model through compute_output_spec, also
            # inside fit's tape): no user code left training out there, and the real call follows.
            self._warned_training_unset = True
            warnings.warn(
                f"fp8kit.keras: {type(self).__name__} {self.name!r} was called with training "  # type: ignore[attr-defined]
                "unset while a GradientTape records it. Keras then runs it as inference "
                "(training=False), so its FP8 state never updates; pass training=True in a "
                "training step (docs/keras.md)",
                UserWarning,
                stacklevel=3,
            )
        # A layer with trainable=False runs as inference, as Keras's BatchNormalization does
        # (``training and self.trainable``): its FP8 state never changes, while its FP8 GEMMs
        # still pass gradients through with the current scales. Keras replaces a nested
        # model's ``training=False`` by the outer ``training=True`` in a Functional graph, so
        # the flag is all that says "frozen" there (docs/keras.md, "A frozen layer").
        is_training = is_training and bool(self.trainable)  # type: ignore[attr-defined]
        assert self._fp8_plan is not None and self.fp8_state is not None
        fp8_einsum = fp8_einsum_for_backend()
        return fp8_einsum(
            self._fp8_plan,
            self.fp8_state,
            inputs,
            kernel,
            is_training,
            self.compute_dtype,  # type: ignore[attr-defined]
            self.kernel.trainable,  # type: ignore[attr-defined]
        )

    def _fp8_config(self) -> dict[str, Any]:
        return {
            "recipe": None if self.recipe is None else self._recipe_config(),
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

    def _recipe_config(self) -> dict[str, Any]:
        """The recipe's ``to_dict()``, refused when loading could not rebuild it (a lambda
        saved fine and could never be loaded)."""
        assert self.recipe is not None
        check_rebuildable(self.recipe, f"{type(self).__name__} {self.name!r} config")  # type: ignore[attr-defined]
        return self.recipe.to_dict()

    def _save_fp8(self, store: Any) -> None:
        if self.fp8_state is None:
            return
        start = len(store.keys())
        for k, var in enumerate(self.fp8_state.variables):
            store[str(start + k)] = var

    def _load_fp8(self, store: Any) -> None:
        if self.fp8_state is None:
            return
        n = len(STATE_VARIABLES)
        start = len(store.keys()) - n
        values = [np.asarray(store[str(start + k)]) for k in range(n)]
        self.fp8_state.load(values, f"layer {self.name!r}")  # type: ignore[attr-defined]

    # The Keras layer methods both layers share (the mixin comes first in their bases, so
    # ``super()`` is the Keras layer).
    def call(self, inputs: Any, training: Any = None) -> Any:
        """The Keras layer's call; inside it, the GEMM runs in FP8 when a recipe is set."""
        if self.fp8_state is None:
            if self.recipe is not None:  # its build failed and a caller swallowed the error
                raise RuntimeError(
                    f"{type(self).__name__} {self.name!r} has an FP8 recipe but no FP8 state: "  # type: ignore[attr-defined]
                    "its build() did not complete; build it (layer.build(input_shape)) to see why"
                )
            return super().call(inputs, training=training)  # type: ignore[misc]
        kernel = keras.ops.convert_to_tensor(_unwatched_if_frozen(self.kernel))  # type: ignore[attr-defined]
        x = self._fp8_gemm(inputs, kernel, training)
        if self.bias is not None:  # type: ignore[attr-defined]
            x = keras.ops.add(x, _unwatched_if_frozen(self.bias))  # type: ignore[attr-defined]
        if self.activation is not None:  # type: ignore[attr-defined]
            x = self.activation(x)  # type: ignore[attr-defined]
        return x

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **self._fp8_config()}  # type: ignore[misc]

    def save_own_variables(self, store: Any) -> None:
        super().save_own_variables(store)  # type: ignore[misc]
        self._save_fp8(store)

    def load_own_variables(self, store: Any) -> None:
        plain = [v for v in (self.kernel, self.bias) if v is not None]  # type: ignore[attr-defined]
        if self.fp8_state is not None and len(store.keys()) == len(plain):
            # Weights saved from the plain Keras layer (the drop-in swap): kernel and bias, and
            # the FP8 state starts fresh, as for a never-converted checkpoint in fp8kit.torch.
            for k, var in enumerate(plain):
                var.assign(store[str(k)])
            self.fp8_state.reset()  # scales measured on other weights would be wrong for these
            logger.info(
                "fp8kit: layer %r loaded weights without FP8 state; its FP8 state starts fresh",
                self.name,  # type: ignore[attr-defined]
            )
            return
        super().load_own_variables(store)  # type: ignore[misc]
        self._load_fp8(store)


@keras.saving.register_keras_serializable(package="fp8kit")
class Dense(_Fp8LayerMixin, keras.layers.Dense):
    """FP8 drop-in for ``keras.layers.Dense``: ``activation(inputs @ kernel + bias)``.

    Args:
        units, activation, use_bias, kernel_initializer, bias_initializer, kernel_regularizer,
            bias_regularizer, activity_regularizer, kernel_constraint, bias_constraint,
            **kwargs (name, dtype, ...): as ``keras.layers.Dense``.
        recipe: DelayedScaling / Float8CurrentScaling, None for high precision, or unset (the
            autocast active at construction, else ``DelayedScaling()``).
        gradient_accumulation_steps: backward passes per FP8 update event (int >= 1).

    Shapes: ``inputs`` ``(..., in_features)`` -> ``(..., units)``.
    """

    def __init__(
        self,
        units: int,
        *args: Any,
        recipe: Any = UNSET,
        gradient_accumulation_steps: Any = UNSET,
        **kwargs: Any,
    ):
        if isinstance(units, bool):  # Keras would read True as 1 unit
            raise TypeError(f"units must be an int >= 1, got {units!r}")
        super().__init__(units, *args, **kwargs)
        self._init_fp8(recipe, gradient_accumulation_steps)

    def build(self, input_shape: Any) -> None:
        super().build(input_shape)
        self._build_fp8("...i,ij->...j")


@keras.saving.register_keras_serializable(package="fp8kit")
class EinsumDense(_Fp8LayerMixin, keras.layers.EinsumDense):
    """FP8 drop-in for ``keras.layers.EinsumDense``: ``einsum(equation, inputs, kernel)``.

    Args:
        equation, output_shape, activation, bias_axes, kernel_initializer, ...: as
            ``keras.layers.EinsumDense``. The equation's gradients must be einsums of the other
            operand and the output gradient (every input axis meets the kernel or the output).
        recipe, gradient_accumulation_steps: as :class:`Dense`.
    """

    def __init__(
        self,
        equation: str,
        output_shape: Any,
        *args: Any,
        recipe: Any = UNSET,
        gradient_accumulation_steps: Any = UNSET,
        **kwargs: Any,
    ):
        super().__init__(equation, output_shape, *args, **kwargs)
        self._init_fp8(recipe, gradient_accumulation_steps)

    def build(self, input_shape: Any) -> None:
        super().build(input_shape)
        self._build_fp8(self.equation)
