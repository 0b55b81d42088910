"""Infinite amaxes: exact (docs/semantics.md) frozen scales, per-slot counts, one warning per module
naming it, and the Inspector's count (docs/semantics.md section 9)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling
from fp8kit.torch.state import NonfiniteAmaxWarning, apply

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


class _CountsOnCuda(torch.Tensor):
    """A CPU count tensor that says it is on CUDA (NonfiniteWatch's CUDA branch on the CPU)."""

    @property
    def device(self):  # type: ignore[no-untyped-def, override]
        return torch.device("cuda", 0)


class _Copy:
    """torch.cuda.Event stand-in: a copy recorded at event k has arrived ``lag`` events later."""

    now = 0
    lag = 0

    def record(self, stream: object = None) -> None:
        self.at = _Copy.now

    def query(self) -> bool:
        return _Copy.now >= self.at + _Copy.lag


class _Pool:
    """What NonfiniteWatch reads of a pool; :meth:`rebuild` gives it a new count tensor whose
    columns hold the members' counts, as ``StatePool.sync`` does."""

    def __init__(self, states: list[f8.ScalingState]) -> None:
        self.states = states
        self.rebuild()

    def rebuild(self) -> None:
        counts = torch.cat([s.nonfinite_count for s in self.states])
        offset = 0
        for state in self.states:
            state.nonfinite_count = counts[offset : offset + state.num_slots]
            offset += state.num_slots
        self.nonfinite_count = torch.Tensor._make_subclass(_CountsOnCuda, counts)


@pytest.mark.parametrize(("rebuild_every", "lag"), [(None, 0), (None, 5), (3, 0), (5, 2), (8, 0)])
def test_the_cuda_watch_warns_within_its_intervals(
    monkeypatch: pytest.MonkeyPatch, rebuild_every: int | None, lag: int
) -> None:
    """The CUDA branch looks every GPU_CHECK_INTERVAL events and reads an asynchronous copy; an
    inf counted at event 3 must be warned about (once, naming the state) within two intervals
    plus the copy's lag, also when the pool is rebuilt between the copy and its read."""
    monkeypatch.setattr(torch.cuda, "Event", _Copy)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    _Copy.lag = lag
    states = [f8.ScalingState(3, history_len=4) for _ in range(3)]
    for i, state in enumerate(states):
        state.label = f"module {i}"
    pool, watch = _Pool(states), apply.NonfiniteWatch()
    recipe = DelayedScaling(amax_history_len=4)
    warned_at = []
    for event in range(1, 6 * apply.GPU_CHECK_INTERVAL):
        _Copy.now = event
        if rebuild_every and event % rebuild_every == 0:
            pool.rebuild()
        if event == 3:
            states[1].nonfinite_count[2] += 1  # the update kernel counted an inf in slot 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watch.check(pool, lambda: pool.states, "forward", recipe)  # type: ignore[arg-type]
        warned_at += [(event, str(w.message)) for w in caught]
    assert len(warned_at) == 1, warned_at
    event, message = warned_at[0]
    assert "module 1" in message and "GRAD_INPUT" not in message
    assert event - 3 <= 2 * apply.GPU_CHECK_INTERVAL + lag


def test_each_direction_warns_once_and_unlabelled_modules_name_their_sizes() -> None:
    """One warning per module and direction (an inf in the input and one in the output gradient
    name their slots apart), and a module no path labels names its type and sizes, as the
    docs say (LayerNormMLP and the others gave only their type)."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=3)
    layer = f8.LayerNormMLP(16, 32)
    assert layer.fp8_meta.forward.label == "LayerNormMLP(16, 32).forward"
    assert f8.LayerNormLinear(8, 4).fp8_meta.backward.label == "LayerNormLinear(8, 4).backward"
    assert f8.MultiheadAttention(8, 2).fp8_meta.forward.label == "MultiheadAttention(8, 2).forward"
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer.fc1_weight[0, 0] = float("inf")  # the input passes a norm first: the weight's slot
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with f8.autocast(recipe=recipe):
                y = layer(x)
            y.backward(torch.full_like(y, float("inf")))
    texts = [str(w.message) for w in caught if w.category is NonfiniteAmaxWarning]
    assert len(texts) == 2, texts
    assert "forward amax history of LayerNormMLP(16, 32).forward (slot " in texts[0]
    assert "backward amax history of LayerNormMLP(16, 32).backward (slot " in texts[1]
    assert all("once per module and direction" in t for t in texts)
