"""docs/semantics.md sections 3, 9 and 10: the delayed-scaling update, through the public PyTorch
API."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

import fp8kit.torch as f8
from fp8kit.formats import E4M3, E5M2, FLOAT32_MAX
from fp8kit.recipe import DelayedScaling
from fp8kit.torch.scaling import update_scaling_state
from tests.reference import scale_sequence, update_reference

INPUT = f8.FwdSlot.INPUT
GRAD_OUTPUT = f8.BwdSlot.GRAD_OUTPUT


def _x_with_amax(amax: float, features: int = 16) -> torch.Tensor:
    x = torch.linspace(-0.5, 0.5, 4 * features).reshape(4, features) * abs(amax)
    x[1, 3] = -amax if math.isfinite(amax) else amax
    return x


def forward_scales(amaxes: list[float | None], recipe: DelayedScaling) -> tuple[list[float], list]:
    """Input-slot scale after each autocast exit when the input's amax follows ``amaxes``.

    None means the module does not run in that step. Returns the scales and final history.
    """
    torch.manual_seed(0)
    layer = f8.Linear(16, 16)
    out = []
    for a in amaxes:
        with f8.autocast(recipe=recipe):
            if a is not None:
                layer(_x_with_amax(a))
        out.append(layer.fp8_meta.forward.scale[INPUT].item())
    return out, layer.fp8_meta.forward.amax_history[:, INPUT].tolist()


def backward_scales(amaxes: list[float], recipe: DelayedScaling) -> list[float]:
    """Grad-output-slot scale after each backward when dY's amax follows ``amaxes``."""
    torch.manual_seed(0)
    layer = f8.Linear(16, 16)
    out = []
    for a in amaxes:
        with f8.autocast(recipe=recipe):
            y = layer(torch.randn(4, 16))
        y.backward(_x_with_amax(a))
        out.append(layer.fp8_meta.backward.scale[GRAD_OUTPUT].item())
    return out


def _tensors(state: f8.ScalingState) -> tuple[torch.Tensor, ...]:
    return state.amax_history, state.scale, state.update_count


def f32(values: list[float]) -> list[float]:
    return [float(np.float32(v)) for v in values]


def test_worked_1_max_algorithm() -> None:
    recipe = DelayedScaling(amax_history_len=4, fp8_format="e4m3")
    amaxes = [1, 2, 8, 3, 0.5, 0.5, 0.5, 0.5]
    scales, hist = forward_scales(amaxes[:4], recipe)
    assert scales == f32([448, 224, 56, 56])
    assert hist == [0, 2, 8, 3]
    scales, hist = forward_scales(amaxes, recipe)
    assert scales == f32([448, 224, 56, 56, 56, 56, 448 / 3, 896])
    assert hist == [0, 0.5, 0.5, 0.5]


def test_worked_2_most_recent() -> None:
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    scales, _ = forward_scales([1, 2, 8, 3, 0.5, 0.5, 0.5, 0.5], recipe)
    assert scales == f32([448, 224, 56, 448 / 3, 896, 896, 896, 896])


@pytest.mark.parametrize(("margin", "expected"), [(1, [224, 448 / 6]), (-1, [896, 448 * 2 / 3])])
def test_worked_3_margin(margin: int, expected: list[float]) -> None:
    scales, _ = forward_scales([1, 3], DelayedScaling(amax_history_len=2, margin=margin))
    assert scales == f32(expected)
    spec_printed = [224.0, 74.666664] if margin == 1 else [896.0, 298.66666]
    assert scales == f32(spec_printed)


def test_worked_4_e5m2_backward_under_hybrid() -> None:
    scales = backward_scales([1, 3, 0.001], DelayedScaling(amax_history_len=2))
    assert scales == f32([57344, 57344 / 3, 57344 / 3])


def test_worked_5_zero_amax_is_skipped() -> None:
    scales, hist = forward_scales([0, 0, 5], DelayedScaling(amax_history_len=3))
    assert scales == f32([1, 1, 89.6])
    assert hist == [0, 0, 5]
    _, hist = forward_scales([0, 0], DelayedScaling(amax_history_len=3))
    assert hist == [0, 0, 0]


def test_worked_6_module_that_did_not_run_is_skipped() -> None:
    scales, hist = forward_scales([8, 1, None], DelayedScaling(amax_history_len=2))
    assert scales == f32([56, 56, 56])
    assert hist == [0, 1]


@pytest.mark.parametrize(
    ("algo", "expected"),
    [("max", [448, 448, 448, 448, 224]), ("most_recent", [448, 448, 224, 224, 224])],
)
def test_worked_7_inf_never_poisons_the_scale(algo: str, expected: list[float]) -> None:
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo)
    scales, _ = forward_scales([1, math.inf, 2, 2, 2], recipe)
    assert scales == f32(expected)


def test_worked_8_history_of_one_and_float32_guards() -> None:
    recipe = DelayedScaling(amax_history_len=1)
    scales, hist = forward_scales([1e-37, 1e-30, 3e38], recipe)
    assert scales == [FLOAT32_MAX, float(np.float32(4.48e32)), float(np.float32(1.4933333e-36))]
    assert hist == [0]
    scales, _ = forward_scales([4, 2, 0, 16], recipe)
    assert scales == f32([112, 224, 224, 28])


@pytest.mark.parametrize(
    ("amax", "margin", "expected"), [(3, 0, 128), (3, 1, 64), (0.001, 0, 262144)]
)
def test_worked_9_power_of_two_scales(amax: float, margin: int, expected: float) -> None:
    recipe = DelayedScaling(amax_history_len=1, power_2_scale=True, margin=margin)
    assert forward_scales([amax], recipe)[0] == [expected]


def test_worked_10_interval() -> None:
    recipe = DelayedScaling(amax_history_len=4, interval=2)
    scales, _ = forward_scales([1, 2, 8, 3], recipe)
    assert scales == f32([448, 448, 56, 56])


def test_worked_13_several_quantizations_fold_into_one_entry() -> None:
    layer = f8.Linear(16, 16)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        for a in (3.0, 5.0, 2.0):
            layer(_x_with_amax(a))
        assert layer.fp8_meta.forward.amax_history[0, INPUT].item() == 5.0
    assert layer.fp8_meta.forward.amax_history[:, INPUT].tolist() == [0, 0, 0, 5]
    assert layer.fp8_meta.forward.scale[INPUT].item() == np.float32(448) / np.float32(5)
    assert layer.fp8_meta.forward.update_count[INPUT].item() == 1


def test_callable_amax_algorithm_sees_the_current_amax_in_row_0() -> None:
    seen = []

    def mean_of_window(history: torch.Tensor) -> torch.Tensor:
        seen.append(history.clone())
        return history.sum(0) / history.shape[0]

    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=mean_of_window)
    scales, _ = forward_scales([2, 6], recipe)
    assert seen[1][:, INPUT].tolist() == [6, 2]
    assert scales == f32([448 / 1, 448 / 4])


def test_callable_algorithm_sees_only_the_states_that_ran() -> None:
    """SPEC section 3: a callable is evaluated on the states that ran under the recipe, together.
    A model of the same recipe object that did not run in this autocast is neither passed to the
    callable nor able to change the scales of the one that ran."""
    widths: list[int] = []

    def whole_state_max(history: torch.Tensor) -> torch.Tensor:
        widths.append(history.shape[1])
        return history.amax().expand(history.shape[1])

    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=whole_state_max)
    torch.manual_seed(0)
    ran, idle = f8.Linear(16, 16), f8.Linear(16, 16)
    with f8.autocast(recipe=recipe):
        idle(_x_with_amax(1000.0)).sum().backward()  # registers ``idle`` with a large amax
    idle_state = [t.clone() for t in _tensors(idle.fp8_meta.forward)]
    widths.clear()
    with f8.autocast(recipe=recipe):
        y = ran(_x_with_amax(2.0))
    y.sum().backward()  # the forward event at the autocast exit, then the backward one
    slots = (ran.fp8_meta.forward.num_slots, ran.fp8_meta.backward.num_slots)
    assert tuple(widths) == slots
    forward = ran.fp8_meta.forward
    own_max = forward.amax_history[-1].max().item()
    ran_once = forward.update_count.tolist()  # a slot that staged 0 keeps scale 1
    assert forward.scale.tolist() == f32([448 / own_max if n else 1 for n in ran_once])
    assert sum(ran_once) == 2  # the input and the weight
    for before, after in zip(idle_state, _tensors(idle.fp8_meta.forward), strict=True):
        assert torch.equal(before, after)


def test_callable_scaling_factor_and_its_guard() -> None:
    def halve(amax, old_scale, fp8_max, recipe):
        return fp8_max / amax / 2

    scales, _ = forward_scales([4, 0.5], DelayedScaling(scaling_factor_compute_algo=halve))
    assert scales == f32([56, 56])  # window max stays 4 with L=1024

    def bad(amax, old_scale, fp8_max, recipe):
        return torch.full_like(amax, math.nan)

    scales, _ = forward_scales([4], DelayedScaling(scaling_factor_compute_algo=bad))
    assert scales == [1.0]

    def wrong_shape(amax, old_scale, fp8_max, recipe):
        return torch.ones(7)

    with pytest.raises(ValueError, match="scaling_factor_compute_algo must return"):
        forward_scales([4], DelayedScaling(scaling_factor_compute_algo=wrong_shape))


def test_a_callable_returning_one_value_for_every_module_is_refused() -> None:
    """A TE-style ``h.max()`` is 0-d: TE calls it per module, fp8kit on the history of every
    module of the event, where broadcasting it would give module b the scale of module a's
    amax (docs/te_modules.md, "Recipe callables")."""
    whole = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.max())
    with pytest.raises(ValueError, match=r"^amax_compute_algo must return a tensor of shape"):
        forward_scales([4], whole)

    def one_scale(amax, old_scale, fp8_max, recipe):
        return fp8_max / amax.max()

    message = r"^scaling_factor_compute_algo must return .*\(one value per column"
    with pytest.raises(ValueError, match=message):
        forward_scales([4], DelayedScaling(scaling_factor_compute_algo=one_scale))


def test_no_grad_forward_accumulates_without_rolling() -> None:
    layer = f8.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=4)
    with torch.no_grad(), f8.autocast(recipe=recipe):
        layer(_x_with_amax(7.0))
    state = layer.fp8_meta.forward
    assert state.amax_history[0, INPUT].item() == 7.0 and state.scale[INPUT].item() == 1.0
    with f8.autocast(recipe=recipe):
        layer(_x_with_amax(2.0))
    assert state.amax_history[:, INPUT].tolist() == [0, 0, 0, 7]
    assert state.scale[INPUT].item() == 64.0


def test_an_evaluation_under_a_shorter_history_recipe_keeps_the_training_history() -> None:
    """A no_grad evaluation under a recipe with a shorter history resized the state to it and
    back at the next training event, dropping the oldest entries: on one rank only after a
    rank-local evaluation, so the ranks' scales parted for good (docs/distributed.md rule 4).
    An evaluation binds nothing now: the run equals one that evaluates under the training
    recipe, entry for entry (the evaluation's amax is staged as the SPEC says)."""
    train, short = DelayedScaling(amax_history_len=8), DelayedScaling(amax_history_len=2)
    states = []
    for eval_recipe in (train, short):
        torch.manual_seed(0)
        layer = f8.Linear(16, 16)
        for step, amax in enumerate((8.0, 7.0, 6.0, 5.0)):
            with f8.autocast(recipe=train):
                layer(_x_with_amax(amax)).sum().backward()
            if step == 1:
                with torch.no_grad(), f8.autocast(recipe=eval_recipe):
                    layer(_x_with_amax(1.0))
        states.append(layer.fp8_meta.forward)
    assert torch.equal(states[0].amax_history, states[1].amax_history)
    assert states[1].amax_history[:, INPUT].tolist() == [0, 0, 0, 0, 8, 7, 6, 5]
    assert states[1].scale[INPUT].item() == 56.0  # 448 / 8: the 8 is still in the window
    assert states[1].recipe_data == train.to_dict()


def test_a_module_run_under_no_grad_inside_a_training_autocast_joins_its_event() -> None:
    """A frozen teacher or backbone called under ``torch.no_grad()`` inside the training
    autocast: the event is decided at the exit (grad mode on there), so its forward state rolls
    with the others, as in Transformer Engine, whose modules join the autocast's buffers
    whatever the grad mode (ADR 0263). Its backward state, never run, stays."""
    frozen, head = f8.Linear(16, 16), f8.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=4)
    for amax in (7.0, 2.0):
        with f8.autocast(recipe=recipe):
            with torch.no_grad():
                h = frozen(_x_with_amax(amax))
            y = head(h)
        y.sum().backward()
    state = frozen.fp8_meta.forward
    assert state.amax_history[:, INPUT].tolist() == [0, 0, 7, 2]
    assert state.scale[INPUT].item() == 64.0 and state.update_count[INPUT].item() == 2
    assert frozen.fp8_meta.backward.update_count.tolist() == [0, 0]
    # no_grad around the autocast: its exit runs no event, the staging row keeps the max
    with torch.no_grad(), f8.autocast(recipe=recipe):
        frozen(_x_with_amax(5.0))
    assert state.amax_history[:, INPUT].tolist() == [5, 0, 7, 2]


def test_nested_autocast_updates_once_at_outermost_exit() -> None:
    layer = f8.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=4)
    with f8.autocast(recipe=recipe):
        with f8.autocast(recipe=recipe):
            layer(_x_with_amax(2.0))
        assert layer.fp8_meta.forward.update_count[INPUT].item() == 0
        with f8.autocast(enabled=False):
            y = layer(_x_with_amax(100.0))  # plain high precision: records nothing
            torch.testing.assert_close(
                y, torch.nn.functional.linear(_x_with_amax(100.0), layer.weight, layer.bias)
            )
    assert layer.fp8_meta.forward.amax_history[:, INPUT].tolist() == [0, 0, 0, 2]


def test_exception_inside_autocast_keeps_staging_for_the_next_event() -> None:
    layer = f8.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=4)
    with pytest.raises(RuntimeError, match="boom"), f8.autocast(recipe=recipe):
        layer(_x_with_amax(9.0))
        raise RuntimeError("boom")
    assert layer.fp8_meta.forward.amax_history[0, INPUT].item() == 9.0
    with f8.autocast(recipe=recipe):
        layer(_x_with_amax(1.0))
    assert layer.fp8_meta.forward.amax_history[:, INPUT].tolist() == [0, 0, 0, 9]


class _RaisesInBackward(torch.autograd.Function):
    """Identity whose backward raises: a pass that fails after an FP8 module's backward ran."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        raise RuntimeError("backward boom")


def test_backward_that_raises_keeps_staging_for_the_next_backward_event() -> None:
    """A pass that raises runs no backward event; its staged dY amax joins the next pass's
    event, and every later pass runs its own (as a forward body that raised)."""
    layer = f8.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(4, 16, requires_grad=True)
    with f8.autocast(recipe=recipe):
        y = layer(_RaisesInBackward.apply(x))
    with pytest.raises(RuntimeError, match="backward boom"):
        y.backward(_x_with_amax(9.0))
    backward = layer.fp8_meta.backward
    assert backward.amax_history[0, GRAD_OUTPUT].item() == 9.0
    assert backward.update_count[GRAD_OUTPUT].item() == 0
    for step, amax in enumerate([1.0, 2.0, 3.0]):
        with f8.autocast(recipe=recipe):
            y = layer(torch.randn(4, 16))
        y.backward(_x_with_amax(amax))
        assert backward.update_count[GRAD_OUTPUT].item() == step + 1
    assert backward.amax_history[:, GRAD_OUTPUT].tolist() == [0, 9, 2, 3]


def test_first_step_current_scaling() -> None:
    recipe = DelayedScaling(amax_history_len=4, first_step_scaling="current")
    layer = f8.Linear(16, 16)
    x = _x_with_amax(1000.0)  # scale 1 would saturate everything above 448
    with f8.autocast(recipe=recipe):
        y = layer(x)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert ((y - ref).norm() / ref.norm()).item() < 0.08
    with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y_unity = f8.Linear(16, 16)(x)
    assert ((y_unity - ref).norm() / ref.norm()).item() > 0.1
    # The history and the update are the same as with "unity".
    assert layer.fp8_meta.forward.amax_history[:, INPUT].tolist() == [0, 0, 0, 1000]
    assert layer.fp8_meta.forward.scale[INPUT].item() == pytest.approx(0.448)


def _max_of_completed_history(h):
    """A callable algorithm for numpy and torch: max over rows 1.. (row 0 if L == 1)."""
    sub = h[1:] if h.shape[0] > 1 else h
    return sub.amax(0) if isinstance(sub, torch.Tensor) else sub.max(0)


@pytest.mark.parametrize("seed", range(6))
def test_batched_update_matches_per_slot_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    algo = ["max", "most_recent", _max_of_completed_history][seed % 3]
    recipe = DelayedScaling(
        amax_history_len=int(rng.integers(1, 9)),
        margin=int(rng.integers(-2, 3)),
        interval=int(rng.integers(1, 4)),
        amax_compute_algo=algo,
        power_2_scale=bool(seed % 2),
    )
    n = 37
    length = recipe.amax_history_len
    hist = np.zeros((length, n), np.float32)
    scale = np.ones(n, np.float32)
    counts = np.zeros(n, np.int64)
    th, ts, tc = map(torch.from_numpy, (hist.copy(), scale.copy(), counts.copy()))
    fmax = [E4M3.max, E5M2.max][seed % 2]
    specials = np.array([0, 0, math.inf, 1e-40, 3e38, 1e-30], np.float32)
    for _ in range(12):
        staged = np.exp2(rng.uniform(-20, 20, n)).astype(np.float32)
        staged[rng.random(n) < 0.3] = 0.0
        picks = rng.integers(0, n, 4)
        staged[picks] = rng.choice(specials, 4)
        hist[0] = staged
        th[0] = torch.from_numpy(staged)
        hist, scale, counts = update_reference(hist, scale, counts, recipe, fmax)
        th, ts, tc = update_scaling_state(th, ts, tc, recipe, fmax)
        np.testing.assert_array_equal(th.numpy(), hist)
        np.testing.assert_array_equal(ts.numpy(), scale)
        np.testing.assert_array_equal(tc.numpy(), counts)
    assert np.isfinite(scale).all() and (scale > 0).all()


def _halve(
    amax: torch.Tensor, old_scale: torch.Tensor, fp8_max: torch.Tensor, recipe: DelayedScaling
) -> torch.Tensor:
    return fp8_max / amax / 2


@pytest.mark.parametrize("scaling", [None, _halve], ids=["built-in", "callable"])
def test_max_window_ignores_nan_entries_with_every_scaling_rule(
    scaling: Callable[..., torch.Tensor] | None,
) -> None:
    # A NaN can reach a history only by a load or an edit (amaxes never record NaN), and "max"
    # must ignore it (docs/semantics.md section 3) whichever rule computes the scale: a
    # scaling_factor_compute_algo takes the torch rule instead of the fused kernel.
    rng = np.random.default_rng(7)
    recipe = DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=scaling)
    n = 24
    hist = np.exp2(rng.uniform(-8, 8, (4, n))).astype(np.float32)
    hist[1:][rng.random((3, n)) < 0.4] = np.nan
    hist[1:, :3] = np.nan  # windows whose completed entries are all NaN
    hist[0, 5] = 0.0  # a slot that did not run keeps its NaN entries
    scale, counts = np.ones(n, np.float32), np.zeros(n, np.int64)
    want = update_reference(hist, scale, counts, recipe, E4M3.max)
    got = update_scaling_state(*map(torch.from_numpy, (hist, scale, counts)), recipe, E4M3.max)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.numpy(), w)
    assert not np.array_equal(want[1], scale)  # the NaN-holed windows did get new scales

    layer = f8.Linear(16, 16)  # the same through a module, its history NaN-holed by hand
    with f8.autocast(recipe=recipe):  # the first step binds the history length
        layer(_x_with_amax(1.0))
    with torch.no_grad():
        layer.fp8_meta.forward.amax_history[1:, INPUT] = torch.tensor([math.nan, 2.0, math.nan])
    with f8.autocast(recipe=recipe):
        layer(_x_with_amax(1.0))
    expected = E4M3.max / 2 / (2 if scaling is not None else 1)
    assert layer.fp8_meta.forward.scale[INPUT].item() == expected


def test_reference_sequences_agree_with_spec_numbers() -> None:
    # The reference itself is checked against docs/semantics.md section 10 item 1 so the two can't
    # drift together.
    scales, hist = scale_sequence([1, 2, 8, 3], DelayedScaling(amax_history_len=4), 448.0)
    assert scales == f32([448, 224, 56, 56]) and hist.tolist() == [0, 2, 8, 3]


@pytest.mark.parametrize("result", ["zero", "negative"])
def test_a_callable_scale_of_zero_or_below_keeps_the_old_scale(result: str) -> None:
    """SPEC section 9: no scale is 0 or negative; a callable's such result keeps the old scale,
    and the event still counts (the slot ran)."""

    def bad(amax, old_scale, fp8_max, recipe):
        return torch.zeros_like(amax) if result == "zero" else -fp8_max / amax

    recipe = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=bad)
    hist = torch.tensor([[4.0], [0.0]])
    h, s, c = update_scaling_state(hist, torch.tensor([3.0]), torch.tensor([0]), recipe, 448.0)
    assert s.tolist() == [3.0] and c.tolist() == [1] and h[:, 0].tolist() == [0.0, 4.0]


def test_callable_algorithm_keeps_scale_inv_the_reciprocal_of_scale() -> None:
    """Kills AP1 (apply.py `_rule_update` writes scale into scale_inv). SPEC 2: scale_inv =
    1/scale (float32, correctly rounded); the state's scale_inv buffer must follow every update,
    the callable algorithms' torch rule included."""
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=lambda h: h.amax(dim=0))
    layer = f8.Linear(16, 16)
    for amax in (3.0, 5.0):
        with f8.autocast(recipe=recipe):
            y = layer(torch.full((2, 16), amax))
        y.sum().backward()
    for state in (layer.fp8_meta.forward, layer.fp8_meta.backward):
        assert state.update_count.max().item() == 2
        np.testing.assert_array_equal(
            state.scale_inv.numpy(), (np.float32(1.0) / state.scale.numpy()).astype(np.float32)
        )


def test_callable_algorithm_counts_an_infinite_amax() -> None:
    """Kills AP2 (apply.py `_rule_update` no longer adds to nonfinite_count). SPEC 9: an inf
    amax freezes the slot's scale; fp8kit counts such events per slot (nonfinite_count) and
    warns once, for callable algorithms as for the built-in ones."""
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.amax(dim=0))
    layer = f8.Linear(16, 16)
    x = torch.ones(2, 16)
    x[0, 3] = float("inf")
    with pytest.warns(UserWarning, match="infinite amax"), f8.autocast(recipe=recipe):
        layer(x)
    fwd = layer.fp8_meta.forward
    assert fwd.nonfinite_count.tolist() == [1, 0, 0]
    assert fwd.scale[INPUT].item() == 1.0  # kept: the window holds inf
