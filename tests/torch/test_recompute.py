"""``f8.activation_checkpoint`` (docs/semantics.md section 11): a checkpointed region gives the
outputs, gradients and scaling state of the same region run without checkpointing, bit for bit,
while the scales change from step to step."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling
from fp8kit.torch.autocast import current_settings, replaying
from fp8kit.torch.recompute import ForwardCasts, Replay, captures, note_cast
from fp8kit.torch.slot_ops import quantize_traced, record_traced

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "delayed-first-step-current": DelayedScaling(amax_history_len=3, first_step_scaling="current"),
    "delayed-margin-interval-pow2": DelayedScaling(
        amax_history_len=2, margin=1, interval=2, amax_compute_algo="most_recent"
    ),
    "current": Float8CurrentScaling(),
}


def _model(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        f8.LayerNormLinear(32, 64),
        torch.nn.GELU(),
        f8.Linear(64, 32),
        f8.LayerNormMLP(32, 48),
    )


def _inputs(step: int) -> torch.Tensor:
    """Inputs whose amax changes every step, so every update event changes the scales."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 32, generator=g) * (1 + 3 * step)
    x[0, 0] = 0.0
    x[1, 1] = 1e-40  # a float32 subnormal
    return x


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State and gradients by name (names as in ``state_dict``, which drops the prefix of
    PyTorch's checkpoint wrapper)."""
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    grads = {
        f"{k.replace('_checkpoint_wrapped_module.', '')}.grad": p.grad
        for k, p in model.named_parameters()
        if p.grad is not None
    }
    return {**state, **grads}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _train(
    step_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    steps: int = 3,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = _model()
    grads = []
    for step in range(steps):
        x = _inputs(step).requires_grad_()
        y = step_fn(model, x)
        (y * y).sum().backward()
        grads.append(x.grad)
    return grads, _tensors(model)


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_checkpointed_region_trains_bit_for_bit_like_the_plain_one(name: str) -> None:
    recipe = RECIPES[name]

    def plain(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=recipe):
            return model(x)

    def checkpointed(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=recipe):
            return f8.activation_checkpoint(model, x)

    plain_grads, plain_state = _train(plain)
    ckpt_grads, ckpt_state = _train(checkpointed)
    for a, b in zip(plain_grads, ckpt_grads, strict=True):
        assert torch.equal(a, b)
    _assert_same(plain_state, ckpt_state)


def test_a_transformer_layer_with_dropout_trains_bit_for_bit_checkpointed() -> None:
    """Attention, both MLP GEMMs and dropout (its RNG state is restored for the recomputation)."""
    recipe = RECIPES["delayed"]

    def train(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(3)
        layer = f8.TransformerLayer(32, 64, 4, hidden_dropout=0.1, attention_dropout=0.1)
        out = {}
        for step in range(3):
            torch.manual_seed(10 + step)
            x = (torch.randn(8, 2, 32) * (1 + step)).requires_grad_()
            with f8.autocast(recipe=recipe):
                y = f8.activation_checkpoint(layer, x) if checkpointed else layer(x)
            (y * y).sum().backward()
            out[f"x.grad.{step}"] = x.grad
        return {**out, **_tensors(layer)}

    _assert_same(train(False), train(True))


def test_microbatches_with_a_cached_fp8_weight_train_bit_for_bit_checkpointed() -> None:
    """``is_first_microbatch``: the first microbatch casts (and caches) the weight, the others
    reuse it; a recomputation recasts it with the forward's scale, so the cache keeps its bits."""
    recipe = RECIPES["delayed"]

    def train(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(3)
        layer = f8.Linear(32, 32)
        out = {}
        for step in range(3):
            for micro in range(2):
                x = (_inputs(2 * step + micro) * (1 + micro)).requires_grad_()
                first = micro == 0
                with f8.autocast(recipe=recipe):
                    if checkpointed:
                        y = f8.activation_checkpoint(layer, x, is_first_microbatch=first)
                    else:
                        y = layer(x, is_first_microbatch=first)
                (y * y).sum().backward()
                out[f"x.grad.{step}.{micro}"] = x.grad
        return {**out, **_tensors(layer)}

    _assert_same(train(False), train(True))


def test_an_autocast_inside_the_checkpointed_function_is_replayed_too() -> None:
    recipe = RECIPES["delayed"]

    def region(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=recipe):
            return model(x)

    plain = _train(region)
    ckpt = _train(lambda model, x: f8.activation_checkpoint(region, model, x))
    for a, b in zip(plain[0], ckpt[0], strict=True):
        assert torch.equal(a, b)
    _assert_same(plain[1], ckpt[1])


def test_nested_checkpoints_replay_the_outer_forward_scales() -> None:
    recipe = RECIPES["delayed"]

    def plain(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=recipe):
            return model[3](model[2](model[1](model[0](x))))

    def nested(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        def inner(h: torch.Tensor) -> torch.Tensor:
            return model[2](model[1](h))

        def outer(h: torch.Tensor) -> torch.Tensor:
            return model[3](f8.activation_checkpoint(inner, model[0](h)))

        with f8.autocast(recipe=recipe):
            return f8.activation_checkpoint(outer, x)

    a, b = _train(plain), _train(nested)
    for ga, gb in zip(a[0], b[0], strict=True):
        assert torch.equal(ga, gb)
    _assert_same(a[1], b[1])


def test_the_recomputation_records_no_amax_and_runs_no_event() -> None:
    model = _model()
    recipe = RECIPES["delayed"]
    for step in range(2):  # the second step's forward runs with scales from the first event
        with f8.autocast(recipe=recipe):
            y = f8.activation_checkpoint(model, _inputs(step).requires_grad_())
        forward = {
            name: t.clone()
            for name, t in model.state_dict().items()
            if ".fp8_meta.forward." in name and isinstance(t, torch.Tensor)
        }
        # The backward runs inside another autocast body: it must not join that body's event.
        with f8.autocast(recipe=recipe):
            y.sum().backward()
        after = model.state_dict()
        for name, before in forward.items():
            assert torch.equal(after[name], before), name


def test_a_second_backward_through_a_retained_graph_recomputes_the_same() -> None:
    recipe = RECIPES["delayed"]
    results = []
    for checkpointed in (False, True):
        model = _model()
        x = _inputs(0).requires_grad_()
        with f8.autocast(recipe=recipe):  # one step first, so the scales are not all 1
            model(x).sum().backward()
        x.grad = None
        with f8.autocast(recipe=recipe):
            y = f8.activation_checkpoint(model, x) if checkpointed else model(x)
        loss = (y * y).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        results.append((x.grad, _tensors(model)))
    assert torch.equal(results[0][0], results[1][0])
    _assert_same(results[0][1], results[1][1])


def test_a_region_run_without_fp8_is_recomputed_without_fp8() -> None:
    model = _model()
    x = _inputs(1).requires_grad_()
    ref = _model()
    x_ref = x.detach().clone().requires_grad_()
    y = f8.activation_checkpoint(model, x)  # no autocast: plain PyTorch
    with f8.autocast(recipe=RECIPES["delayed"]):  # backward inside an FP8 body: still plain
        y.sum().backward()
    ref(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert all(int(t.abs().sum()) == 0 for n, t in model.state_dict().items() if "amax" in n)


def test_a_high_precision_step_after_fp8_steps_recomputes_without_a_warning() -> None:
    """The warning about plain ``torch.utils.checkpoint`` is not for f8.activation_checkpoint:
    a step without FP8 after FP8 steps (a module that has run in FP8) recomputes quietly."""
    model = _model()
    x = _inputs(1).requires_grad_()
    with f8.autocast(recipe=RECIPES["delayed"]):
        y = f8.activation_checkpoint(model, x)
    y.sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f8.activation_checkpoint(model, x).sum().backward()
        with f8.autocast(enabled=False):
            f8.activation_checkpoint(model, x).sum().backward()


def test_calibration_is_recomputed_without_recording_again() -> None:
    recipe = RECIPES["delayed"]

    def step(checkpoint: bool) -> dict[str, Any]:
        model = _model()
        x = _inputs(2).requires_grad_()
        with f8.autocast(enabled=False, calibrating=True, recipe=recipe):
            y = f8.activation_checkpoint(model, x) if checkpoint else model(x)
        y.sum().backward()
        return {"x.grad": x.grad, **_tensors(model)}

    _assert_same(step(False), step(True))


def test_use_reentrant_true_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="use_reentrant must be False, got True"):
        f8.activation_checkpoint(torch.nn.Identity(), torch.ones(1), use_reentrant=True)


def test_te_checkpoint_keywords_are_taken_not_passed_on() -> None:
    """te.checkpoint's tensor-parallel keywords: a TE call runs unchanged (they never reach the
    function), and the values fp8kit cannot honour are refused by name."""
    seen: list[dict[str, Any]] = []

    def function(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs)
        return x * x  # saves x: the backward recomputes

    x = torch.ones(2, requires_grad=True)
    y = f8.activation_checkpoint(
        function, x, distribute_saved_activations=False, get_rng_state_tracker=None, tp_group=None
    )
    y.sum().backward()
    assert seen == [{}, {}] and torch.equal(x.grad, torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="distribute_saved_activations must be False"):
        f8.activation_checkpoint(function, x, distribute_saved_activations=True)
    with pytest.raises(ValueError, match="get_rng_state_tracker must be None"):
        f8.activation_checkpoint(function, x, get_rng_state_tracker=object)


def test_keywords_torch_checkpoint_takes_itself_still_reach_the_function() -> None:
    """``early_stop``, ``debug`` and ``context_fn`` are parameters of torch's checkpoint: given
    to activation_checkpoint for the function, the first was silently taken by torch (the
    function ran with its default), the others raised errors about torch's options."""
    seen: list[dict[str, Any]] = []

    def function(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs)
        return x * x

    given = {"early_stop": "passed", "debug": True, "context_fn": "mine", "scale": 2}
    x = torch.ones(2, requires_grad=True)
    f8.activation_checkpoint(function, x, **given).sum().backward()
    assert seen == [given, given]  # the forward and its recomputation
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_a_recomputation_that_casts_other_modules_is_named() -> None:
    first, other = f8.Linear(16, 16), f8.Linear(16, 16)
    calls = []

    def changing(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (first if len(calls) == 1 else other)(x)  # the recomputation takes another path

    x = torch.randn(4, 16, requires_grad=True)
    with f8.autocast(recipe=RECIPES["delayed"]):
        y = f8.activation_checkpoint(changing, x, determinism_check="none")
    with pytest.raises(RuntimeError, match="activation_checkpoint: the recomputation casts"):
        y.sum().backward()


def test_a_checkpoint_entered_during_a_replay_keeps_what_the_replay_read() -> None:
    """Whichever checkpoint frame PyTorch later recomputes from, a capture made while a replay
    runs holds the replayed (forward-time) scales, not the live ones."""
    recipe = RECIPES["delayed"]
    layer = f8.Linear(16, 16)
    x = torch.randn(4, 16)
    with f8.autocast(recipe=recipe):
        settings = current_settings()
    forward = ForwardCasts()
    captures.append(forward)
    try:
        note_cast(layer.fp8_meta.forward, first_step=False)
    finally:
        captures.remove(forward)
    kept = forward.by_state[id(layer.fp8_meta.forward)][0]
    layer.fp8_meta.forward.scale.fill_(2.0)  # the live scale moves on after the forward
    nested = ForwardCasts()
    replay = Replay(forward)
    captures.append(nested)
    try:
        with replaying(settings, replay):
            q = replay.quantize(x, settings.plan, layer.fp8_meta.forward, 0, False)  # type: ignore[union-attr]
    finally:
        captures.remove(nested)
    assert nested.by_state[id(layer.fp8_meta.forward)] == [kept]
    assert torch.equal(q.scale_inv, torch.tensor(1.0))  # the kept scale 1, not the live 2


def test_compiled_fp8_casts_inside_a_checkpoint_are_refused() -> None:
    """A compiled module's casts are custom ops that read the live scales: inside a checkpointed
    forward or its recomputation they raise instead of recomputing other FP8 values."""
    layer = f8.Linear(16, 16)
    x = torch.randn(4, 16)
    with f8.autocast(recipe=RECIPES["delayed"]):
        event_key = current_settings().event_key  # type: ignore[union-attr]
    forward = ForwardCasts()
    captures.append(forward)
    try:
        with pytest.raises(RuntimeError, match="compile'd FP8 module ran inside"):
            quantize_traced(layer.fp8_meta, event_key, x, 0, False, False, False, False, True)
        with pytest.raises(RuntimeError, match="compile'd FP8 module ran inside"):
            record_traced(layer.fp8_meta, event_key, x, 0, False)
    finally:
        captures.remove(forward)
    with (
        replaying(None, Replay(forward)),
        pytest.raises(RuntimeError, match="compile'd FP8 module ran inside"),
    ):
        quantize_traced(layer.fp8_meta, event_key, x, 0, False, False, False, False, True)
    # Outside any checkpoint the op runs (the compiled path's own tests cover its numbers).
    q, _ = quantize_traced(layer.fp8_meta, event_key, x, 0, False, False, False, False, True)
    assert q.data.dtype == torch.float8_e4m3fn


def test_a_plain_reentrant_checkpoint_of_fp8_modules_warns() -> None:
    """torch.utils.checkpoint(use_reentrant=True) recomputes after the autocast exited, in high
    precision: the modules say so, naming activation_checkpoint."""
    layer = f8.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # never in FP8 yet, or outside backward: no warning
        torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True).sum().backward()
        with f8.autocast(recipe=RECIPES["delayed"]):
            layer(x).sum().backward()
        layer(x).sum().backward()  # high precision after FP8 steps, outside backward
    with f8.autocast(recipe=RECIPES["delayed"]):
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
    with pytest.warns(UserWarning, match="high precision.*f8.activation_checkpoint"):
        y.sum().backward()


def test_an_fp8_evaluation_in_a_backward_hook_is_not_a_recomputation() -> None:
    """A backward hook that runs another FP8 model under no_grad (a probe, an EMA evaluation)
    runs inside the backward pass but recomputes nothing: no refusal (a review found one)."""
    probe, model = f8.Linear(16, 16), f8.Linear(16, 16)
    seen = []

    def hook(module: torch.nn.Module, grad_in: Any, grad_out: Any) -> None:
        with torch.no_grad(), f8.autocast(recipe=RECIPES["delayed"]):
            seen.append(probe(grad_out[0]))

    model.register_full_backward_hook(hook)
    x = torch.randn(4, 16, requires_grad=True)
    with f8.autocast(recipe=RECIPES["delayed"]):
        y = model(x)
    y.sum().backward()
    assert len(seen) == 1 and seen[0].shape == (4, 16)


class _SelfCasting(torch.nn.Module):
    """A block that enters f8.autocast itself, around an FP8 module."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=RECIPES["delayed"]):
            return self.mlp(x)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("where", ["autocast in the function", "backward in an autocast"])
def test_a_plain_checkpoint_recomputing_under_an_autocast_is_refused(
    where: str, reentrant: bool
) -> None:
    """torch.utils.checkpoint recomputing FP8 modules while an f8.autocast is active (one the
    checkpointed function enters, or one around the backward call) would cast with the scales
    the forward update event changed and record the amaxes again, silently (gradients 1e6 off
    in the audit): refused at the first module of the recomputation. (f8.activation_checkpoint
    replays such a block exactly: test_an_autocast_inside_the_checkpointed_function_...)"""
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=reentrant)
    block = _SelfCasting()
    x = _inputs(0).requires_grad_()
    refused = r"LayerNormLinear ran an FP8 forward under f8\.autocast"
    with pytest.raises(RuntimeError, match=refused):
        if where == "autocast in the function":
            y = checkpoint(block, x)
            (y * y).sum().backward()
        else:
            with f8.autocast(recipe=RECIPES["delayed"]):
                y = checkpoint(block.mlp, x)
            with f8.autocast(recipe=RECIPES["delayed"]):
                (y * y).sum().backward()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_pytorch_checkpoint_wrapper_takes_it_as_its_checkpoint_fn() -> None:
    """FSDP users wrap blocks with ``apply_activation_checkpointing``; ``checkpoint_fn`` routes
    the wrapper through activation_checkpoint."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    recipe = RECIPES["delayed"]

    def plain(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=recipe):
            return model(x)

    wrapped: list[torch.nn.Module] = []

    def wrapped_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not wrapped:
            apply_activation_checkpointing(
                model,
                checkpoint_wrapper_fn=functools.partial(
                    checkpoint_wrapper, checkpoint_fn=f8.activation_checkpoint
                ),
                check_fn=lambda m: isinstance(m, (f8.Linear, f8.LayerNormMLP)),
            )
            wrapped.append(model)
        with f8.autocast(recipe=recipe):
            return model(x)

    a, b = _train(plain), _train(wrapped_step)
    for ga, gb in zip(a[0], b[0], strict=True):
        assert torch.equal(ga, gb)
    _assert_same(a[1], b[1])  # the wrapper's state_dict keys are the plain model's
