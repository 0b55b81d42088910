"""fp8kit.recipe: fields, defaults, validation and serialisation (docs/semantics.md section 1)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import pickle
import subprocess
import sys

import numpy as np
import pytest

from fp8kit.formats import E4M3, E5M2, scale_numerator
from fp8kit.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    check_rebuildable,
    recipe_from_dict,
)


def test_import_pulls_no_framework() -> None:
    code = (
        "import sys, fp8kit, fp8kit.recipe, fp8kit.formats;"
        "bad = [m for m in ('torch', 'jax', 'tensorflow', 'keras') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_format_members_map_to_forward_and_backward_encodings() -> None:
    assert (Format.E4M3.forward, Format.E4M3.backward) == (E4M3, E4M3)
    assert (Format.E5M2.forward, Format.E5M2.backward) == (E5M2, E5M2)
    assert (Format.HYBRID.forward, Format.HYBRID.backward) == (E4M3, E5M2)
    assert E4M3.max == 448.0 and E5M2.max == 57344.0
    assert E4M3.min_subnormal == 2.0**-9 and E5M2.min_subnormal == 2.0**-16


def test_format_fields_are_the_encodings_bit_layouts() -> None:
    # tests/reference.py rounds with these fields, so each is pinned here to the OCP FP8
    # encoding it names (E4M3 "fn": no infinities, S.1111.111 is NaN; E5M2: IEEE-like).
    layouts = {E4M3: (4, 3, 7, 448.0, 2.0**-6, 2.0**-9, False)}
    layouts[E5M2] = (5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, True)
    for fmt, want in layouts.items():
        got = (fmt.exponent_bits, fmt.mantissa_bits, fmt.bias, fmt.max)
        got += (fmt.min_normal, fmt.min_subnormal, fmt.has_inf)
        assert got == want, fmt.name


def test_delayed_scaling_defaults() -> None:
    r = DelayedScaling()
    assert r.margin == 0
    assert r.interval == 1
    assert r.fp8_format is Format.HYBRID
    assert r.amax_history_len == 1024
    assert r.amax_compute_algo == "max"
    assert r.scaling_factor_compute_algo is None
    assert r.override_linear_precision == (False, False, False)
    assert r.reduce_amax is True
    assert r.power_2_scale is False
    assert r.first_step_scaling == "unity"


def test_margin_factor_is_two_to_the_minus_margin_and_inf_past_float_range() -> None:
    """A margin <= -1024 is accepted (the scale is capped at FLT_MAX, SPEC section 3); its
    factor overflows a float: inf, not the OverflowError the property raised."""
    assert DelayedScaling(margin=3).margin_factor == 0.125
    assert DelayedScaling(margin=-1023).margin_factor == 2.0**1023
    assert DelayedScaling(margin=-2000).margin_factor == math.inf
    assert DelayedScaling(margin=2000).margin_factor == 0.0


def test_recipes_are_frozen_hashable_and_compare_by_value() -> None:
    a = DelayedScaling(margin=1, amax_history_len=16)
    b = DelayedScaling(margin=1, amax_history_len=16)
    assert a == b and hash(a) == hash(b)
    assert a != DelayedScaling(margin=2, amax_history_len=16)
    with pytest.raises(AttributeError):
        a.margin = 3  # type: ignore[misc]
    assert {a: 1}[b] == 1


@pytest.mark.parametrize("recipe", [DelayedScaling(margin=1), Float8CurrentScaling()])
def test_the_cached_hash_is_the_field_hash_and_is_not_pickled(recipe: object) -> None:
    """The hash is computed once per recipe; copies and unpickled recipes (another process has
    other hashes) compute their own, equal to that of an equal recipe."""
    fields = tuple(getattr(recipe, f.name) for f in dataclasses.fields(recipe))  # type: ignore[arg-type]
    assert hash(recipe) == hash((type(recipe), *fields))
    for copied in (pickle.loads(pickle.dumps(recipe)), copy.deepcopy(recipe)):
        assert "_hash" not in pickle.loads(pickle.dumps(recipe)).__dict__
        assert copied == recipe and hash(copied) == hash(recipe)
    changed = dataclasses.replace(recipe, power_2_scale=True)  # type: ignore[type-var]
    assert changed != recipe and hash(changed) != hash(recipe)


@pytest.mark.parametrize("name", ["hybrid", "HYBRID", "Hybrid", "e4m3", "E4M3"])
def test_format_accepts_names_in_any_case(name: str) -> None:
    assert DelayedScaling(fp8_format=name).fp8_format is Format[name.upper()]
    assert Float8CurrentScaling(fp8_format=name).fp8_format is Format[name.upper()]


E5M2_REFUSED = (
    "fp8_format must be one of ['HYBRID', 'E4M3'], got E5M2: with E5M2 the forward GEMM would "
    "multiply two E5M2 operands, which the FP8 GEMM (cuBLASLt, torch._scaled_mm) does not "
    "support; use HYBRID for E4M3 activations and weights with E5M2 gradients"
)


@pytest.mark.parametrize("recipe_type", [DelayedScaling, Float8CurrentScaling])
@pytest.mark.parametrize("value", [Format.E5M2, "E5M2", "e5m2"])
def test_e5m2_recipe_is_refused_at_construction(recipe_type: type, value: object) -> None:
    """An all-E5M2 recipe would need an E5M2 x E5M2 forward GEMM: refused before any forward."""
    with pytest.raises(ValueError) as info:
        recipe_type(fp8_format=value)
    assert str(info.value) == E5M2_REFUSED


def test_e5m2_recipe_is_refused_when_rebuilt_from_a_dict() -> None:
    data = DelayedScaling(amax_history_len=4).to_dict()
    data["fp8_format"] = "E5M2"
    with pytest.raises(ValueError) as info:
        recipe_from_dict(data)
    assert str(info.value) == E5M2_REFUSED


@pytest.mark.parametrize(
    ("value", "exc", "message"),
    [
        (
            "e3m4",
            ValueError,
            "fp8_format must be one of ['HYBRID', 'E4M3'] (a Format member or its name, any "
            "case), got 'e3m4'",
        ),
        (
            3,
            TypeError,
            "fp8_format must be a Format member or one of the strings ['HYBRID', 'E4M3'], got int",
        ),
    ],
)
def test_unknown_format_lists_the_formats_a_recipe_accepts(
    value: object, exc: type, message: str
) -> None:
    for recipe_type in (DelayedScaling, Float8CurrentScaling):
        with pytest.raises(exc) as info:
            recipe_type(fp8_format=value)
        assert str(info.value) == message


def test_override_list_becomes_tuple() -> None:
    r = DelayedScaling(override_linear_precision=[True, False, True])
    assert r.override_linear_precision == (True, False, True)
    hash(r)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"margin": float("nan")}, ValueError, "margin"),
        ({"margin": float("inf")}, ValueError, "margin"),
        ({"margin": 10**400}, ValueError, "margin must be finite"),  # was an OverflowError
        ({"margin": -(10**400)}, ValueError, "margin must be finite"),
        ({"margin": "1"}, TypeError, "margin"),
        ({"margin": True}, TypeError, "margin"),
        ({"interval": 0}, ValueError, "interval"),
        ({"interval": 1.5}, TypeError, "interval"),
        ({"amax_history_len": 0}, ValueError, "amax_history_len"),
        ({"amax_history_len": "16"}, TypeError, "amax_history_len"),
        ({"fp8_format": "e3m4"}, ValueError, "fp8_format"),
        ({"fp8_format": 3}, TypeError, "fp8_format"),
        ({"amax_compute_algo": "mean"}, ValueError, "'max', 'most_recent'"),
        ({"amax_compute_algo": 3}, TypeError, "amax_compute_algo"),
        ({"scaling_factor_compute_algo": "pow2"}, TypeError, "scaling_factor_compute_algo"),
        ({"override_linear_precision": (True, False)}, TypeError, "override_linear_precision"),
        ({"override_linear_precision": (1, 0, 0)}, TypeError, "fprop"),
        ({"reduce_amax": 1}, TypeError, "reduce_amax"),
        ({"power_2_scale": "yes"}, TypeError, "power_2_scale"),
        ({"power_2_scale": True, "margin": 0.5}, ValueError, "integer margin"),
        (
            {"power_2_scale": True, "scaling_factor_compute_algo": lambda a, s, m, r: s},
            ValueError,
            "not both",
        ),
        ({"first_step_scaling": "zero"}, ValueError, "'unity', 'current'"),
        ({"first_step_scaling": 1}, TypeError, "first_step_scaling must be a str"),
        ({"amax_history": 4}, TypeError, "amax_history"),
    ],
)
def test_bad_values_raise_naming_the_field(kwargs: dict, exc: type, words: str) -> None:
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
        DelayedScaling(**kwargs)


def test_current_scaling_fields_and_validation() -> None:
    r = Float8CurrentScaling()
    assert r.fp8_format is Format.HYBRID and r.power_2_scale is False
    assert Float8CurrentScaling(fp8_format="e4m3").fp8_format is Format.E4M3
    with pytest.raises(TypeError, match="amax_history_len"):
        Float8CurrentScaling(amax_history_len=4)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="override_linear_precision"):
        Float8CurrentScaling(override_linear_precision=None)  # type: ignore[arg-type]


def custom_amax(history):  # module-level so it can be found by name
    return history.max(0)


def test_to_dict_is_json_and_round_trips() -> None:
    r = DelayedScaling(margin=-1, interval=3, fp8_format="e4m3", amax_history_len=7)
    text = json.dumps(r.to_dict())
    assert recipe_from_dict(json.loads(text)) == r
    c = Float8CurrentScaling(power_2_scale=True)
    assert recipe_from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_callables_serialise_by_name_and_resolve_only_loaded_modules() -> None:
    r = DelayedScaling(amax_compute_algo=custom_amax)
    data = json.loads(json.dumps(r.to_dict()))
    assert data["amax_compute_algo"] == {"callable": f"{__name__}:custom_amax"}
    assert recipe_from_dict(data) == r
    data["amax_compute_algo"] = {"callable": "some_module_never_imported:fn"}
    with pytest.raises(ValueError, match="never imports"):
        recipe_from_dict(data)
    with pytest.raises(ValueError, match="type"):
        recipe_from_dict({"type": "Pickle"})


class _ColumnMax:
    """A callable object (no ``__qualname__`` of its own), as an amax algorithm."""

    def __call__(self, history: np.ndarray) -> np.ndarray:
        return history.max(0)


@pytest.mark.parametrize(
    "algo",
    [functools.partial(custom_amax), _ColumnMax()],
    ids=["functools.partial", "callable-object"],
)
def test_callables_without_a_qualname_serialise_by_their_type(algo: object) -> None:
    """A ``functools.partial`` or a callable object is a valid algorithm: the recipe describes
    it by its type (it raised AttributeError on ``__qualname__``), and a saved config refuses
    it as it refuses a lambda, since no name rebuilds it."""
    recipe = DelayedScaling(amax_compute_algo=algo)
    name = type(algo).__module__ + ":" + type(algo).__qualname__
    assert json.loads(json.dumps(recipe.to_dict()))["amax_compute_algo"] == {"callable": name}
    with pytest.raises(ValueError, match=r"layer x: recipe\.amax_compute_algo is"):
        check_rebuildable(recipe, "layer x")
    # rebuilding from that name refuses: the type found there is not the callable (it came
    # back as the class, and failed at the first update with an unrelated TypeError)
    with pytest.raises(ValueError, match=r"amax_compute_algo: .* names a class"):
        recipe_from_dict(json.loads(json.dumps(recipe.to_dict())))


def test_check_rebuildable_refuses_callables_a_config_cannot_name() -> None:
    """What a saved config (Keras get_config) may hold: module-level functions, not a lambda or
    a nested function, which saved fine and could never be loaded."""

    def nested(history: np.ndarray) -> np.ndarray:
        return history[0]

    check_rebuildable(DelayedScaling(amax_compute_algo=custom_amax), "test")
    check_rebuildable(DelayedScaling(), "test")
    for fn in (lambda history: history[0], nested):
        with pytest.raises(
            ValueError, match=r"layer x: recipe\.amax_compute_algo is .*(<lambda>|<locals>)"
        ):
            check_rebuildable(DelayedScaling(amax_compute_algo=fn), "layer x")


@pytest.mark.parametrize(
    ("fmax", "margin", "expected"),
    [
        (448.0, 0, 448.0),
        (448.0, -0.5, float(np.float32(448.0 * 2**0.5))),
        (57344.0, 3, 7168.0),
        (448.0, -119, float(np.float32(448.0 * 2.0**119))),  # still finite
        (448.0, -120, math.inf),  # 448 * 2**120 > FLT_MAX
        (448.0, -1100.5, math.inf),  # 2**1100.5 overflows float64 itself
        (448.0, 1100, 0.0),  # underflows
    ],
)
def test_scale_numerator_rounds_once_to_float32(
    fmax: float, margin: float, expected: float
) -> None:
    """SPEC section 3: ``float32(fmax * 2^-margin)``; the frontends all take it from here."""
    assert scale_numerator(fmax, margin) == expected
