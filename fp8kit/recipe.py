"""FP8 recipes: what to quantize into which format and how to pick scales.

Pure Python (no framework import): one recipe object drives the PyTorch, JAX and Keras frontends.
The fields, defaults and rules are those of ``docs/semantics.md`` section 1.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from fp8kit.formats import E4M3, E5M2, FP8Format

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "CALLABLE_SHAPE_HINT",
    "FIRST_STEP_SCALINGS",
    "TRAINING_FORMATS",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "Recipe",
    "check_rebuildable",
    "recipe_from_dict",
    "require_int",
]

_FLOAT_MAX = sys.float_info.max  # the largest Python float

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
FIRST_STEP_SCALINGS = ("unity", "current")

# What a recipe callable must return, for the frontends' error messages: fp8kit.torch and
# fp8kit.jax call it on the (L, N) history of every module of a (recipe, group) and direction
# that ran since the last event (docs/te_modules.md, "Recipe callables"), so a 0-d result is
# refused rather than broadcast over the modules.
CALLABLE_SHAPE_HINT = (
    "one value per column: reduce over dim 0 of the (L, N) history, whose columns are the slots "
    "of every module that ran, so that each module keeps its own amax and scale"
)


class Format(enum.Enum):
    """Which FP8 encoding the forward (activations, weights) and backward (gradients) use."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def forward(self) -> FP8Format:
        """Encoding of activations and weights."""
        return E5M2 if self is Format.E5M2 else E4M3

    @property
    def backward(self) -> FP8Format:
        """Encoding of gradients."""
        return E4M3 if self is Format.E4M3 else E5M2

    @classmethod
    def coerce(cls, value: Format | str, allowed: tuple[Format, ...] | None = None) -> Format:
        """Accept a member or its name in any case (``"hybrid"``).

        ``allowed`` (default: every member) only sets the names the error messages list.
        """
        names = [m.name for m in (cls if allowed is None else allowed)]
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
            raise ValueError(
                f"fp8_format must be one of {names} (a Format member or its name, any case), "
                f"got {value!r}"
            )
        raise TypeError(
            f"fp8_format must be a Format member or one of the strings {names}, "
            f"got {type(value).__name__}"
        )


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def require_int(name: str, value: Any, minimum: int) -> None:
    """A TypeError / ValueError naming ``name`` unless ``value`` is an int (not a bool) >=
    ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")


def _coerce_gemm_flags(name: str, value: Any) -> tuple[bool, bool, bool]:
    """``value`` as a tuple of 3 bools (fprop, dgrad, wgrad), else a TypeError naming ``name``."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"{name} must be a tuple of 3 bools (fprop, dgrad, wgrad), got {value!r}")
    for part, flag in zip(("fprop", "dgrad", "wgrad"), value, strict=True):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}[{part}] must be a bool, got {flag!r}")
    return (value[0], value[1], value[2])


TRAINING_FORMATS = (Format.HYBRID, Format.E4M3)
"""Formats a recipe accepts: its forward GEMM multiplies two ``fp8_format.forward`` operands."""


def _training_format(value: Format | str) -> Format:
    """Coerce ``fp8_format`` and refuse E5M2, whose forward GEMM would be E5M2 x E5M2.

    cuBLASLt's FP8 GEMM (``torch._scaled_mm``) takes E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3
    but not two E5M2 operands, so such a recipe could only fail later, at the first forward.
    """
    fmt = Format.coerce(value, TRAINING_FORMATS)
    if fmt not in TRAINING_FORMATS:
        raise ValueError(
            f"fp8_format must be one of {[f.name for f in TRAINING_FORMATS]}, got {fmt.name}: "
            "with E5M2 the forward GEMM would multiply two E5M2 operands, which the FP8 GEMM "
            "(cuBLASLt, torch._scaled_mm) does not support; use HYBRID for E4M3 activations "
            "and weights with E5M2 gradients"
        )
    return fmt


class _RecipeBase:
    """Validation and serialisation shared by the recipe dataclasses."""

    fp8_format: Format
    override_linear_precision: tuple[bool, bool, bool]
    fast_accumulation: tuple[bool, bool, bool]
    power_2_scale: bool

    def _validate_common(self) -> None:
        object.__setattr__(self, "fp8_format", _training_format(self.fp8_format))
        for name in ("override_linear_precision", "fast_accumulation"):
            object.__setattr__(self, name, _coerce_gemm_flags(name, getattr(self, name)))
        _require_bool("power_2_scale", self.power_2_scale)

    def _cached_hash(self) -> int:
        """The dataclass hash (type and fields), computed once: recipes key several lookups per
        module call (plans, update events, registries). Not pickled: hashes differ between
        processes."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((type(self), *(getattr(self, f.name) for f in fields(self))))  # type: ignore[arg-type]
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible description of the recipe (callables become ``{"callable": name}``)."""
        out: dict[str, Any] = {"type": type(self).__name__}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Format):
                value = value.name
            elif isinstance(value, tuple):
                value = list(value)
            elif callable(value):
                value = {"callable": callable_name(value)}
            out[f.name] = value
        return out


@dataclass(frozen=True)
class DelayedScaling(_RecipeBase):
    """FP8 delayed scaling: each tensor is quantized with a scale derived from its amax history.

    Fields (see ``docs/semantics.md`` sections 1 and 3 for the exact update rule):
        margin: the scale is divided by ``2**margin`` (int or finite float, may be negative).
        interval: recompute the scale at update events 1, 1+interval, ... (int >= 1).
        fp8_format: ``Format.HYBRID`` (E4M3 forward, E5M2 backward) or ``Format.E4M3``, or
            their names; ``Format.E5M2`` is refused (its forward GEMM would be E5M2 x E5M2).
        amax_history_len: history length ``L`` (int >= 1); row 0 is the staging slot.
        amax_compute_algo: ``"max"``, ``"most_recent"`` or ``callable(history[L, n]) -> amax[n]``.
        scaling_factor_compute_algo: None or ``callable(amax, old_scale, fp8_max, recipe)``.
        override_linear_precision: (fprop, dgrad, wgrad); True runs that GEMM in high precision.
        fast_accumulation: (fprop, dgrad, wgrad); True lets cuBLASLt accumulate that FP8 GEMM in
            its fast mode (Hopper's reduced-precision accumulator), False keeps full float32
            (split) accumulation. Default as Transformer Engine: fast fprop, exact dgrad/wgrad.
            Performance only: no delayed-scaling number depends on it. CPU GEMMs (exact) and the
            JAX frontend (full accumulation, XLA decides) ignore it.
        reduce_amax: all-reduce (MAX) the amaxes over the autocast's group before every update.
        power_2_scale: round every new scale down to a power of two.
        first_step_scaling: ``"unity"`` (scale 1 until a slot has history) or ``"current"``
            (quantize with ``fmax / amax`` of the tensor itself until then).
    """

    margin: int | float = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable[..., Any] = "max"
    scaling_factor_compute_algo: Callable[..., Any] | None = None
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    fast_accumulation: tuple[bool, bool, bool] = (True, False, False)
    reduce_amax: bool = True
    power_2_scale: bool = False
    first_step_scaling: str = "unity"

    __hash__ = _RecipeBase._cached_hash  # explicit, so the dataclass keeps it

    def __post_init__(self) -> None:
        self._validate_common()
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise TypeError(f"margin must be an int or a finite float, got {margin!r}")
        if abs(margin) > _FLOAT_MAX or not math.isfinite(margin):  # an int past float range too
            raise ValueError(f"margin must be finite (within the float range), got {margin!r}")
        require_int("interval", self.interval, 1)
        require_int("amax_history_len", self.amax_history_len, 1)
        algo = self.amax_compute_algo
        if isinstance(algo, str):
            if algo not in AMAX_COMPUTE_ALGOS:
                raise ValueError(
                    f"amax_compute_algo must be one of {list(AMAX_COMPUTE_ALGOS)} or a callable "
                    f"(history[L, n]) -> amax[n], got {algo!r}"
                )
        elif not callable(algo):
            raise TypeError(
                f"amax_compute_algo must be one of {list(AMAX_COMPUTE_ALGOS)} or a callable, "
                f"got {type(algo).__name__}"
            )
        sf = self.scaling_factor_compute_algo
        if sf is not None and not callable(sf):
            raise TypeError(
                "scaling_factor_compute_algo must be None or a callable "
                f"(amax, old_scale, fp8_max, recipe) -> new_scale, got {type(sf).__name__}"
            )
        if self.power_2_scale and margin != int(margin):
            raise ValueError(
                f"power_2_scale=True needs an integer margin (the scale must stay a power of "
                f"two), got margin={margin!r}"
            )
        if sf is not None and self.power_2_scale:
            raise ValueError(
                "power_2_scale=True has no effect when scaling_factor_compute_algo is given: "
                "set one of them, not both"
            )
        _require_bool("reduce_amax", self.reduce_amax)
        if not isinstance(self.first_step_scaling, str):
            raise TypeError(
                f"first_step_scaling must be a str, one of {list(FIRST_STEP_SCALINGS)}, "
                f"got {self.first_step_scaling!r}"
            )
        if self.first_step_scaling not in FIRST_STEP_SCALINGS:
            raise ValueError(
                f"first_step_scaling must be one of {list(FIRST_STEP_SCALINGS)}, "
                f"got {self.first_step_scaling!r}"
            )

    @property
    def margin_factor(self) -> float:
        """``2**-margin`` as a Python float (exact for integer margins from -1023 to 1074);
        ``inf`` for a margin <= -1024, whose factor overflows a float (the scale is then capped
        at FLT_MAX, SPEC section 3), and 0.0 for a margin above 1074, where it underflows."""
        try:
            return 2.0 ** (-self.margin)
        except OverflowError:
            return math.inf


@dataclass(frozen=True)
class Float8CurrentScaling(_RecipeBase):
    """FP8 current scaling: every tensor is quantized with ``fmax / max|x|`` of itself.

    No history, no state updates; each cast reads the tensor twice (amax, then cast).
    ``fp8_format`` is HYBRID or E4M3 and ``fast_accumulation`` as for :class:`DelayedScaling`.
    """

    fp8_format: Format = Format.HYBRID
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    fast_accumulation: tuple[bool, bool, bool] = (True, False, False)
    power_2_scale: bool = False

    __hash__ = _RecipeBase._cached_hash  # explicit, so the dataclass keeps it

    def __post_init__(self) -> None:
        self._validate_common()


Recipe = DelayedScaling | Float8CurrentScaling

_RECIPE_TYPES: dict[str, type] = {
    "DelayedScaling": DelayedScaling,
    "Float8CurrentScaling": Float8CurrentScaling,
}


def _resolve_callable(field_name: str, spec: Any) -> Callable[..., Any]:
    """Find a callable recorded as ``{"callable": "module:qualname"}`` among loaded modules.

    Nothing is imported: a checkpoint must not be able to run code. The module must already be
    loaded by the program that reads the checkpoint.
    """
    name = spec.get("callable") if isinstance(spec, dict) else None
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"{field_name}: expected {{'callable': 'module:qualname'}}, got {spec!r}")
    module_name, qualname = name.split(":", 1)
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if obj is None or not callable(obj):
        raise ValueError(
            f"{field_name}: callable {name!r} is not reachable; import its module before "
            f"rebuilding the recipe (fp8kit never imports code named in a checkpoint)"
        )
    if isinstance(obj, type):  # the type of an object without a name of its own
        raise ValueError(
            f"{field_name}: {name!r} names a class, the type of the recipe's callable (a "
            "functools.partial or an instance with __call__ has no module-level name), so the "
            "callable cannot be rebuilt; use a function defined at module level"
        )
    return obj


def check_rebuildable(recipe: Recipe, where: str) -> None:
    """Raise a ValueError unless :func:`recipe_from_dict` can rebuild ``recipe`` from its
    ``to_dict()`` in this process: every callable field must be reachable by its module and
    qualified name (a lambda or a function defined inside another is not). ``where`` names what
    is being saved, for the message."""
    for f in fields(recipe):  # type: ignore[arg-type]
        value = getattr(recipe, f.name)
        if not callable(value) or isinstance(value, Format):
            continue
        spec = {"callable": callable_name(value)}
        try:
            found = _resolve_callable(f.name, spec)
        except ValueError:
            found = None
        if found is not value:
            raise ValueError(
                f"{where}: recipe.{f.name} is {spec['callable']!r}, which a saved config cannot "
                "name (a lambda or a nested function); use a function defined at module level"
            )


def callable_name(value: Callable[..., Any]) -> str:
    """``"module:qualname"`` of a recipe callable; an object without those names (a
    ``functools.partial``, an instance with ``__call__``) is named by its type, which
    :func:`recipe_from_dict` cannot rebuild it from (:func:`check_rebuildable` says so)."""
    module = getattr(value, "__module__", None) or type(value).__module__
    qualname = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{module}:{qualname}"


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Rebuild a recipe from the ``to_dict()`` of a DelayedScaling or Float8CurrentScaling."""
    if not isinstance(data, dict) or data.get("type") not in _RECIPE_TYPES:
        raise ValueError(
            f"recipe data must be a dict with 'type' in {sorted(_RECIPE_TYPES)}, got {data!r}"
        )
    kwargs = {k: v for k, v in data.items() if k != "type"}
    for key in ("amax_compute_algo", "scaling_factor_compute_algo"):
        if isinstance(kwargs.get(key), dict):
            kwargs[key] = _resolve_callable(key, kwargs[key])
    for key in ("override_linear_precision", "fast_accumulation"):
        if isinstance(kwargs.get(key), list):
            kwargs[key] = tuple(kwargs[key])
    return _RECIPE_TYPES[data["type"]](**kwargs)
