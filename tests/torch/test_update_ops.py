"""The batched update costs a fixed number of tensor ops, whatever the number of modules."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

import fp8kit.torch as f8
from benchmarks.bench_update import CountOps
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import state as fp8_state


def _forward_update_ops(num_modules: int, recipe: DelayedScaling) -> Counter[str]:
    """Ops of the second event (the first one also lays the states out in one pool)."""
    layers = [f8.Linear(16, 16) for _ in range(num_modules)]
    x = torch.randn(4, 16)
    with f8.autocast(recipe=recipe):
        for layer in layers:
            layer(x)
    ac = f8.autocast(recipe=recipe)
    ac.__enter__()
    for layer in layers:
        layer(x)
    with CountOps() as counter:
        ac.__exit__(None, None, None)
    assert all(layer.fp8_meta.forward.update_count[0].item() == 2 for layer in layers)
    return counter.ops


@pytest.mark.parametrize(
    "recipe",
    [
        DelayedScaling(amax_history_len=16),
        DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent", interval=3),
        DelayedScaling(power_2_scale=True, margin=2),
    ],
)
def test_forward_update_op_count_does_not_grow_with_modules(recipe: DelayedScaling) -> None:
    few = _forward_update_ops(2, recipe)
    many = _forward_update_ops(50, recipe)
    assert few == many
    assert sum(many.values()) < 64  # a few dozen small ops per event


def test_backward_update_is_one_batched_call_per_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = fp8_state.update_states

    def spy(states, *args, **kwargs):
        calls.append(len(states))
        return real(states, *args, **kwargs)

    model = torch.nn.Sequential(*[f8.Linear(16, 16) for _ in range(30)])
    with f8.autocast(recipe=DelayedScaling(amax_history_len=8)):
        loss = model(torch.randn(4, 16)).sum()
    monkeypatch.setattr(sys.modules["fp8kit.torch.autocast"], "update_states", spy)
    loss.backward()
    # One batched call holding all 30 states (events armed by earlier forwards carry no states).
    assert [c for c in calls if c] == [30]

    def ops_for(states: list, margin: int) -> int:
        # A fresh recipe per call: its own registry, in which every given state ran.
        recipe = DelayedScaling(amax_history_len=8, margin=margin)
        fp8_state.update_states(states, recipe, 57344.0, direction="backward")  # builds the pool
        with CountOps() as counter:
            fp8_state.update_states(states, recipe, 57344.0, direction="backward")
        return sum(counter.ops.values())

    backward_states = [layer.fp8_meta.backward for layer in model]
    assert ops_for(backward_states, 1) == ops_for(backward_states[:3], 2)
