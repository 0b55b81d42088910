"""States of one recipe live side by side in one pool; modules see views of it."""

from __future__ import annotations

import copy
import gc
import io
import random
import threading
import warnings
import weakref

import numpy as np
import pytest
import torch

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import distributed
from fp8kit.torch.state import ScalingState, registry_for, update_states
from fp8kit.torch.state.apply import GPU_CHECK_INTERVAL, NonfiniteAmaxWarning
from fp8kit.torch.state.pool import StatePool
from tests.reference import update_reference

RECIPE = DelayedScaling(amax_history_len=4, margin=3)  # a registry of its own in this module


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    with f8.autocast(recipe=RECIPE):
        y = model(x)
    y.sum().backward()


def test_states_view_one_pool_and_match_the_reference() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(f8.Linear(8, 8), f8.Linear(8, 8), f8.Linear(8, 8))
    states = [layer.fp8_meta.forward for layer in model]
    zeros, ones = np.zeros((4, 3), np.float32), np.ones(3, np.float32)
    expected = [(zeros, ones, np.zeros(3, np.int64)) for _ in states]
    for step in range(4):
        ac = f8.autocast(recipe=RECIPE)
        ac.__enter__()
        y = model(torch.randn(4, 8) * (step + 1))
        for i, s in enumerate(states):
            h, sc, c = expected[i]
            h = h.copy()
            h[0] = s.amax_history[0].numpy()  # what this step staged
            expected[i] = update_reference(h, sc, c, RECIPE, 448.0)
        ac.__exit__(None, None, None)
        y.sum().backward()
        for s, (h, sc, c) in zip(states, expected, strict=True):
            assert (s.amax_history.numpy() == h).all()
            assert (s.scale.numpy() == sc).all()
            assert (s.update_count.numpy() == c).all()
            assert torch.equal(s.scale_inv, torch.reciprocal(s.scale))
    storages = {s.amax_history.untyped_storage().data_ptr() for s in states}
    assert len(storages) == 1  # one pool
    assert not states[0].amax_history.is_contiguous()  # a column slice of the pool


def test_model_dtype_casts_leave_fp8_meta_in_float32() -> None:
    layer = f8.Linear(8, 8)
    _step(layer, torch.randn(4, 8) * 3)
    scale = layer.fp8_meta.forward.scale.clone()
    history = layer.fp8_meta.forward.amax_history.clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_meta.forward.scale.dtype == torch.float32
    assert torch.equal(layer.fp8_meta.forward.scale, scale)
    assert torch.equal(layer.fp8_meta.forward.amax_history, history)
    assert layer.fp8_meta.forward.update_count.dtype == torch.int64
    _step(layer, torch.randn(4, 8, dtype=torch.bfloat16))  # the pool is rebuilt and keeps going
    assert layer.fp8_meta.forward.update_count[0].item() == 2


def test_deepcopy_gives_an_independent_state() -> None:
    layer = f8.Linear(8, 8)
    _step(layer, torch.randn(4, 8))
    twin = copy.deepcopy(layer)
    assert torch.equal(twin.fp8_meta.forward.scale, layer.fp8_meta.forward.scale)
    _step(twin, torch.randn(4, 8) * 100)
    assert layer.fp8_meta.forward.update_count[0].item() == 1
    assert twin.fp8_meta.forward.update_count[0].item() == 2
    assert not torch.equal(twin.fp8_meta.forward.scale, layer.fp8_meta.forward.scale)
    _step(layer, torch.randn(4, 8))
    assert layer.fp8_meta.forward.update_count[0].item() == 2


def test_a_dead_module_leaves_the_pool() -> None:
    keep = f8.Linear(8, 8)
    gone = f8.Linear(8, 8)
    _step(torch.nn.Sequential(keep, gone), torch.randn(4, 8))
    del gone
    gc.collect()
    _step(keep, torch.randn(4, 8))
    registry = registry_for(RECIPE, None, "forward", torch.device("cpu"))
    assert registry.states() == [keep.fp8_meta.forward]
    assert keep.fp8_meta.forward.update_count[0].item() == 2


def test_repeated_event_fast_path_notices_membership_changes() -> None:
    """Repeated events skip registration when the same states ran (keyed by their ids); any
    membership change in between (a state left, died, or an id was reused by a new state) must
    send the next event through registration again."""
    recipe = DelayedScaling(amax_history_len=3, margin=7)  # a registry of its own
    states = [ScalingState(3, history_len=3), ScalingState(3, history_len=3)]
    for step in range(2):  # the second event takes the fast path
        for s in states:
            s.record_amax(0, torch.tensor(2.0))
        update_states(states, recipe, 448.0, direction="forward")
        assert [s.update_count[0].item() for s in states] == [step + 1] * 2
    registry = registry_for(recipe, None, "forward", torch.device("cpu"))
    registry.discard(states[0])  # e.g. it ran under another recipe in between
    for s in states:
        s.record_amax(0, torch.tensor(2.0))
    update_states(states, recipe, 448.0, direction="forward")
    assert {id(s) for s in registry.states()} == {id(s) for s in states}  # re-registered
    assert [s.update_count[0].item() for s in states] == [3, 3]


def test_a_new_model_after_a_dead_one_is_updated() -> None:
    """Repeated events take a fast path keyed by the states' ids; a new model built where a dead
    one was (CPython reuses ids) must still join the pool and update. The recipe keeps the
    modules' default history length, so no buffer is resized on the way."""
    recipe = DelayedScaling(margin=5)  # a registry of its own; amax_history_len = the default
    for _ in range(3):
        model = torch.nn.Sequential(f8.Linear(8, 8), f8.Linear(8, 8))
        for step in range(2):
            with f8.autocast(recipe=recipe):
                y = model(torch.randn(4, 8))
            y.sum().backward()
            assert [m.fp8_meta.forward.update_count[0].item() for m in model] == [step + 1] * 2
        del model
        gc.collect()


def test_slot_masks_hold_the_chosen_members_columns() -> None:
    """A masked event's mask and column indices (made from host values, cached per set)."""
    states = [ScalingState(n, history_len=4) for n in (3, 2, 3)]
    pool = StatePool()
    pool.sync(states)
    mask = pool.slot_mask([states[2], states[0]])
    assert mask.dtype == torch.bool and mask.tolist() == [True] * 3 + [False] * 2 + [True] * 3
    assert pool.columns_of(mask).tolist() == [0, 1, 2, 5, 6, 7]
    assert pool.slot_mask([states[0], states[2]]) is mask  # cached per set, in any order
    assert pool.columns_of(pool.slot_mask([states[1]])).tolist() == [3, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_masked_events_never_sync() -> None:
    """Experts chosen at random each step (a new mask pattern most steps) and an inf amax: the
    steady steps make no host synchronisation (masks go through pinned memory; the non-finite
    watch copies its counts asynchronously into one pinned buffer every GPU_CHECK_INTERVAL
    events, a buffer first made in a calibration pass under inference_mode here), and the
    warning still comes within about two intervals of forward events."""
    torch.manual_seed(0)
    experts = [f8.Linear(64, 64, device="cuda") for _ in range(6)]
    recipe = DelayedScaling(amax_history_len=4)
    rng = random.Random(0)

    def step(i: int, chosen: list[int]) -> None:
        x = torch.randn(32, 64, device="cuda")
        if i == 4:
            x[0, 0].fill_(float("inf"))  # item assignment copies a host scalar: a sync
        with f8.autocast(recipe=recipe):
            loss = sum(experts[e](x).sum() for e in chosen)
        loss.backward()  # type: ignore[union-attr]

    step(0, list(range(6)))  # every expert registers, binds the recipe, compiles its kernels
    step(1, [0, 1])
    # calibration under inference_mode: the watch's first look (its pinned buffer) falls here
    with torch.inference_mode():
        for _ in range(GPU_CHECK_INTERVAL):
            with f8.autocast(enabled=False, calibrating=True, recipe=recipe):
                for expert in experts:
                    expert(torch.randn(32, 64, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NonfiniteAmaxWarning)
            for i in range(2, 6 + 2 * GPU_CHECK_INTERVAL + 2):
                step(i, rng.sample(range(6), 3))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    counts = torch.cat([e.fp8_meta.forward.nonfinite_count for e in experts]).cpu()
    assert int(counts.sum()) > 0  # the inf reached the histories of the experts that ran
    assert any(issubclass(w.category, NonfiniteAmaxWarning) for w in caught)


def test_state_constructors_name_a_bad_size() -> None:
    """FP8Meta(num_gemms=-1) and friends used to fail inside torch.zeros, naming no argument;
    zero slots or a zero-length history were accepted."""
    cases = [
        (lambda: f8.FP8Meta(num_gemms=-1), ValueError, r"^num_gemms must be an int >= 1, got -1"),
        (lambda: f8.FP8Meta(num_gemms="2"), TypeError, r"^num_gemms must be an int >= 1, got '2'"),
        (lambda: f8.FP8Meta(num_gemms=True), TypeError, r"^num_gemms must be an int >= 1"),
        (lambda: f8.FP8Meta(history_len=0), ValueError, r"^history_len must be an int >= 1"),
        (lambda: ScalingState(0), ValueError, r"^num_slots must be an int >= 1, got 0"),
        (lambda: ScalingState(2, history_len=2.0), TypeError, r"^history_len must be an int"),
    ]
    for make, error, message in cases:
        with pytest.raises(error, match=message):
            make()


class _Group:
    """Stands in for a process group object (they take weak references)."""


def test_a_registry_holds_the_process_group_it_verified_over_weakly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A verified layout remembers its group weakly: a group kept alive after
    ``destroy_process_group()`` is freed by gloo's threads at interpreter exit, which aborted
    about one run in fifteen (ADR 0265)."""
    checks: list[object] = []
    monkeypatch.setattr(distributed, "check_layout", lambda *args: checks.append(args[1]))
    monkeypatch.setattr(distributed, "collective_device", lambda group, device: device)
    recipe = DelayedScaling(amax_history_len=2)
    state = ScalingState(3, history_len=2)
    registry = registry_for(recipe, None, "forward", torch.device("cpu"), partition=7)
    registry.register(state)
    group = _Group()
    registry._verify([state], torch.device("cpu"), group)
    assert registry._verified_pg() is group
    alive = weakref.ref(group)
    del group
    gc.collect()
    assert alive() is None and registry._verified_pg() is None


def test_an_event_while_another_thread_runs_one_of_the_same_registry_is_refused() -> None:
    """Two threads training with equal recipes share one registry and pool: one thread's event
    rebuilt the pool under the other's, which crashed with a shape error or silently changed
    the numbers. A second thread entering an event now raises, naming the limit."""
    recipe = f8.DelayedScaling(amax_history_len=2)
    model = f8.Linear(8, 8)
    x = torch.randn(4, 8)
    with f8.autocast(recipe=recipe):  # the first event creates the forward registry
        model(x)
    registry = registry_for(recipe, None, "forward", torch.device("cpu"))
    entered, leave = threading.Event(), threading.Event()

    def event_in_progress() -> None:
        with registry._in_event:  # as another thread's run_event holds it
            entered.set()
            leave.wait(10)

    other = threading.Thread(target=event_in_progress)
    other.start()
    try:
        assert entered.wait(10)
        refused = pytest.raises(RuntimeError, match="several threads of one process")
        with refused, f8.autocast(recipe=recipe):
            model(x)
    finally:
        leave.set()
        other.join()
    with f8.autocast(recipe=recipe):  # alone again: events run
        model(x)


def test_a_member_reloaded_with_another_history_length_keeps_updating() -> None:
    """Kills PO1 (pool.py `_intact` no longer checks that each member still views its columns).
    A module that already trained (a pool member) loads FP8 state with another L into its own
    fp8_meta: same registry, same members, new buffers. The next event must rebuild the pool and
    update the module's state (SPEC 3 worked rule; SPEC 6: resized, newest entries kept)."""
    recipe = DelayedScaling(amax_history_len=4)
    layer = f8.Linear(16, 16)

    def step(amax: float) -> None:
        with f8.autocast(recipe=recipe):
            y = layer(torch.full((2, 16), amax))
        y.sum().backward()

    step(1.0)
    step(2.0)
    other = f8.Linear(16, 16)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=6)):
        other(torch.ones(2, 16)).sum().backward()  # history [0, 0, 0, 0, 0, 1], count 1
    meta_sd = {k[len("fp8_meta.") :]: v for k, v in other.state_dict().items() if "fp8_meta." in k}
    layer.fp8_meta.load_state_dict(meta_sd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resize from 6 to 4 warns
        step(3.0)
    fwd = layer.fp8_meta.forward
    assert fwd.amax_history[:, f8.FwdSlot.INPUT].tolist() == [0.0, 0.0, 1.0, 3.0]
    assert fwd.update_count.tolist() == [2, 2, 0]
    assert fwd.scale[f8.FwdSlot.INPUT].item() == torch.tensor(448.0 / 3.0).item()


def _functional_steps(
    model: torch.nn.Module, xs: list[torch.Tensor], buffers: dict[str, torch.Tensor] | str
) -> None:
    """Train ``model`` through ``torch.func.functional_call`` with clones of its parameters
    (fast weights) and ``buffers``: ``""`` none, ``"now"`` the module's buffer tensors taken at
    each call, ``"aliases"`` detached views of them, ``"once"`` its buffer tensors taken before
    the first call (which pooling replaces), or a dict. The gradients are copied back."""
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    once = dict(model.named_buffers())
    for x in xs:
        if isinstance(buffers, dict):
            passed = buffers
        elif buffers == "now":
            passed = dict(model.named_buffers())
        elif buffers == "aliases":
            passed = {k: v.detach() for k, v in model.named_buffers()}
        else:
            passed = once if buffers == "once" else {}
        with f8.autocast(recipe=RECIPE):
            y = torch.func.functional_call(model, {**params, **passed}, (x,))
        y.square().sum().backward()
    for name, param in model.named_parameters():
        param.grad = params[name].grad


def _fp8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict().items()
    return {k: v.clone() for k, v in state if "fp8_meta" in k and isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("sized", [False, True])
@pytest.mark.parametrize("buffers", ["", "now", "aliases", "once"])
def test_functional_call_with_parameters_or_own_buffers_trains_the_module_state(
    buffers: str, sized: bool
) -> None:
    """Stateless calls whose FP8 state buffers are the module's own: not passed, passed as its
    tensors of the moment or views of them, or as tensors it held earlier (before its first
    call's resize, or its pooling: functional_call puts those back, decision 0269). The module's
    state is used and updated: the same histories, scales and gradients as ordinary calls, and
    the module's buffers read afterwards are its current ones."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(f8.Linear(16, 8), torch.nn.ReLU(), f8.Linear(8, 4))
    stateless = copy.deepcopy(plain)
    xs = [torch.randn(4, 16) * s for s in (1.0, 3.0, 0.5)]
    for x in xs:
        with f8.autocast(recipe=RECIPE):
            y = plain(x)
        y.square().sum().backward()
    if sized:
        f8.init_fp8_state(stateless, RECIPE)
    _functional_steps(stateless, xs, buffers)
    expected, got = _fp8_state(plain), _fp8_state(stateless)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert expected["0.fp8_meta.forward.update_count"].tolist() == [3, 3, 0]
    assert stateless[0].fp8_meta.forward.update_count.tolist() == [3, 3, 0]
    for a, b in zip(plain.parameters(), stateless.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("first", [True, False])
def test_functional_call_with_other_fp8_buffers_is_refused(first: bool) -> None:
    """Tensors that are not the module's own (clones) in place of its FP8 state buffers: the
    update event at the autocast exit works on the module's own state, so the amaxes cast into
    them would be lost. Refused at the first cast, naming the state, on the first call or after
    training; the module then trains normally (as a copy that never saw the call)."""
    torch.manual_seed(0)
    model = f8.Linear(16, 8)
    if not first:
        _step(model, torch.randn(4, 16))
    untouched = copy.deepcopy(model)
    clones = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises(RuntimeError, match=r"Linear\(16, 8\)\.forward were replaced from"):
        _functional_steps(model, [torch.randn(4, 16)], clones)
    x = torch.randn(4, 16)
    for m in (model, untouched):
        _step(m, x)
    expected, got = _fp8_state(untouched), _fp8_state(model)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


class _CastsItself(torch.nn.Module):
    """A wrapper that enters f8.autocast inside its forward."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=RECIPE):
            return self.inner(x)


@pytest.mark.parametrize("then", ["state_dict", "float", "deepcopy", "pickle", "reset"])
def test_functional_call_of_a_module_entering_autocast_itself_keeps_its_state(then: str) -> None:
    """The module's first update event runs inside functional_call, which then puts the
    buffers it was given (the module's, from before the event) back: the state trains as with
    ordinary calls, and what reads the state as a whole (state_dict, .float(), a deepcopy, a
    pickle, reset_parameters) takes the module's current state, not those tensors (a review
    found .float(), reset and copies took the older ones). Direct reads of the buffers right
    after such a call show the older tensors until the next call (docs/te_modules.md)."""
    torch.manual_seed(0)
    plain = _CastsItself(torch.nn.Sequential(f8.Linear(16, 8), torch.nn.ReLU(), f8.Linear(8, 4)))
    stateless = copy.deepcopy(plain)
    f8.init_fp8_state(plain, RECIPE)
    f8.init_fp8_state(stateless, RECIPE)
    for step in range(3):
        x = torch.randn(4, 16) * (1 + step)
        plain(x).square().sum().backward()
        buffers = {**dict(stateless.named_parameters()), **dict(stateless.named_buffers())}
        torch.func.functional_call(stateless, buffers, (x,)).square().sum().backward()
    if then == "float":
        stateless.float()
    elif then == "deepcopy":
        stateless = copy.deepcopy(stateless)
    elif then == "pickle":
        buffer = io.BytesIO()
        torch.save(stateless, buffer)
        buffer.seek(0)
        stateless = torch.load(buffer, weights_only=False)
    elif then == "reset":
        for module in (plain.inner[0], stateless.inner[0]):
            module.reset_parameters()
    if then != "state_dict":
        got = stateless.inner[0].fp8_meta.forward
        want = plain.inner[0].fp8_meta.forward
        for name in ("amax_history", "scale", "update_count"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    expected, got = _fp8_state(plain), _fp8_state(stateless)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    count = got["inner.0.fp8_meta.forward.update_count"].tolist()
    assert count == ([0, 0, 0] if then == "reset" else [3, 3, 0])
