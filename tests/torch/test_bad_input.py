"""fp8kit.torch refuses bad input where it enters, naming the parameter: calls that would do
nothing on a model without FP8 modules, values read by truthiness or letter by letter, and
inputs that failed deep inside with an error that names neither (docs/decisions/0267)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8kit.torch as f8
from fp8kit.torch.checkpoint import init_fp8_state
from fp8kit.torch.ddp import ddp_ignore_fp8_state
from fp8kit.torch.inspect import Inspector


def test_state_helpers_refuse_a_model_without_fp8_modules() -> None:
    """Called before convert_model, both did nothing: the histories kept 1024 rows, and DDP
    went on broadcasting the FP8 buffers that convert_model made afterwards."""
    plain = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(
        ValueError, match=r"^model \(a Sequential\) has no FP8 modules.*convert_model"
    ):
        init_fp8_state(plain)
    with pytest.raises(
        ValueError, match=r"^model \(a Sequential\) has no FP8 state.*convert_model"
    ):
        ddp_ignore_fp8_state(plain)
    f8.convert_model(plain)
    init_fp8_state(plain, f8.DelayedScaling(amax_history_len=4))
    assert plain[0].fp8_meta.forward.amax_history.shape[0] == 4
    assert "0.fp8_meta.forward.scale" in ddp_ignore_fp8_state(plain)


def test_fp8_autocast_names_its_own_parameters() -> None:
    with pytest.raises(TypeError, match=r"^fp8_recipe must be None, a fp8kit\.recipe\.Delayed"):
        f8.fp8_autocast(fp8_recipe=3)
    with pytest.raises(TypeError, match=r"^recipe must be None, a fp8kit\.recipe\.Delayed"):
        f8.autocast(recipe=3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: f8.Linear(8, 8),
        lambda: f8.LayerNormLinear(8, 8),
        lambda: f8.LayerNormMLP(8, 16),
    ],
)
@pytest.mark.parametrize("enabled", [True, False])
def test_a_non_tensor_input_is_named(make, enabled: bool) -> None:
    """It raised AttributeError: 'list' object has no attribute 'shape'."""
    module = make()
    with f8.autocast(enabled=enabled):
        for bad in ([[1.0] * 8], None):
            with pytest.raises(TypeError, match=r"^(x|inp|input) must be a torch\.Tensor, got "):
                module(bad)


def test_a_non_tensor_attention_input_is_named() -> None:
    """In FP8; in high precision nn.MultiheadAttention's own errors stand, but for the query."""
    mha, q = f8.MultiheadAttention(8, 2), torch.randn(3, 8)
    message = r"^query must be a torch\.Tensor, got list"
    for enabled in (True, False):
        with f8.autocast(enabled=enabled), pytest.raises(TypeError, match=message):
            mha([[1.0] * 8], q, q)
    with f8.autocast(), pytest.raises(TypeError, match=r"^value must be a torch\.Tensor, got None"):
        mha(q, q, None)


def test_flags_and_names_are_not_read_by_truthiness_or_letter_by_letter() -> None:
    layer = f8.Linear(8, 8)
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match=r"^preserve_rng_state must be a bool, got 'no'"):
        f8.activation_checkpoint(layer, x, preserve_rng_state="no")
    with pytest.raises(TypeError, match=r"^every must be an int >= 1, got 2\.0"):
        Inspector(layer, every=2.0)
    with pytest.raises(TypeError, match=r"^every must be an int >= 1, got True"):
        Inspector(layer, every=True)
    with pytest.raises(ValueError, match=r"^every must be an int >= 1, got 0"):
        Inspector(layer, every=0)
    for make in (lambda: f8.FP8Meta(label=3), lambda: f8.ScalingState(3, label=None)):
        with pytest.raises(TypeError, match=r"^label must be a str"):
            make()


def test_plot_refuses_a_metric_name_given_as_a_string() -> None:
    """``metrics="amax"`` was read letter by letter: "metrics must be a subset ..., got 'a'"."""
    pytest.importorskip("matplotlib")
    from fp8kit.torch.inspect.plot import stats_figure

    with pytest.raises(TypeError, match=r"^metrics must be a sequence of metric names"):
        stats_figure([], metrics="amax")
