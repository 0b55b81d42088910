"""fp8kit.jax refuses bad input where it enters, naming the parameter: what JAX or Flax would
otherwise accept silently (integer ids promoted to floats, a parameter gradient max-combined, a
string read as true) or reject deep inside, without the parameter's name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8kit.jax as f8
from fp8kit.jax import nnx as f8nnx

DIMS = (((1,), (0,)), ((), ()))
X = jnp.ones((4, 16))
W = jnp.ones((16, 8))


def test_fp8_layers_refuse_integer_inputs_that_promotion_would_turn_into_floats() -> None:
    ids = jnp.ones((4, 16), jnp.int32)
    dense = f8.Dense(8, recipe=f8.DelayedScaling())
    variables = dense.init(jax.random.key(0), X)
    with pytest.raises(TypeError, match=r"^inputs must have a high-precision float dtype"):
        dense.apply(variables, ids)
    linear = f8nnx.Linear(16, 8, recipe=f8.DelayedScaling(), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"^x must have a high-precision float dtype"):
        linear(ids)
    # high precision keeps Flax's behaviour (integer inputs promoted)
    plain = f8.Dense(8, recipe=None)
    assert plain.apply(plain.init(jax.random.key(0), ids), ids).dtype == jnp.float32


@pytest.mark.parametrize(
    ("rhs", "dims", "message"),
    [
        (W, (((5,), (0,)), ((), ())), r"lhs axes \(5,\): each must be in \[0, 2\)"),
        (W, (((1, 1), (0, 1)), ((), ())), r"lhs axes \(1, 1\): each must be in \[0, 2\) .*once"),
        (jnp.ones((12, 8)), DIMS, r"contracting axes of different sizes: lhs axes \(1,\) have"),
    ],
)
def test_dot_general_names_dimension_numbers_that_do_not_fit(rhs, dims, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^dimension_numbers .*{message}"):
        f8.dot_general(X, rhs, dims, f8.init_meta())


@pytest.mark.parametrize("shape", [(5,), (3, 4, 8), (2, 8)])
def test_dot_general_refuses_a_bias_that_would_change_the_result_shape(shape) -> None:
    with pytest.raises(ValueError, match=r"^bias must broadcast to the result's shape \(4, 8\)"):
        f8.dot_general(X, W, DIMS, f8.init_meta(), bias=jnp.ones(shape))


def test_dot_general_takes_a_bias_that_broadcasts_to_the_result() -> None:
    for shape in ((8,), (4, 1), (1, 8), (4, 8)):
        out, _ = f8.dot_general_chained(X, W, DIMS, f8.init_meta(), bias=jnp.ones(shape))
        assert out.shape == (4, 8)


def test_combine_observations_refuses_parameter_gradients() -> None:
    """A parameter gradient's microbatches add up; the max would silently corrupt it."""
    params = {"w": W, "meta": f8.init_meta()}

    def loss(p, x):
        return f8.dot_general(x, p["w"], DIMS, p["meta"]).sum()

    plain = [jax.grad(loss)(params, X), jax.grad(loss)(params, -X)]
    with pytest.raises(TypeError, match=r"^combine_observations takes observation trees .*\['w'\]"):
        f8.combine_observations(*plain)
    _, _, obs1 = f8.value_and_grad(loss)(params, X)
    _, _, obs2 = f8.value_and_grad(loss)(params, -X)
    assert f8.combine_observations(obs1, obs2)["meta"] is not None


def test_check_step_refuses_a_tree_without_fp8_state() -> None:
    """check_step exists to catch a lost update; on a tree without meta it would always pass."""
    with pytest.raises(ValueError, match=r"^check_step found no Fp8Meta in meta"):
        f8.check_step({"w": W}, 3)
    f8.check_step({"w": W, "meta": f8.init_meta()}, 0)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: f8.Dense(0), ValueError, r"^features must be an int >= 1 .*got 0"),
        (lambda: f8.Dense("8"), TypeError, r"^features must be an int >= 1 .*got '8'"),
        (lambda: f8.DenseGeneral((4, 0)), ValueError, r"^features must be .*got \(4, 0\)"),
        (lambda: f8.DenseGeneral(()), ValueError, r"^features must be .*got \(\)"),
        (lambda: f8.Dense(8, recipe=None, fp8_output="no"), TypeError, r"^fp8_output must be"),
        (lambda: f8.Dense(8, fp8_grad=3), TypeError, r"^fp8_grad must be a bool, got 3"),
        (lambda: f8.Dense(8, use_bias="False"), TypeError, r"^use_bias must be a bool"),
        (
            lambda: f8nnx.Linear(16, 8, fp8_output="no", rngs=nnx.Rngs(0)),
            TypeError,
            r"^fp8_output must be a bool",
        ),
        (lambda: f8nnx.Linear(16, 8, use_bias=1, rngs=nnx.Rngs(0)), TypeError, r"^use_bias must"),
        (lambda: f8nnx.Linear(4.0, 8, rngs=nnx.Rngs(0)), TypeError, r"^in_features must be an int"),
        (lambda: f8nnx.Linear(4, 0, rngs=nnx.Rngs(0)), ValueError, r"^out_features must be an int"),
        (lambda: f8.init_meta(1.0), TypeError, r"^num_gemms must be an int >= 1, got 1\.0"),
        (lambda: f8.init_meta(0), ValueError, r"^num_gemms must be an int >= 1, got 0"),
    ],
)
def test_layers_check_their_arguments_when_built(make, error, message: str) -> None:
    with pytest.raises(error, match=message):
        make()


def test_flags_and_argnums_are_not_read_by_truthiness() -> None:
    with pytest.raises(TypeError, match=r"^power_2_scale must be a bool, got 'no'"):
        f8.quantize_current(jnp.array([3.0]), jnp.float8_e4m3fn, power_2_scale="no")
    with pytest.raises(TypeError, match=r"^check_chains must be a bool, got 'no'"):
        f8.update(f8.init_meta(), None, check_chains="no")
    with pytest.raises(TypeError, match=r"^argnums must be an int or a non-empty sequence"):
        f8.value_and_grad(lambda w: (w * 2).sum(), argnums="0")
    with pytest.raises(TypeError, match=r"^has_aux must be a bool, got 'no'"):
        f8.value_and_grad(lambda w: (w * 2).sum(), has_aux="no")
    with pytest.raises(TypeError, match=r"^has_aux must be a bool, got 'False'"):
        f8nnx.value_and_grad(lambda m: m(X).sum(), has_aux="False")
    for value_and_grad in (f8.value_and_grad, f8nnx.value_and_grad):
        with pytest.raises(
            TypeError, match=r"^fun must be a callable \(the loss function\), got 3"
        ):
            value_and_grad(3)


@pytest.mark.parametrize("axis", [1.5, True, "1"])
def test_dot_general_refuses_axes_that_are_not_ints(axis) -> None:
    """jax.lax.dot_general refuses these too; int() would truncate 1.5 and read True as 1."""
    with pytest.raises(ValueError, match=r"^dimension_numbers must be .* of int axes"):
        f8.dot_general(X, W, (((axis,), (0,)), ((), ())), f8.init_meta())


def test_a_numpy_int_axis_is_an_axis() -> None:
    dims = (((np.int64(1),), (np.int32(0),)), ((), ()))
    assert f8.dot_general(X, W, dims, f8.init_meta()).shape == (4, 8)


def test_calls_that_would_do_nothing_on_a_tree_without_fp8_state_raise() -> None:
    """f8.update(variables["params"]) would leave every scale at 1 for good, without a word."""
    params = {"w": W}
    with pytest.raises(ValueError, match=r"^update found no Fp8Meta in its first argument"):
        f8.update(params)
    with pytest.raises(ValueError, match=r"^stage found no Fp8Meta in its first argument"):
        f8.stage(params, None)
    with pytest.raises(ValueError, match=r"^with_recipe found no Fp8Meta in meta_tree"):
        f8.with_recipe(params, f8.DelayedScaling())
    plain = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^update found no Fp8MetaVariable in model"):
        f8nnx.update(plain, None)
    # a model without FP8 layers in a generic loop: its (empty) observations pass
    _, _, obs = f8.value_and_grad(lambda p: (X @ p["w"]).sum())(params)
    assert f8.update(params, obs) == params
    _, _, nnx_obs = f8nnx.value_and_grad(lambda m: m(X).sum())(plain)
    f8nnx.update(plain, nnx_obs)


def test_update_names_a_recipe_that_is_not_one() -> None:
    with pytest.raises(TypeError, match=r"^recipe must be an fp8kit DelayedScaling or "):
        f8.update(f8.init_meta(), None, recipe="x")


def test_zero_observations_names_its_argument() -> None:
    with pytest.raises(TypeError, match=r"^meta must be an Fp8Meta, got ArrayImpl"):
        f8.zero_observations(jnp.ones(3))
