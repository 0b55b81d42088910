"""docs/semantics.md section 6: FP8 state in state_dict, weights_only loading, resizing, bit-exact
resume."""

from __future__ import annotations

import copy
import io
import json
import warnings

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, recipe_from_dict
from fp8kit.torch.state import resize_history
from tests.torch.module_kinds import FP8_MODULE_KINDS

RECIPE = DelayedScaling(amax_history_len=8, margin=1, amax_compute_algo="most_recent")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(f8.Linear(32, 64), torch.nn.GELU(), f8.Linear(64, 16))


def _steps(model: torch.nn.Module, n: int, seed: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(n):
        x = torch.randn(24, 32, generator=gen) * 4
        with f8.autocast(recipe=RECIPE):
            y = model(x)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    return outs


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_keys_shapes_and_weights_only_load() -> None:
    model = _model()
    _steps(model, 2, seed=1)
    sd = model.state_dict()
    assert sd["0.fp8_meta.forward.amax_history"].shape == (8, 3)
    assert sd["0.fp8_meta.forward.scale"].shape == (3,)
    assert sd["0.fp8_meta.forward.update_count"].dtype == torch.int64
    assert sd["2.fp8_meta.backward.amax_history"].shape == (8, 2)
    assert "0.fp8_meta.forward.scale_inv" not in sd  # derived, recomputed on load
    loaded = _roundtrip(sd)
    extra = loaded["0.fp8_meta.forward._extra_state"]
    json.dumps(extra)  # plain JSON-compatible data
    assert recipe_from_dict(extra["recipe"]) == RECIPE


def test_saved_fp8_state_is_contiguous_and_holds_only_its_own_values() -> None:
    """The states of both layers share one pool, whose ``(L, N)`` history they view column-wise.
    A state dict holds contiguous copies of exactly their size (broadcasts of a state dict and
    safetensors need contiguous tensors; a view would save the whole pool), equal to the
    buffers; ``keep_vars=True`` still gives the buffers themselves."""
    model = _model()
    _steps(model, 2, seed=1)
    sd = model.state_dict()
    pooled = model[0].fp8_meta.forward.amax_history
    assert not pooled.is_contiguous()  # the premise: a column view of the shared pool
    for name, live in model.state_dict(keep_vars=True).items():
        if "fp8_meta" not in name or not isinstance(live, torch.Tensor):
            continue
        saved = sd[name]
        assert saved.is_contiguous(), name
        assert saved.untyped_storage().nbytes() == saved.numel() * saved.element_size(), name
        assert torch.equal(saved, live), name
        assert saved.data_ptr() != live.data_ptr(), name
    assert model.state_dict(keep_vars=True)["0.fp8_meta.forward.amax_history"] is pooled
    fresh = _model(seed=5)
    fresh.load_state_dict(_roundtrip(sd))
    for name, value in fresh.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, sd[name]), name


def test_resume_in_a_fresh_model_is_bit_identical() -> None:
    a = _model(seed=0)
    _steps(a, 3, seed=2)
    with torch.no_grad(), f8.autocast(recipe=RECIPE):
        a(torch.randn(4, 32) * 100)  # leaves a non-zero staging row in the checkpoint
    b = _model(seed=123)  # different weights: everything must come from the checkpoint
    b.load_state_dict(_roundtrip(a.state_dict()))
    for name, t in a.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, b.state_dict()[name]), name
    assert torch.equal(
        b[0].fp8_meta.forward.scale_inv, torch.reciprocal(a[0].fp8_meta.forward.scale)
    )
    outs_a = _steps(a, 3, seed=3)
    outs_b = _steps(b, 3, seed=3)
    for ya, yb in zip(outs_a, outs_b, strict=True):
        assert torch.equal(ya, yb)
    for name, t in a.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, b.state_dict()[name]), name


def test_assign_load_into_a_meta_model_resumes_bit_identically() -> None:
    """``load_state_dict(sd, assign=True)`` into a model built on ``meta`` (how large models
    are loaded without a first allocation): the unsaved buffers follow the checkpoint's device,
    and training goes on exactly as the uninterrupted run."""
    a = _model(seed=0)
    _steps(a, 3, seed=2)
    sd = _roundtrip(a.state_dict())
    with torch.device("meta"):
        b = _model(seed=123)
    b.load_state_dict(sd, strict=True, assign=True)
    for state in (m for m in b.modules() if isinstance(m, f8.ScalingState)):
        assert {t.device.type for t in state.buffers()} == {"cpu"}
        assert not state.nonfinite_count.any()
    assert torch.equal(
        b[0].fp8_meta.forward.scale_inv, torch.reciprocal(a[0].fp8_meta.forward.scale)
    )
    for ya, yb in zip(_steps(a, 3, seed=3), _steps(b, 3, seed=3), strict=True):
        assert torch.equal(ya, yb)
    for name, t in a.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, b.state_dict()[name]), name


def test_loading_another_history_length_adopts_it_then_the_recipe_resizes() -> None:
    a = _model()
    _steps(a, 5, seed=4)
    b = _model()
    assert b[0].fp8_meta.forward.history_len == 1024
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # adopting the saved length loses nothing: no warning
        b.load_state_dict(a.state_dict())
    assert b[0].fp8_meta.forward.history_len == 8
    saved = a[0].fp8_meta.forward.amax_history.clone()
    shorter = DelayedScaling(amax_history_len=4)
    with (
        pytest.warns(UserWarning, match="from 8 to 4 entries.*oldest entries are dropped"),
        f8.autocast(recipe=shorter),
    ):
        b(torch.zeros(1, 32))  # a training call binds (an evaluation would not, decision 0267)
        assert torch.equal(b[0].fp8_meta.forward.amax_history[1:], saved[5:])  # before the event


def test_resize_history_keeps_newest_and_pads_older_side() -> None:
    h = torch.arange(15, dtype=torch.float32).reshape(5, 3)  # row 0 = staging
    small = resize_history(h, 3)
    assert small.tolist() == [[0, 1, 2], [9, 10, 11], [12, 13, 14]]
    big = resize_history(h, 7)
    assert big.tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 0], *h[1:].tolist()]
    assert resize_history(h, 1).tolist() == [[0, 1, 2]]
    assert resize_history(h, 5) is h


@pytest.mark.parametrize("strict", [True, False])
def test_unknown_extra_state_is_rejected_by_key(strict: bool) -> None:
    """As torch reports a bad tensor: by its key, after the whole load, also under strict=False."""
    model = _model()
    sd = model.state_dict()
    sd["0.fp8_meta.forward._extra_state"] = {"version": 99}
    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict(sd, strict=strict)
    message = str(raised.value)
    assert "While loading 0.fp8_meta.forward._extra_state:" in message
    assert "unsupported ScalingState extra state {'version': 99}" in message
    assert "expected a dict with version 1" in message
    with pytest.raises(ValueError, match="unsupported ScalingState extra state"):
        model[0].fp8_meta.forward.set_extra_state({"version": 99})


def test_state_moves_with_the_module_and_survives_reset_parameters() -> None:
    layer = f8.Linear(16, 16, dtype=torch.float64)
    layer.to(torch.float32)
    assert layer.fp8_meta.forward.scale.dtype == torch.float32  # FP8 meta stays float32
    layer = f8.Linear(16, 16, device="meta")
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert layer.fp8_meta.forward.scale.tolist() == [1.0, 1.0, 1.0]
    assert layer.fp8_meta.forward.amax_history.abs().sum().item() == 0


def _plain_and_converted() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(3)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    torch.manual_seed(4)
    converted = f8.convert_model(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    )
    return plain, converted


def _train_step(model: torch.nn.Module, features: int) -> None:
    with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        model(torch.randn(4, features) * 3).sum().backward()
    with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        model(torch.randn(4, features) * 3).sum().backward()  # scales have moved off 1


def _fresh(meta: f8.FP8Meta) -> bool:
    return all(
        not s.amax_history.any() and s.scale.eq(1).all() and s.scale_inv.eq(1).all()
        and not s.update_count.any()
        for s in (meta.forward, meta.backward)
    )  # fmt: skip


def test_converted_model_loads_a_plain_state_dict_strictly(caplog) -> None:
    """The FP8 state a plain checkpoint lacks becomes fresh state (the old one was measured on
    other weights), said in one INFO line naming how many FP8 modules; every other missing
    key still fails a strict load."""
    plain, converted = _plain_and_converted()
    _train_step(converted, 16)
    assert not _fresh(converted[0].fp8_meta)
    with caplog.at_level("INFO", logger="fp8kit"):
        result = converted.load_state_dict(plain.state_dict(), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for a, b in zip(plain.parameters(), converted.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _fresh(converted[0].fp8_meta) and _fresh(converted[2].fp8_meta)
    assert converted[0].fp8_meta.forward.history_len == 4  # shape and recipe are kept
    assert converted[0].fp8_meta.forward.recipe_data is not None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "fp8kit: the loaded state_dict has no FP8 state for 2 FP8 module(s) (0.fp8_meta, "
        "2.fp8_meta): they start fresh (amax history 0, scale 1)"
    ]
    bad = dict(plain.state_dict())
    del bad["0.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.weight"\.'):
        converted.load_state_dict(bad, strict=True)


def test_a_partial_fp8_state_still_fails_a_strict_load() -> None:
    _, converted = _plain_and_converted()
    sd = converted.state_dict()
    del sd["2.fp8_meta.backward.scale"]
    with pytest.raises(
        RuntimeError, match=r'Missing key\(s\) in state_dict: "2.fp8_meta.backward.scale"\.'
    ):
        converted.load_state_dict(sd, strict=True)


def test_a_non_strict_load_leaves_modules_it_does_not_hold_alone() -> None:
    """strict=False with only some modules' weights (a partial checkpoint): the FP8 state of a
    module whose weights were not loaded either stays as it was."""
    plain, converted = _plain_and_converted()
    _train_step(converted, 16)
    head = {
        k: v.clone()
        for k, v in converted[2].fp8_meta.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    first_layer_only = {k: v for k, v in plain.state_dict().items() if k.startswith("0.")}
    result = converted.load_state_dict(first_layer_only, strict=False)
    assert result.missing_keys == ["2.weight", "2.bias"]
    assert _fresh(converted[0].fp8_meta)
    assert not _fresh(converted[2].fp8_meta)
    for key, value in head.items():
        assert torch.equal(converted[2].fp8_meta.state_dict()[key], value), key


def _fp8_tensors(meta: f8.FP8Meta) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in meta.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("strict", [True, False])
def test_set_model_state_dict_of_a_full_checkpoint_loads_like_load_state_dict(
    strict: bool,
) -> None:
    """torch.distributed.checkpoint's ``set_model_state_dict(full_state_dict=True)`` (how a full
    or rank-0 checkpoint reaches an FSDP2 model) fills every key the checkpoint lacks with the
    model's own value, and an extra state with a placeholder object. A plain checkpoint then
    loads as with ``load_state_dict``: FP8 state fresh where new weights arrived, kept where the
    weights were only filled in."""
    dcp = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    full = dcp.StateDictOptions(full_state_dict=True, strict=strict)
    plain, converted = _plain_and_converted()
    _train_step(converted, 16)
    dcp.set_model_state_dict(converted, plain.state_dict(), options=full)
    for a, b in zip(plain.parameters(), converted.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _fresh(converted[0].fp8_meta) and _fresh(converted[2].fp8_meta)
    assert converted[0].fp8_meta.forward.history_len == 4  # shape and recipe are kept
    assert converted[0].fp8_meta.forward.recipe_data is not None

    _train_step(converted, 16)  # a checkpoint of the first layer only
    head, head_weight = _fp8_tensors(converted[2].fp8_meta), converted[2].weight.clone()
    first_layer_only = {k: v for k, v in plain.state_dict().items() if k.startswith("0.")}
    partial = dcp.StateDictOptions(full_state_dict=True, strict=False)
    dcp.set_model_state_dict(converted, first_layer_only, options=partial)
    assert _fresh(converted[0].fp8_meta)
    assert torch.equal(converted[2].weight, head_weight)
    for key, value in _fp8_tensors(converted[2].fp8_meta).items():
        assert torch.equal(value, head[key]), key

    _, trained = _plain_and_converted()  # a checkpoint with FP8 state loads it all
    _train_step(trained, 16)
    dcp.set_model_state_dict(converted, dcp.get_model_state_dict(trained), options=full)
    for a, b in zip(converted.state_dict().values(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_without_a_summary_each_fp8_module_says_it_starts_fresh(caplog) -> None:
    """A model built from f8 modules directly (no convert_model) logs one line per module."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(f8.Linear(8, 8), f8.LayerNormMLP(8, 16))
    plain = {k: v for k, v in model.state_dict().items() if "fp8_meta" not in k}
    with caplog.at_level("INFO", logger="fp8kit"):
        model.load_state_dict(plain, strict=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"fp8kit: the loaded state_dict has no FP8 state for {m}.fp8_meta: it starts fresh "
        "(amax history 0, scale 1)"
        for m in ("0", "1")
    ]
    caplog.clear()
    f8.checkpoint.summarize_fresh_fp8_state(model)
    with caplog.at_level("INFO", logger="fp8kit"):
        model.load_state_dict(plain, strict=True)
        model.load_state_dict(model.state_dict(), strict=True)  # complete: nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "fp8kit: the loaded state_dict has no FP8 state for 2 FP8 module(s) (0.fp8_meta, "
        "1.fp8_meta): they start fresh (amax history 0, scale 1)"
    ]
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Module"):
        f8.checkpoint.summarize_fresh_fp8_state("model")  # type: ignore[arg-type]


def test_stock_attention_and_encoder_checkpoints_go_both_ways() -> None:
    """A stock nn.TransformerEncoderLayer's state_dict loads strictly into its converted copy,
    and plain_state_dict of the converted (trained) copy loads strictly into a stock layer."""
    torch.manual_seed(5)
    make = lambda: torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)  # noqa: E731
    stock, converted = make(), f8.convert_model(make())
    converted.load_state_dict(stock.state_dict(), strict=True)
    x = torch.randn(5, 2, 16)
    torch.testing.assert_close(converted(x), stock(x), rtol=1e-5, atol=1e-5)
    with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
        converted(x).sum().backward()
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(0.01)
    stock.load_state_dict(f8.plain_state_dict(converted), strict=True)
    for (name, a), b in zip(stock.named_parameters(), converted.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not any("_extra_state" in k or "fp8_meta" in k for k in f8.plain_state_dict(converted))


def test_plain_state_dict_loads_into_the_unconverted_model() -> None:
    plain, converted = _plain_and_converted()
    _train_step(converted, 16)
    sd = f8.plain_state_dict(converted)
    assert sorted(sd) == sorted(plain.state_dict())
    plain.load_state_dict(sd, strict=True)
    for a, b in zip(plain.parameters(), converted.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        f8.plain_state_dict({"a": 1})  # type: ignore[arg-type]


def test_partly_missing_fp8_state_still_fails_a_strict_load() -> None:
    """Only a module with no FP8 state at all starts fresh: a checkpoint that lost part of it
    (one history, say) is damaged, and a strict load says so."""
    _, converted = _plain_and_converted()
    sd = dict(converted.state_dict())
    del sd["0.fp8_meta.forward.amax_history"]
    with pytest.raises(RuntimeError, match=r"0\.fp8_meta\.forward\.amax_history"):
        converted.load_state_dict(sd, strict=True)


def _whole_module_copies(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``copy.deepcopy`` and a ``torch.save(module)`` / ``torch.load`` round trip."""
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return [copy.deepcopy(module), torch.load(buf, weights_only=False)]


@pytest.mark.parametrize("kind", list(FP8_MODULE_KINDS))
def test_a_trained_module_copies_and_pickles_whole_under_a_lambda_recipe(kind: str) -> None:
    """The module's per-run cache (the recipe, with its lambda) is not part of a copy: deepcopy
    and ``torch.save(module)`` work after a step, and the copies train on bit-identically."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.amax(0))
    torch.manual_seed(0)
    module = FP8_MODULE_KINDS[kind]()

    def step(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=recipe):
            y = m(x, x, x)[0] if kind == "MultiheadAttention" else m(x)
        y.square().sum().backward()
        return y.detach()

    x = torch.randn(4, 2, 16) * 3
    step(module, x)
    module.compile(backend="eager")  # nn.Module leaves the compiled call out of its copies
    copies = _whole_module_copies(module)
    expected = step(module, x * 2)
    for c in copies:
        assert torch.equal(step(c, x * 2), expected)
        for name, t in module.state_dict().items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, c.state_dict()[name]), name


@pytest.mark.parametrize("converted", [True, False], ids=["convert_model", "f8.Linear"])
def test_assign_load_of_a_plain_checkpoint_into_a_meta_model_gives_fresh_state(converted) -> None:
    """The low-memory pattern (build on ``meta``, ``load_state_dict(assign=True)``) with a
    checkpoint without FP8 state: the FP8 state starts fresh on the weights' device (it stayed
    on ``meta`` and the first FP8 call failed)."""
    plain = nn.Sequential(nn.Linear(32, 8))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 8)) if converted else nn.Sequential(f8.Linear(32, 8))
    if converted:
        f8.convert_model(model)
    model.load_state_dict(plain.state_dict(), assign=True)
    state = model[0].fp8_meta.forward
    assert state.amax_history.device.type == "cpu" and state.scale.tolist() == [1.0] * 3
    assert not state.amax_history.any()
    x = torch.randn(4, 32)
    with f8.autocast(recipe=RECIPE):
        y = model(x)
    y.sum().backward()
    assert state.update_count.tolist() == [1, 1, 0]


def test_per_rank_state_dict_helpers_check_their_arguments() -> None:
    """rank=True used to give keys '...rankTrue'; swapped arguments failed inside with "'Linear'
    object is not iterable"; a model without FP8 state gave the dict back unchanged."""
    model = f8.Linear(4, 4)
    sd = model.state_dict()
    for bad, error in ((True, TypeError), ("0", TypeError), (1.0, TypeError), (-1, ValueError)):
        with pytest.raises(error, match=r"^rank must be None \(this process's rank\) or an"):
            f8.per_rank_fp8_state_dict(sd, model, rank=bad)
    for helper in (f8.per_rank_fp8_state_dict, f8.from_per_rank_fp8_state_dict):
        with pytest.raises(TypeError, match=r"^state_dict must be a mapping .*got Linear"):
            helper(model, sd)
        with pytest.raises(TypeError, match=r"^model must be a torch\.nn\.Module, got OrderedDict"):
            helper(sd, sd)
    with pytest.raises(ValueError, match=r"^model \(a Linear\) has no FP8 state"):
        f8.per_rank_fp8_state_dict(nn.Linear(4, 4).state_dict(), nn.Linear(4, 4))
    keyed = f8.per_rank_fp8_state_dict(sd, model, rank=3)
    assert "fp8_meta.forward.scale.rank3" in keyed
    assert f8.from_per_rank_fp8_state_dict(keyed, model, rank=3).keys() == sd.keys()


def test_init_fp8_state_sizes_every_module() -> None:
    """Kills C02 (checkpoint.py `init_fp8_state` binds only the first FP8 module). Every state
    gets the recipe's history length and records it (needed before a DCP load)."""
    model = torch.nn.Sequential(f8.Linear(16, 16), torch.nn.ReLU(), f8.LayerNormMLP(16, 32))
    recipe = DelayedScaling(amax_history_len=7)
    f8.init_fp8_state(model, recipe)
    metas = [m for m in model.modules() if isinstance(m, f8.FP8Meta)]
    assert len(metas) == 2
    for meta in metas:
        for state in (meta.forward, meta.backward):
            assert state.amax_history.shape[0] == 7
            assert state.recipe_data == recipe.to_dict()


def test_resizing_a_state_that_only_staged_does_not_warn() -> None:
    """Kills B08 (buffers.py `is_pristine` counting the staging row). A state that has only
    recorded (a no_grad forward under another history length) loses nothing when resized, so
    binding it to the training recipe must not warn (SPEC 6 warns only when entries are dropped
    or padded)."""
    layer = f8.Linear(16, 16)
    with torch.no_grad(), f8.autocast(recipe=DelayedScaling(amax_history_len=8)):
        layer(torch.randn(2, 16))
    assert layer.fp8_meta.forward.amax_history[0].any()  # staged, not rolled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
            y = layer(torch.randn(2, 16))
    y.sum().backward()
    assert layer.fp8_meta.forward.amax_history.shape[0] == 4


@pytest.mark.parametrize("sized", [True, False])
def test_an_ema_copy_made_before_the_first_step_needs_sized_states(sized: bool) -> None:
    """docs/te_modules.md, "Copies, EMA and stateless calls": AveragedModel copies the model's
    buffers at each update; with the states sized by init_fp8_state before the copy, the copy's
    FP8 state follows the model's, and the weights average. Unsized, torch's copy fails."""
    recipe = DelayedScaling(amax_history_len=16)
    model = _model()
    if sized:
        f8.init_fp8_state(model, recipe)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with f8.autocast(recipe=recipe):
        loss = model(torch.randn(4, 32)).square().mean()
    loss.backward()
    opt.step()
    if not sized:
        with pytest.raises(RuntimeError, match=r"size of tensor a \(1024\) must match"):
            ema.update_parameters(model)
        return
    ema.update_parameters(model)  # the first update copies the parameters and buffers
    assert torch.equal(ema.module[0].weight, model[0].weight)
    assert not torch.equal(ema.module[0].weight, before)
    for key, value in model.state_dict().items():
        if "fp8_meta" in key and isinstance(value, torch.Tensor):
            assert torch.equal(ema.module.state_dict()[key], value), key
    assert model[0].fp8_meta.forward.update_count.tolist() == [1, 1, 0]


@pytest.mark.parametrize("assign", [False, True])
def test_a_load_in_swap_mode_trains_on_like_the_checkpointed_model(assign: bool) -> None:
    """Under torch.__future__.set_swap_module_params_on_conversion(True), load_state_dict with
    assign=True swaps the buffers' contents in place (torch.utils.swap_tensors): the state
    objects stay, no longer views of their pool. The next step must still equal the
    checkpointed model's (a review found the pool kept the old values)."""
    recipe = DelayedScaling(amax_history_len=4)
    trained, other = _model(0), _model(1)
    for seed, model in ((0, other), (1, trained), (2, trained)):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))
        with f8.autocast(recipe=recipe):
            model(x).sum().backward()
    with f8.autocast(recipe=recipe):
        other(torch.randn(4, 32)).sum().backward()  # pooled, with values of its own
    reference = copy.deepcopy(trained)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        other.load_state_dict(trained.state_dict(), assign=assign)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    x = torch.randn(4, 32) * 3
    for model in (other, reference):
        with f8.autocast(recipe=recipe):
            model(x).sum().backward()
    want = {k: v for k, v in reference.state_dict().items() if isinstance(v, torch.Tensor)}
    got = other.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
