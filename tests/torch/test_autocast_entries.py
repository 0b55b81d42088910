"""What one autocast entry hands to the next on a thread (docs/performance.md, "Host time per
call"): shared settings, a reused module run, and forward queues that hold nothing between
bodies. The numbers must be those of a fresh entry each time."""

from __future__ import annotations

import gc
import sys
import threading
import warnings
import weakref

import pytest
import torch

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from fp8kit.torch.autocast import current_settings
from fp8kit.torch.linear import fp8_run_for

INPUT = f8.FwdSlot.INPUT


def _settings(**kwargs: object) -> object:
    with f8.autocast(**kwargs):  # type: ignore[arg-type]
        return current_settings()


def test_equal_autocast_arguments_give_the_same_settings_on_a_thread() -> None:
    recipe = DelayedScaling(amax_history_len=5)
    first = _settings(recipe=recipe)
    assert _settings(recipe=recipe) is first
    assert _settings(recipe=DelayedScaling(amax_history_len=5)) is first  # an equal recipe
    assert _settings(recipe=DelayedScaling(amax_history_len=6)) is not first
    assert _settings(recipe=recipe, calibrating=True) is not first
    assert _settings(recipe=recipe, enabled=False) is None
    assert _settings(recipe=recipe, enabled=False, calibrating=True) is not first
    current = Float8CurrentScaling()
    assert _settings(recipe=current) is _settings(recipe=current)
    assert _settings(recipe=current).forward_states is None  # type: ignore[attr-defined]

    other: list[object] = []
    thread = threading.Thread(target=lambda: other.append(_settings(recipe=recipe)))
    thread.start()
    thread.join()
    assert other[0] is not first  # each thread queues its own forward states
    assert other[0].forward_states is not first.forward_states  # type: ignore[attr-defined]


def test_a_module_reuses_its_run_while_settings_and_buffers_hold() -> None:
    """The run does not depend on grad mode: a module enrols its forward state either way, and
    the autocast's exit decides whether the event runs (ADR 0263)."""
    layer = f8.Linear(16, 16)
    x = torch.randn(4, 16)
    recipe = DelayedScaling(amax_history_len=4)

    def run() -> object:
        with f8.autocast(recipe=recipe):
            return fp8_run_for(layer, x, 16, layer.weight)

    first = run()
    assert run() is first
    with torch.no_grad():
        assert run() is first
    with f8.autocast(recipe=DelayedScaling(amax_history_len=4, margin=1)):
        assert fp8_run_for(layer, x, 16, layer.weight) is not first
    again = run()
    assert again is run()
    layer.fp8_meta.forward.scale = torch.ones(3)  # a replaced buffer: a new run
    assert run() is not again


def test_a_checkpoint_with_another_history_length_is_rebound_under_the_same_recipe() -> None:
    recipe = DelayedScaling(amax_history_len=4)
    saved = f8.Linear(16, 16)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=8)):
        saved(torch.randn(4, 16))
    layer = f8.Linear(16, 16)
    with f8.autocast(recipe=recipe):
        layer(torch.randn(4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer.load_state_dict(saved.state_dict())
    assert layer.fp8_meta.forward.history_len == 8
    with (
        pytest.warns(UserWarning, match="from 8 to 4 entries"),
        f8.autocast(recipe=recipe),
    ):
        layer(torch.randn(4, 16))
    assert layer.fp8_meta.forward.history_len == 4


def test_a_body_that_raised_leaves_nothing_for_the_next_event() -> None:
    recipe = DelayedScaling(amax_history_len=4)
    raised, other = f8.Linear(16, 16), f8.Linear(16, 16)
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="boom"), f8.autocast(recipe=recipe):
        raised(x * 9)
        raise RuntimeError("boom")
    with f8.autocast(recipe=recipe):
        other(x)
    state = raised.fp8_meta.forward
    # Not in the event of the body after: its amax stays staged, nothing rolled.
    assert state.update_count[INPUT].item() == 0
    assert state.amax_history[0, INPUT].item() == pytest.approx(9 * x.abs().max().item())
    assert other.fp8_meta.forward.update_count[INPUT].item() == 1


def test_the_thread_queues_keep_no_state_alive_after_the_body() -> None:
    recipe = DelayedScaling(amax_history_len=4)
    layer = f8.Linear(16, 16)
    with f8.autocast(recipe=recipe):
        layer(torch.randn(4, 16))
    forward = weakref.ref(layer.fp8_meta.forward)
    with pytest.raises(RuntimeError, match="boom"), f8.autocast(recipe=recipe):
        layer(torch.randn(4, 16))
        raise RuntimeError("boom")
    del layer
    gc.collect()
    assert forward() is None


def test_a_new_callable_recipe_at_every_step_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each recipe with a new lambda is a new (recipe, group) key, kept for good: every
    ``MANY_EVENT_KEYS`` new keys a warning names the cause; equal recipes make no new key."""
    layer = f8.Linear(8, 8)
    x = torch.randn(2, 8)
    autocast = sys.modules["fp8kit.torch.autocast"]  # the module (f8.autocast is the context)
    monkeypatch.setattr(autocast, "MANY_EVENT_KEYS", len(autocast._events) + 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):  # equal recipes: one key
            with f8.autocast(recipe=DelayedScaling(amax_history_len=3, margin=0.3721)):
                layer(x)  # a margin no other test uses: one new key
        with f8.autocast(
            recipe=DelayedScaling(amax_history_len=3, amax_compute_algo=lambda h: h.amax(0))
        ):
            layer(x)
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=lambda h: h.amax(0))
    with (
        pytest.warns(UserWarning, match="a recipe built with a new lambda"),
        f8.autocast(recipe=recipe),
    ):
        layer(x)


def test_a_reduction_group_with_current_scaling_is_told() -> None:
    """Current scaling keeps no amaxes to reduce: a group given with it used to be dropped
    without a word (decision 0248). The spelling TE users pass, fp8_group, says so too."""
    # new_group's answer on a rank outside the group: a group value without a process group
    group = torch.distributed.GroupMember.NON_GROUP_MEMBER
    with pytest.warns(UserWarning, match="amax_reduction_group has no effect"):
        f8.autocast(recipe=f8.Float8CurrentScaling(), amax_reduction_group=group)
    with pytest.warns(UserWarning, match="amax_reduction_group has no effect") as told:
        f8.fp8_autocast(fp8_recipe=f8.Float8CurrentScaling(), fp8_group=group)
    assert told[0].filename == __file__  # the caller's line, not fp8kit's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f8.autocast(recipe=f8.Float8CurrentScaling())
        f8.autocast(recipe=DelayedScaling(), amax_reduction_group=group)
