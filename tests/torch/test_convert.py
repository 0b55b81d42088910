"""f8.convert_model: swaps nn.Linear in place, keeps the parameters, honours the filter."""

from __future__ import annotations

import functools
from copy import deepcopy

import pytest
import torch
import torch.nn.utils.prune
from torch import nn

import fp8kit.torch as f8
from fp8kit.formats import E4M3
from fp8kit.recipe import DelayedScaling
from tests.reference import fp8_round

_NOT_A_DTYPE = (
    r"^{name} must be a torch\.dtype \(torch\.float32, torch\.bfloat16 or torch\.float16\) "
    r"or None, got"
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # out_proj: a Linear subclass
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.fc2(self.act(self.fc1(x)))


class Fp8LinearReference(nn.Module):
    """float64 model of an f8.Linear's first forward under the default recipe: both operands
    rounded to E4M3 at scale 1 (docs/semantics.md section 2), the GEMM and the bias in float64."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = fp8_round(x.detach().double().numpy(), E4M3)
        wq = fp8_round(self.linear.weight.detach().double().numpy(), E4M3)
        y = xq @ wq.T
        if self.linear.bias is not None:
            y = y + self.linear.bias.detach().double().numpy()
        return torch.from_numpy(y).to(x.dtype)


def _with_fp8_references(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose plain nn.Linear modules are :class:`Fp8LinearReference`."""
    copy = deepcopy(model)
    for name, module in list(copy.named_modules()):
        if type(module) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            setattr(copy.get_submodule(parent_name), child, Fp8LinearReference(module))
    return copy


def test_converts_every_plain_linear_and_keeps_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Sequential(nn.Linear(16, 8)))
    reference = _with_fp8_references(model)
    params_before = {name: p for name, p in model.named_parameters()}
    x = torch.randn(2, 5, 16)
    y_before = model(x)
    # The attention is kept out here (its FP8 path is tests/torch/test_attention.py's subject),
    # so the float64 reference below holds only Linear layers.
    assert f8.convert_model(model, keep_high_precision="*.attn") is model
    assert type(model[0].fc1) is f8.Linear and type(model[0].fc2) is f8.Linear
    assert type(model[1][0]) is f8.Linear
    assert model[0].fc2.bias is None
    assert type(model[0].attn) is nn.MultiheadAttention
    assert type(model[0].attn.out_proj) is not f8.Linear  # subclass with its own use: left alone
    for name, p in model.named_parameters():
        assert p is params_before[name], name  # same objects: optimizers stay valid
    torch.testing.assert_close(model(x), y_before, rtol=0, atol=0)  # high precision outside
    with f8.autocast():
        y_fp8 = model(x)
    assert not torch.equal(y_fp8, y_before)
    # Every converted layer ran in FP8 (and the attention's out_proj did not): the same model
    # with float64 FP8 references in their place. Only float32 rounding separates the two
    # (~1e-7 relative, a K-term sum erring by at most (K-1) 2^-24 of sum |terms|, K <= 32), while
    # one layer left in high precision moves the output by ~2^-4 / sqrt(K) ~ 1e-2: bound 1e-5.
    with torch.no_grad():
        y_ref = reference(x)
    assert ((y_fp8 - y_ref).norm() / y_ref.norm()).item() < 1e-5
    assert model[0].fc1.fp8_meta.forward.amax_history[-1, 0].item() > 0  # rolled in


def test_module_filter_and_bare_linear() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    seen = []

    def only_first(module: nn.Module, fqn: str) -> bool:
        seen.append(fqn)
        return fqn == "0"

    f8.convert_model(model, module_filter=only_first)
    assert seen == ["0", "1"]
    assert type(model[0]) is f8.Linear and type(model[1]) is nn.Linear
    bare = nn.Linear(4, 2, dtype=torch.bfloat16)
    converted = f8.convert_model(bare)
    assert type(converted) is f8.Linear and converted.weight is bare.weight
    assert converted.weight.dtype == torch.bfloat16
    assert converted.fp8_meta.forward.scale.dtype == torch.float32


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        f8.convert_model("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module_filter must be None or a callable"):
        f8.convert_model(nn.Linear(2, 2), module_filter=3)  # type: ignore[arg-type]


def test_module_filter_must_answer_with_a_bool() -> None:
    with pytest.raises(TypeError, match="module_filter must return a bool, got 'no' for '0'"):
        f8.convert_model(nn.Sequential(nn.Linear(4, 4)), module_filter=lambda m, fqn: "no")


@pytest.mark.parametrize("make", [lambda: nn.Linear(8, 8), lambda: nn.MultiheadAttention(8, 2)])
def test_hooks_and_attributes_of_a_converted_module_carry_over(make) -> None:
    """Hooks (forward, pre-forward, full backward, load-state-dict post, where the FP8 module
    holds a hook of its own) and extra attributes set on the module that is replaced keep
    working on its FP8 module; their handles still remove them. The replaced module keeps its
    hooks, apart: one registered on the FP8 module later does not fire on it."""
    module = make()
    calls: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda m, args: calls.append("pre")),
        module.register_forward_hook(lambda m, args, out: calls.append("forward")),
        module.register_full_backward_hook(lambda m, gin, gout: calls.append("backward")),
        module.register_load_state_dict_post_hook(lambda m, keys: calls.append("load")),
    ]
    module.my_tag = "kept"
    model = f8.convert_model(nn.Sequential(module))
    fp8 = model[0]
    assert fp8 is not module and isinstance(fp8, (f8.Linear, f8.MultiheadAttention))
    assert fp8.my_tag == "kept"
    x = torch.randn(3, 8, requires_grad=True)

    def step() -> None:
        with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
            out = fp8(x) if isinstance(fp8, f8.Linear) else fp8(x, x, x)[0]
        out.sum().backward()

    step()
    fp8.load_state_dict(fp8.state_dict())
    assert calls == ["pre", "forward", "backward", "load"]
    fp8.register_forward_hook(lambda m, args, out: calls.append("fp8 only"))
    calls.clear()
    module(x) if isinstance(module, nn.Linear) else module(x, x, x)
    assert calls == ["pre", "forward"]  # the replaced module, with its own hooks only
    for handle in handles:
        handle.remove()
    calls.clear()
    step()
    fp8.load_state_dict(fp8.state_dict())
    assert calls == ["fp8 only"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.lm_head = nn.Linear(16, 40)
        self.classifier = nn.Linear(16, 3)


def test_convert_logs_what_it_converted_and_what_it_left(caplog) -> None:
    model = Net()
    with caplog.at_level("INFO", logger="fp8kit"):
        f8.convert_model(model, keep_high_precision=["lm_head", "*.missing"])
    text = "\n".join(r.getMessage() for r in caplog.records)
    # the attention (with its out_proj) is converted as a whole: its out_proj is not "left"
    assert "converted 4 module(s) to FP8: block.attn, block.fc1, block.fc2, classifier" in text
    assert "in high precision: lm_head (keep_high_precision pattern 'lm_head')" in text
    assert "pattern(s) ['*.missing'] matched no module" in text
    assert type(model.lm_head) is nn.Linear and isinstance(model.classifier, f8.Linear)
    assert isinstance(model.block.attn, f8.MultiheadAttention)
    assert model.block.fc1.fp8_meta.forward.label == "block.fc1.forward"
    with caplog.at_level("INFO", logger="fp8kit"):
        caplog.clear()
        f8.convert_model(model)  # a second pass converts nothing and says why
    assert "block.fc1 (already an f8.Linear)" in "\n".join(r.getMessage() for r in caplog.records)


def test_a_call_that_converts_nothing_warns_why(caplog) -> None:
    """A float64 model (or one whose every Linear is filtered out) comes back unchanged: that is
    a WARNING naming the modules and reasons, not an INFO line a default setup hides. A second
    pass over a converted model, which has nothing left to do, stays quiet."""
    with caplog.at_level("WARNING", logger="fp8kit"):
        f8.convert_model(nn.Sequential(nn.Linear(8, 8)).double())
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "converted no module; left 1 Linear-like" in text
    assert "0 (weight dtype torch.float64: FP8 GEMMs take float32" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fp8kit"):
        f8.convert_model(nn.Sequential(nn.Linear(8, 8)), module_filter=lambda m, fqn: False)
    assert "converted no module" in "\n".join(r.getMessage() for r in caplog.records)
    model = f8.convert_model(nn.Sequential(nn.Linear(8, 8)))
    caplog.clear()
    with caplog.at_level("WARNING", logger="fp8kit"):
        f8.convert_model(model)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("patterns", [["*head", "classifier"], "*head"])
def test_keep_high_precision_takes_fnmatch_patterns(patterns) -> None:
    model = f8.convert_model(Net(), keep_high_precision=patterns)
    assert type(model.lm_head) is nn.Linear
    assert isinstance(model.classifier, f8.Linear) == (patterns == "*head")


@pytest.mark.parametrize("bad", [3, ["lm_head", 3], {"lm_head": 1}.values()])
def test_bad_keep_high_precision_names_the_parameter(bad) -> None:
    with pytest.raises(TypeError, match="keep_high_precision must be None, a module-name pattern"):
        f8.convert_model(Net(), keep_high_precision=bad)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: f8.Linear(16, 8, **kw),
        lambda **kw: f8.LayerNormLinear(16, 8, **kw),
        lambda **kw: f8.LayerNormMLP(16, 32, **kw),
        lambda **kw: f8.TransformerLayer(16, 32, 2, **kw),
    ],
    ids=["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"],
)
def test_params_dtype_is_te_spelling_of_dtype(make) -> None:
    module = make(params_dtype=torch.bfloat16)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    same = make(dtype=torch.bfloat16, params_dtype=torch.bfloat16)
    assert {p.dtype for p in same.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match=r"dtype=torch\.float32 and params_dtype=torch\.bfloat16"):
        make(dtype=torch.float32, params_dtype=torch.bfloat16)
    for name in ("params_dtype", "dtype"):  # a string, as in a config file, is not a dtype
        with pytest.raises(TypeError, match=_NOT_A_DTYPE.format(name=name)):
            make(**{name: "bfloat16"})
    for name in ("params_dtype", "dtype"):  # parameters that could never require gradients
        for bad in (torch.int32, torch.float8_e4m3fn):
            with pytest.raises(TypeError, match=rf"^{name} must be a floating-point torch\.dtype"):
                make(**{name: bad})


def test_linear_subclasses_are_left_and_said_so(caplog) -> None:
    model = nn.Sequential(nn.modules.linear.NonDynamicallyQuantizableLinear(4, 4), nn.Linear(4, 4))
    with caplog.at_level("INFO", logger="fp8kit"):
        f8.convert_model(model)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "0 (a NonDynamicallyQuantizableLinear, not exactly torch.nn.Linear" in text
    assert type(model[0]) is nn.modules.linear.NonDynamicallyQuantizableLinear


def test_a_bare_attention_is_converted_like_a_bare_linear(caplog) -> None:
    stock = nn.MultiheadAttention(16, 2, kdim=8, vdim=12)
    with caplog.at_level("INFO", logger="fp8kit"):
        converted = f8.convert_model(stock)
    assert type(converted) is f8.MultiheadAttention
    assert converted.q_proj_weight is stock.q_proj_weight
    assert converted.out_proj is stock.out_proj
    assert "converted the model itself (an nn.MultiheadAttention)" in caplog.text
    kept = f8.convert_model(nn.MultiheadAttention(16, 2), keep_high_precision="")
    assert type(kept) is nn.MultiheadAttention


def test_a_shared_module_stays_one_fp8_module(caplog) -> None:
    """A Linear reached by two paths (also twice in one parent) becomes one f8.Linear, so its
    FP8 state sees every use; a shared parent is walked once per path without double work, and
    the log counts modules, not paths."""
    shared = nn.Linear(8, 8)
    inner = nn.Sequential(shared, nn.ReLU())
    model = nn.Sequential(inner, inner, shared)
    model.add_module("alias", shared)
    with caplog.at_level("INFO", logger="fp8kit"):
        f8.convert_model(model)
    assert "converted 1 module(s) to FP8, reached by 4 paths: 0.0, 1.0, 2, alias" in caplog.text
    fp8 = model[2]
    assert isinstance(fp8, f8.Linear) and fp8.weight is shared.weight
    assert model[0][0] is fp8 and model[1][0] is fp8 and model.alias is fp8


def test_weights_fp8_gemms_cannot_take_are_left_and_said_so(caplog) -> None:
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Linear(4, 4))
    with caplog.at_level("INFO", logger="fp8kit"):
        f8.convert_model(model)
    assert type(model[0]) is nn.Linear and isinstance(model[1], f8.Linear)
    assert (
        "0 (weight dtype torch.float64: FP8 GEMMs take float32, bfloat16 or float16 operands)"
        in caplog.text
    )


def test_keep_high_precision_takes_any_collection_of_patterns() -> None:
    model = f8.convert_model(Net(), keep_high_precision={"lm_head", "classifier"})
    assert type(model.lm_head) is nn.Linear and type(model.classifier) is nn.Linear
    with pytest.raises(TypeError, match=r"keep_high_precision must be None.*got b'lm_head'"):
        f8.convert_model(Net(), keep_high_precision=b"lm_head")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "hooked",
    [
        lambda m: nn.utils.prune.l1_unstructured(m, "weight", 0.5),
        lambda m: nn.utils.spectral_norm(m),
        lambda m: setattr(m, "forward", functools.partial(nn.Linear.forward, m)),
    ],
    ids=["pruned", "spectral-norm", "instance-forward"],
)
def test_a_linear_whose_forward_or_weight_is_rewired_is_left_and_said_so(hooked, caplog) -> None:
    """A Linear whose weight a hook computes (pruning, spectral norm) or whose ``forward`` is
    replaced on the instance (accelerate's hooks) would bypass that in FP8 (or fail to convert
    half-way): it is left in high precision with the reason, and the rest converts."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    hooked(model[1])
    with caplog.at_level("INFO", logger="fp8kit"):
        f8.convert_model(model)
    assert isinstance(model[0], f8.Linear)
    assert type(model[1]) is nn.Linear
    assert "left 1 Linear-like or attention module(s) in high precision: 1 (" in caplog.text
    with f8.autocast(recipe=DelayedScaling(amax_history_len=2)):
        model(torch.randn(4, 8)).sum().backward()


def test_parameters_buffers_and_submodules_registered_on_a_linear_carry_over() -> None:
    linear = nn.Linear(8, 8)
    linear.scale = nn.Parameter(torch.full((8,), 2.0))
    linear.register_buffer("ema", torch.arange(8.0))
    linear.register_buffer("scratch", torch.zeros(2), persistent=False)
    linear.adapter = nn.Linear(8, 2)
    model = f8.convert_model(nn.Sequential(linear))
    fp8 = model[0]
    assert isinstance(fp8, f8.Linear)
    assert fp8.scale is linear.scale and fp8.ema is linear.ema and fp8.adapter is linear.adapter
    assert isinstance(fp8.adapter, f8.Linear)  # a Linear inside is converted as any other
    keys = set(model.state_dict())
    assert {"0.scale", "0.ema", "0.adapter.weight"} <= keys and "0.scratch" not in keys
    assert any(p is linear.scale for p in model.parameters())


def test_a_shared_module_keeps_one_decision_over_all_its_paths() -> None:
    """keep_high_precision or module_filter on any path to a shared module keeps it: one module,
    in high precision (it was split into an FP8 and a plain module before)."""
    for kwargs in (
        {"keep_high_precision": "a"},
        {"keep_high_precision": "b"},
        {"module_filter": lambda module, fqn: fqn != "b"},
    ):
        shared = nn.Linear(8, 8)
        model = nn.ModuleDict({"a": shared, "b": shared})
        f8.convert_model(model, **kwargs)
        assert model["a"] is shared and model["b"] is shared, kwargs


def test_a_pattern_that_keeps_a_shared_module_by_its_second_path_is_not_unused(caplog) -> None:
    shared = nn.Linear(8, 8)
    with caplog.at_level("INFO", logger="fp8kit"):
        f8.convert_model(nn.ModuleDict({"a": shared, "b": shared}), keep_high_precision="b")
    assert "b (keep_high_precision pattern 'b')" in caplog.text
    assert "matched no module" not in caplog.text


def test_a_bare_module_left_in_high_precision_says_why(caplog) -> None:
    linear = nn.Linear(8, 8)
    linear.forward = functools.partial(nn.Linear.forward, linear)  # as accelerate's hooks do
    with caplog.at_level("INFO", logger="fp8kit"):
        assert f8.convert_model(linear) is linear
    assert "left the model itself (a Linear) in high precision (its forward is replaced" in (
        caplog.text
    )
