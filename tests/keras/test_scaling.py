"""fp8kit.keras's update rule at its guards and boundaries, against SPEC's numbers (section 3,
section 9): the paths fp8kit.torch and fp8kit.jax test too, which a mutation run of the Keras
code showed untested (docs/decisions/0267)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import fp8kit.keras as f8
from fp8kit.formats import E4M3
from fp8kit.keras.quantization import current_scale
from fp8kit.keras.scaling import count_wrap, update_scaling_state
from fp8kit.keras.state import resize_history


def _event(column: list[float], recipe: f8.DelayedScaling, scale: float = 1.0, count: float = 0.0):
    """One event of a one-slot state: ``(history column, scale, count)`` as Python lists."""
    hist = ops.convert_to_tensor(np.asarray(column, np.float32)[:, None])
    h, s, c = update_scaling_state(
        hist, ops.convert_to_tensor([scale]), ops.convert_to_tensor([count]), recipe, E4M3.max
    )
    return ops.convert_to_numpy(h)[:, 0].tolist(), float(s[0]), float(c[0])


@pytest.mark.parametrize("result", ["zero", "negative"])
def test_a_callable_scale_of_zero_or_below_keeps_the_old_scale(result: str) -> None:
    def bad(amax, old_scale, fp8_max, recipe):
        return ops.zeros_like(amax) if result == "zero" else ops.divide(-fp8_max, amax)

    recipe = f8.DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=bad)
    assert _event([4.0, 0.0], recipe, scale=3.0) == ([0.0, 4.0], 3.0, 1.0)


def test_a_zero_amax_keeps_the_old_scale() -> None:
    """``new_scale`` needs ``a > 0`` (a callable algorithm can give 0); current scaling of an
    all-zero tensor is 1."""
    recipe = f8.DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: ops.zeros_like(h[0]))
    assert _event([4.0, 0.0], recipe, scale=3.0) == ([0.0, 4.0], 3.0, 1.0)
    assert float(current_scale(ops.convert_to_tensor(0.0), E4M3)) == 1.0


@pytest.mark.parametrize(
    ("column", "scale", "rolled"),
    [([1.0, np.nan, 2.0], 224.0, [0.0, 2.0, 1.0]), ([1.0, np.nan, np.nan], 448.0, None)],
)
def test_max_window_ignores_nan_entries_of_a_loaded_history(column, scale, rolled) -> None:
    h, s, _ = _event(column, f8.DelayedScaling(amax_history_len=3))
    assert s == scale
    if rolled is not None:
        assert h == rolled


def test_power_of_two_scales_stop_at_two_to_the_127() -> None:
    """448 / 1e-37 is 2^131.4: the largest power of two not above FLT_MAX is 2^127."""
    recipe = f8.DelayedScaling(amax_history_len=1, power_2_scale=True)
    assert _event([1e-37], recipe)[1] == 2.0**127


@pytest.mark.parametrize("interval", [1, 3])
def test_a_count_reaching_the_wrap_value_stays_positive(interval: int) -> None:
    recipe = f8.DelayedScaling(amax_history_len=2, interval=interval)
    wrap = count_wrap(interval)
    assert _event([4.0, 0.0], recipe, count=wrap - 1.0)[2] == float(wrap)


def test_shrinking_a_history_keeps_the_staging_row_and_the_newest_entries() -> None:
    """docs/semantics.md section 6 (growing alone could not tell newest from oldest)."""
    history = np.asarray([[9.0], [1.0], [2.0], [3.0]], np.float32)
    assert resize_history(history, 2)[:, 0].tolist() == [9.0, 3.0]
    assert resize_history(history, 3)[:, 0].tolist() == [9.0, 2.0, 3.0]
    assert resize_history(history, 6)[:, 0].tolist() == [9.0, 0.0, 0.0, 1.0, 2.0, 3.0]


def test_a_nan_observation_counts_as_not_run() -> None:
    """``Fp8State.observe`` treats NaN as 0, as fp8kit.jax's update does: the slot is skipped
    and no NaN enters a history."""
    state = f8.Fp8State(keras.layers.Dense(4), f8.DelayedScaling(amax_history_len=2), 1, 1)
    state.observe(np.asarray([np.nan, 2.0, 0.0, 4.0, 0.0], np.float32))
    history = np.asarray(state.fwd_history)
    assert not np.isnan(history).any()
    assert history[:, 0].tolist() == [0.0, 0.0] and np.asarray(state.fwd_count)[:2].tolist() == [
        0,
        1,
    ]
    assert np.asarray(state.fwd_scale)[:2].tolist() == [1.0, 224.0]
