"""f8.make_graphed_callables: graphed FP8 modules train with the numbers of eager ones.

Without CUDA, ``torch.cuda.make_graphed_callables`` is replaced by a stand-in that, like a graph
replay, runs none of fp8kit's host work (``tests/torch/emulated_graphs.py``), so what makes the
numbers right is fp8kit's wrapper alone. On a CUDA machine the last test runs the real capture.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fp8kit.torch as f8
from benchmarks.gpu_measure import gpt_training_step
from fp8kit.demo.model import GPTConfig
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from tests.torch.emulated_graphs import assert_same_state

RECIPE = DelayedScaling(amax_history_len=4)


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        f8.LayerNormLinear(32, 64), torch.nn.ReLU(), f8.Linear(64, 32, fp8_grad=True)
    )


def _step(model: torch.nn.Module, head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with f8.autocast(recipe=RECIPE):
        y = head(model(x))
    y.square().mean().backward()
    return y.detach()


def test_graphed_modules_train_like_eager(emulated_graphs: None) -> None:
    eager, graphed = _block(), _block()
    heads = [_head() for _ in range(2)]
    before = {k: v.clone() for k, v in graphed.state_dict().items() if isinstance(v, torch.Tensor)}
    sample = torch.randn(8, 32)
    f8.make_graphed_callables(graphed, (sample,), fp8_enabled=True, fp8_recipe=RECIPE)
    for k, v in graphed.state_dict().items():  # warm-up and capture leave no trace
        if k in before and "amax_history" not in k:
            assert torch.equal(v, before[k]), k
    assert not graphed[0].fp8_meta.forward.amax_history.any()

    opts = [
        torch.optim.SGD([*m.parameters(), *h.parameters()], lr=0.05)
        for m, h in zip((eager, graphed), heads, strict=True)
    ]
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(8, 32, generator=gen)
        ys = []
        for model, head, opt in zip((eager, graphed), heads, opts, strict=True):
            opt.zero_grad()
            ys.append(_step(model, head, x))
            opt.step()
        assert torch.equal(ys[0], ys[1])
    assert_same_state(eager, graphed)
    assert graphed[2].fp8_meta.forward.update_count.tolist() == [4, 4, 0]
    assert graphed[2].fp8_meta.backward.update_count.tolist() == [4, 4]


def _head() -> torch.nn.Module:
    """An eager high-precision layer after the graphed block (an eager FP8 layer under the same
    recipe would have to run once before the capture: see make_graphed_callables)."""
    torch.manual_seed(5)
    return torch.nn.Linear(32, 16)


class _TwoHeads(torch.nn.Module):
    """Two FP8 Linears on one input, their outputs in a dict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = f8.Linear(32, 16), f8.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": self.a(x), "b": self.b(x)}


def test_a_gradient_through_any_output_enrols_the_backward_states(emulated_graphs: None) -> None:
    """Outputs in a pytree, the loss on the second only: the replay's backward enrolment still
    runs the backward event for the graphed module's states, as eager."""
    eager, graphed = _TwoHeads(), _TwoHeads()
    f8.make_graphed_callables(graphed, (torch.randn(8, 32),), fp8_enabled=True, fp8_recipe=RECIPE)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 32, generator=gen)
        for model in (eager, graphed):
            with f8.autocast(recipe=RECIPE):
                out = model(x)
            out["b"].square().mean().backward()
    assert_same_state(eager, graphed)
    assert graphed.b.fp8_meta.backward.update_count.tolist() == [3, 0]
    assert graphed.a.fp8_meta.backward.update_count.tolist() == [0, 0]
    assert torch.equal(graphed.b.weight.grad, eager.b.weight.grad)


def test_later_fp8_modules_do_not_move_the_graphed_buffers(emulated_graphs: None) -> None:
    graphed = _block()
    f8.make_graphed_callables(graphed, (torch.randn(8, 32),), fp8_enabled=True, fp8_recipe=RECIPE)
    held = graphed[0].fp8_meta.forward.scale
    newcomer = f8.Linear(32, 32)  # joins its registry at its first event, in another pool
    with f8.autocast(recipe=RECIPE):
        newcomer(graphed(torch.randn(8, 32))).sum().backward()
    assert graphed[0].fp8_meta.forward.scale is held
    assert graphed[0].fp8_meta.forward.update_count.tolist() == [1, 1, 0]


def test_a_copy_of_a_graphed_module_leaves_its_pool(emulated_graphs: None) -> None:
    """A deep copy (e.g. an EMA model) is in no graph: it must not join, and so re-lay, the
    graphed states' pool."""
    graphed = _block()
    f8.make_graphed_callables(graphed, (torch.randn(8, 32),), fp8_enabled=True, fp8_recipe=RECIPE)
    copied = copy.deepcopy(graphed)
    assert graphed[0].fp8_meta.forward.pool_partition != 0
    assert copied[0].fp8_meta.forward.pool_partition == 0


def test_a_replay_refuses_buffers_replaced_after_capture(emulated_graphs: None) -> None:
    graphed = _block()
    f8.make_graphed_callables(graphed, (torch.randn(8, 32),), fp8_enabled=True, fp8_recipe=RECIPE)
    state = graphed[0].fp8_meta.forward
    state.scale = state.scale.clone()  # e.g. a load that replaced the tensor
    with (
        pytest.raises(RuntimeError, match="replaced after its CUDA graph was captured"),
        f8.autocast(recipe=RECIPE),
    ):
        graphed(torch.randn(8, 32))


def test_a_replay_refuses_other_autocast_settings(emulated_graphs: None) -> None:
    """The graph holds the capture's FP8 casts: outside an autocast, or under another recipe or
    mode, a replay would compute or record what eager code would not."""
    graphed = _block()
    f8.make_graphed_callables(graphed, (torch.randn(8, 32),), fp8_enabled=True, fp8_recipe=RECIPE)
    x = torch.randn(8, 32)
    with pytest.raises(ValueError, match=r"no f8\.autocast is active"):
        graphed(x)
    for other in (
        f8.autocast(recipe=DelayedScaling(amax_history_len=8)),
        f8.autocast(recipe=RECIPE, calibrating=True),
    ):
        with pytest.raises(ValueError, match=r"was graphed inside f8\.autocast"), other:
            graphed(x)
    current = _block()  # current scaling enrols nothing, and still computes in FP8
    f8.make_graphed_callables(current, (x,), fp8_enabled=True, fp8_recipe=f8.Float8CurrentScaling())
    with pytest.raises(ValueError, match=r"no f8\.autocast is active"):
        current(x)


def test_a_graphed_calibration_rolls_forward_scales_without_grad(emulated_graphs: None) -> None:
    """Calibration (no grad) updates forward scales, graphed as eager."""
    eager, graphed = _block(), _block()
    sample = torch.randn(8, 32)
    f8.make_graphed_callables(
        graphed, (sample,), fp8_enabled=True, fp8_calibrating=True, fp8_recipe=RECIPE
    )
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(8, 32, generator=gen)
        outs = []
        for model in (eager, graphed):
            with torch.no_grad(), f8.autocast(recipe=RECIPE, calibrating=True):
                outs.append(model(x))
        assert torch.equal(*outs)
    assert graphed[0].fp8_meta.forward.update_count.tolist() == [3, 3, 0]
    assert_same_state(eager, graphed)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"modules": [torch.nn.Linear(2, 2)]}, TypeError, "modules must be"),
        ({"sample_args": [torch.zeros(2)]}, ValueError, "sample_args must be"),
        ({"fp8_enabled": 1}, TypeError, "fp8_enabled must be a bool"),
        ({"fp8_recipe": "delayed"}, TypeError, "fp8_recipe must be"),
        ({"num_warmup_iters": -1}, ValueError, "num_warmup_iters must be an int >= 0, got -1"),
        ({"num_warmup_iters": "3"}, TypeError, "num_warmup_iters must be an int >= 0"),
        ({"allow_unused_input": 2}, TypeError, "allow_unused_input must be a bool, got 2"),
        ({"fp8_group": "world"}, TypeError, "fp8_group must be None .* got str"),
        (
            {"fp8_calibrating": True, "fp8_recipe": Float8CurrentScaling()},
            ValueError,
            "^fp8_calibrating=True needs a DelayedScaling fp8_recipe .* got Float8CurrentScaling",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type, match: str) -> None:
    call: dict[str, Any] = {"modules": torch.nn.Linear(2, 2), "sample_args": (torch.zeros(1, 2),)}
    call.update(kwargs)
    with pytest.raises(error, match=match):
        f8.make_graphed_callables(call.pop("modules"), call.pop("sample_args"), **call)


def test_a_failed_capture_leaves_the_fp8_state_as_it_found_it(monkeypatch) -> None:
    """A capture that raises (here: no CUDA) must not leave the states rebound to the capture's
    recipe, in the capture's pool, or with values of its warm-up."""
    model, head = _block(), torch.nn.Linear(32, 8)
    other = DelayedScaling(amax_history_len=8)
    x = torch.randn(16, 32)
    with f8.autocast(recipe=other):
        head(model(x)).square().mean().backward()
    twin = copy.deepcopy(model)
    states = [m for m in model.modules() if isinstance(m, f8.ScalingState)]
    before = [(s.amax_history.clone(), s.scale.clone(), s.pool_partition) for s in states]

    def capture_fails(modules: Any, sample_args: Any, **kwargs: Any) -> Any:
        for module, args in zip(modules, sample_args, strict=True):
            module(*args).sum().backward()  # a warm-up step, then the capture fails
        raise RuntimeError("capture failed")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture_fails)
    with pytest.raises(RuntimeError, match="capture failed"):
        f8.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=RECIPE)
    for state, (history, scale, partition) in zip(states, before, strict=True):
        assert torch.equal(state.amax_history, history) and torch.equal(state.scale, scale)
        assert state.pool_partition == partition == 0
    for _ in range(2):  # trains on exactly as a copy that never saw the call
        assert torch.equal(_step(model, head, x), _step(twin, head, x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_train_like_eager() -> None:
    device = torch.device("cuda")
    eager, graphed = _block().to(device), _block().to(device)
    heads = [_head().to(device) for _ in range(2)]
    f8.make_graphed_callables(
        graphed, (torch.randn(64, 32, device=device),), fp8_enabled=True, fp8_recipe=RECIPE
    )
    gen = torch.Generator(device).manual_seed(2)
    for _ in range(3):
        x = torch.randn(64, 32, device=device, generator=gen)
        ys = [_step(m, h, x) for m, h in zip((eager, graphed), heads, strict=True)]
        assert torch.equal(ys[0], ys[1])
    assert_same_state(eager, graphed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_train_the_demo_gpt_like_eager() -> None:
    """bench-gpu's CUDA-graphed GPT: the whole demo model (LayerNormLinear, attention,
    LayerNormMLP) and its loss in one capture under ``torch.autocast`` bf16. Close to eager
    rather than equal: the attention backward may sum in another order from run to run."""
    config = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
    eager_step, eager = gpt_training_step(config, 4, RECIPE)
    graphed_step, graphed = gpt_training_step(config, 4, RECIPE, mode="graphed")
    for _ in range(3):
        torch.testing.assert_close(graphed_step(), eager_step(), rtol=1e-3, atol=1e-3)
    for model in (eager, graphed):  # three backward update events in both
        counts = [
            m.fp8_meta.backward.update_count for m in model.modules() if hasattr(m, "fp8_meta")
        ]
        assert counts and all(c.max() == 3 for c in counts)


def test_a_graphed_module_inside_an_activation_checkpoint_is_refused(
    emulated_graphs: None,
) -> None:
    """A replay reads the live scales: it cannot recompute the forward's FP8 values."""
    graphed = _block()
    f8.make_graphed_callables(graphed, (torch.randn(8, 32),), fp8_enabled=True, fp8_recipe=RECIPE)
    with (
        pytest.raises(RuntimeError, match="CUDA-graphed FP8 module ran inside"),
        f8.autocast(recipe=RECIPE),
    ):
        f8.activation_checkpoint(graphed, torch.randn(8, 32, requires_grad=True))
