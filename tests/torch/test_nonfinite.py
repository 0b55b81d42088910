"""Infinite amaxes: exact (docs/semantics.md) frozen scales, per-slot counts, one warning per module
naming it, and the Inspector's count (docs/semantics.md section 9)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling
from fp8kit.torch.state import NonfiniteAmaxWarning

INPUT = 0


def _step(layer: torch.nn.Module, x: torch.Tensor, recipe: DelayedScaling) -> None:
    with f8.autocast(recipe=recipe):
        y = layer(x)
    y.sum().backward()


def test_inf_amax_is_counted_and_warned_once_per_module() -> None:
    torch.manual_seed(0)
    layer = f8.Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=3)
    x = torch.randn(16, 16)
    _step(layer, x, recipe)
    scale_before = layer.fp8_meta.forward.scale[INPUT].item()
    with pytest.warns(NonfiniteAmaxWarning, match=r"Linear\(16, 16\)\.forward \(slot INPUT\)"):
        _step(layer, x * float("inf"), recipe)
    fwd = layer.fp8_meta.forward
    assert fwd.nonfinite_count.tolist() == [1, 0, 0]
    assert fwd.scale[INPUT].item() == scale_before  # frozen while inf is in the window
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonfiniteAmaxWarning)  # no second warning
        _step(layer, x * float("inf"), recipe)
        _step(layer, x, recipe)
    assert fwd.nonfinite_count.tolist() == [2, 0, 0]
    assert layer.fp8_meta.backward.nonfinite_count.tolist() == [0, 0]


def test_same_shaped_modules_each_get_their_warning_naming_them() -> None:
    """Two directly built, same-shaped layers: under Python's default filter (one warning per
    text and place) each still gets its own warning, and after label_fp8_modules each names its
    path in the model."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=3)
    x = torch.randn(8, 16) * float("inf")
    for labelled in (False, True):
        model = torch.nn.ModuleDict({"left": f8.Linear(16, 16), "right": f8.Linear(16, 16)})
        if labelled:
            assert f8.label_fp8_modules(model) is model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            with f8.autocast(recipe=recipe):
                y = model["left"](x) + model["right"](x)
            y.sum().backward()
        texts = [str(w.message) for w in caught if w.category is NonfiniteAmaxWarning]
        assert len(texts) == 2, texts
        if labelled:
            assert "of left.forward (slot INPUT)" in texts[0]
            assert "of right.forward (slot INPUT)" in texts[1]


def test_a_new_module_in_a_rebuilt_pool_still_warns() -> None:
    """The watch forgets the columns of a rebuilt pool: a module that replaces one which already
    saw an inf (same recipe, same pool shape) is warned about its own first inf."""
    recipe = DelayedScaling(amax_history_len=5, margin=1)  # a registry of this test's own
    x = torch.randn(8, 8)
    first = f8.Linear(8, 8)
    with pytest.warns(NonfiniteAmaxWarning):
        _step(first, x * float("inf"), recipe)
    del first  # its pool column is dropped at the next event
    second = f8.Linear(8, 8)
    _step(second, x, recipe)
    with pytest.warns(NonfiniteAmaxWarning, match=r"Linear\(8, 8\)\.forward \(slot INPUT\)"):
        _step(second, x * float("inf"), recipe)
    assert second.fp8_meta.forward.nonfinite_count.tolist() == [1, 0, 0]


def test_inspector_reports_nonfinite_events() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(f8.Linear(16, 16))
    recipe = DelayedScaling(amax_history_len=2)
    x = torch.randn(16, 16)
    with f8.Inspector(model) as insp, warnings.catch_warnings():
        warnings.simplefilter("ignore", NonfiniteAmaxWarning)
        for xs in (x, x * float("inf"), x):
            _step(model, xs, recipe)
            insp.step()
    steps, counts = insp.series("0.INPUT", "nonfinite_events")
    assert (steps, counts) == ([0, 1, 2], [0, 1, 1])
    assert insp.series("0.WEIGHT", "nonfinite_events")[1] == [0, 0, 0]
