"""torch.compile(fullgraph=True): FP8 modules trace into one graph and train with eager's numbers.

The FP8 casts are ``torch.ops.fp8kit`` custom ops (docs/decisions/0233-torch-compile.md). The
``aot_eager`` backend runs AOTAutograd's functionalized graphs with the same kernels as eager, so
every number, buffer and gradient must match bit for bit; Inductor generates its own code for the
layers around the FP8 ops, so the Inductor test uses layers it reproduces exactly (ReLU).
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from fp8kit.torch import slot_ops

RECIPES: dict[str, Recipe] = {
    "delayed": DelayedScaling(amax_history_len=4),
    "first_step_current": DelayedScaling(amax_history_len=4, first_step_scaling="current"),
    "current": Float8CurrentScaling(),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    gc.collect()  # dead modules of earlier tests leave their pools now, not mid-test
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _zoo(dtype: torch.dtype) -> torch.nn.Module:
    """Every FP8 module kind (output and gradient FP8 slots included) in one model."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        f8.LayerNormLinear(32, 64),
        torch.nn.ReLU(),
        f8.LayerNormMLP(64, 128),
        f8.Linear(64, 16, fp8_output=True, fp8_grad=True),
    ).to(dtype)


def _assert_same_model(eager: torch.nn.Module, compiled: torch.nn.Module) -> None:
    """Every state_dict entry (FP8 state included) and every gradient equal bit for bit."""
    for (name, a), b in zip(
        eager.state_dict().items(), compiled.state_dict().values(), strict=True
    ):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and torch.equal(a, b), name
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name


def _train_side_by_side(
    make: Callable[[], torch.nn.Module],
    step: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    inputs: Callable[[torch.Generator], torch.Tensor],
    steps: int = 4,
    backend: str = "aot_eager",
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Run ``step`` on an eager model and a fullgraph-compiled copy; outputs must be equal."""
    eager, base = make(), make()
    compiled = torch.compile(base, fullgraph=True, backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, base)]
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = inputs(gen)
        outs = []
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            outs.append(step(model, x).detach())
        assert torch.equal(outs[0], outs[1]), f"step {i}: outputs differ"
        if i < steps - 1:
            for opt in opts:
                opt.step()
    _assert_same_model(eager, base)
    return eager, base


def _autocast_step(recipe: Recipe) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=recipe):
            y = model(x)
        y.float().square().mean().backward()
        return y

    return step


@pytest.mark.parametrize(
    ("recipe_name", "dtype"),
    [
        ("delayed", torch.float32),
        ("first_step_current", torch.bfloat16),
        ("current", torch.bfloat16),
    ],
    ids=["delayed-fp32", "first_step_current-bf16", "current-bf16"],
)
def test_fullgraph_module_zoo_matches_eager(recipe_name: str, dtype: torch.dtype) -> None:
    recipe = RECIPES[recipe_name]
    eager, _ = _train_side_by_side(
        lambda: _zoo(dtype),
        _autocast_step(recipe),
        lambda g: torch.randn(8, 32, generator=g).to(dtype),
    )
    if recipe_name != "current":
        assert eager[0].fp8_meta.forward.update_count.tolist() == [4, 4, 0]
        assert eager[0].fp8_meta.backward.update_count.tolist() == [4, 0]
    # The graph holds no FP8 buffer (the casts find the live state by uid), so the binding and
    # pooling at the first events cause no recompilation: one graph for every step.
    assert counters["stats"]["unique_graphs"] == 1


def test_graph_holds_the_fp8_casts_and_no_host_reads() -> None:
    """The compiled step is custom-op casts and GEMMs: 2 casts per Linear forward (x, W), 1 per
    backward (dY, which also gives the bias gradient), no ``.item()``-style host read."""
    graphs: dict[str, list[torch.fx.GraphModule]] = {"fw": [], "bw": []}

    def keep(kind: str) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
            graphs[kind].append(gm)
            return gm.forward

        return compiler

    def boxed(kind: str) -> Callable[..., Any]:
        inner = keep(kind)
        return lambda gm, inputs: make_boxed_func(inner(gm, inputs))

    backend = aot_autograd(fw_compiler=boxed("fw"), bw_compiler=boxed("bw"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(f8.Linear(32, 64), torch.nn.ReLU(), f8.Linear(64, 16))
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with f8.autocast(recipe=RECIPES["delayed"]):
        y = compiled(torch.randn(16, 32))
    y.sum().backward()

    def ops(kind: str) -> list[Any]:
        """Every op called by the graphs of ``kind``; a functionalized mutating op is its op."""
        found = []
        for gm in graphs[kind]:
            for node in gm.graph.nodes:
                if node.op != "call_function":
                    continue
                functionalized = node.target is torch.ops.higher_order.auto_functionalized_v2
                found.append(node.args[0] if functionalized else node.target)
        return found

    cast = torch.ops.fp8kit.quantize_slot.default
    fw, bw = ops("fw"), ops("bw")
    assert fw.count(cast) == 4 and bw.count(cast) == 2
    for op in fw + bw:
        assert "_local_scalar_dense" not in str(op) and "aten.item" not in str(op), op


def test_microbatches_reuse_the_cached_weight_as_in_eager() -> None:
    class TwoLinears(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = f8.Linear(32, 32), f8.Linear(32, 16)

        def forward(self, x: torch.Tensor, first: bool) -> torch.Tensor:
            return self.b(
                torch.relu(self.a(x, is_first_microbatch=first)), is_first_microbatch=first
            )

    recipe = RECIPES["delayed"]

    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for mb, xm in enumerate(x.chunk(3)):
            with f8.autocast(recipe=recipe):
                y = model(xm, mb == 0)
            y.square().mean().backward()
            outs.append(y)
        return torch.cat(outs)

    _train_side_by_side(TwoLinears, step, lambda g: torch.randn(24, 32, generator=g))


def test_no_grad_forwards_and_calibration_match_eager() -> None:
    recipe = RECIPES["delayed"]

    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), f8.autocast(enabled=False, calibrating=True, recipe=recipe):
            calibrated = model(x)
        with torch.no_grad(), f8.autocast(recipe=recipe):  # staging only, no event
            evaluated = model(x)
        with f8.autocast(recipe=recipe):
            y = model(x)
        y.square().mean().backward()
        return torch.cat([calibrated, evaluated, y])

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(f8.Linear(32, 64), torch.nn.ReLU(), f8.Linear(64, 16))

    _train_side_by_side(make, step, lambda g: torch.randn(8, 32, generator=g))


def test_an_evaluation_under_another_recipe_binds_nothing_as_in_eager() -> None:
    """Forward under A, a no_grad evaluation under B (another history length), then A's
    backward: the evaluation cannot update, so it binds neither state, compiled or eager
    (decision 0267). It used to resize the forward history to B's length and back, dropping
    the oldest entries on the evaluating rank only; no resize warning is given now."""
    a, b = DelayedScaling(amax_history_len=2), DelayedScaling(amax_history_len=8)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(8, 16, generator=gen) for _ in range(3)]

    def train(model: torch.nn.Module, compiled: bool) -> tuple[dict[str, Any], list[Any]]:
        call = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        for x in inputs:
            with f8.autocast(recipe=a):
                y = call(x)
            with torch.no_grad(), f8.autocast(recipe=b):
                call(x)
            y.square().mean().backward()
        meta = model.fp8_meta
        bound = [(s.history_len, s.recipe_data) for s in (meta.forward, meta.backward)]
        return copy.deepcopy(model.state_dict()), bound

    results = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fp8kit: resizing")
        for compiled in (False, True):
            torch.manual_seed(0)
            results.append(train(f8.Linear(16, 16), compiled))
    (eager_state, eager_bound), (compiled_state, compiled_bound) = results
    assert eager_bound == compiled_bound == [(2, a.to_dict()), (2, a.to_dict())]
    for name, value in eager_state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, compiled_state[name]), name


def test_a_training_call_after_an_evaluation_binds_as_in_eager() -> None:
    """Train under B, calibrate under A (same L, another margin: both states bound to A), a
    no_grad evaluation under B, then train under B: the training call must bind both states to
    B again. Eager returned the run cached by the evaluation, which had not bound, and the
    backward state kept recording A (the event does not rebind a state whose L is right)."""
    b, a = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=gen)

    def run(model: torch.nn.Module, compiled: bool) -> list[Any]:
        call = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        with f8.autocast(recipe=b):
            call(x).square().mean().backward()
        with torch.no_grad(), f8.autocast(enabled=False, calibrating=True, recipe=a):
            call(x)
        with torch.no_grad(), f8.autocast(recipe=b):
            call(x)
        for _ in range(2):
            with f8.autocast(recipe=b):
                call(x).square().mean().backward()
        meta = model.fp8_meta
        return [(s.history_len, s.recipe_data) for s in (meta.forward, meta.backward)]

    for compiled in (False, True):
        torch.manual_seed(0)
        assert run(f8.Linear(16, 16), compiled) == [(4, b.to_dict())] * 2, compiled


def test_training_after_a_load_records_the_training_recipe_as_in_eager() -> None:
    """A checkpoint saved under A (same L as B, another margin) loaded into a model that trains
    under B: the next training call binds, eager as compiled, so both record B. Eager kept the
    loaded A, its last binding being to B already."""
    b, a = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    saved = f8.Linear(16, 16)
    with f8.autocast(recipe=a):
        saved(x).square().mean().backward()
    for compiled in (False, True):
        torch.manual_seed(0)
        model = f8.Linear(16, 16)
        call = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        with f8.autocast(recipe=b):
            call(x).square().mean().backward()
        model.load_state_dict(saved.state_dict())
        with f8.autocast(recipe=b):
            call(x).square().mean().backward()
        recorded = [s.recipe_data for s in (model.fp8_meta.forward, model.fp8_meta.backward)]
        assert recorded == [b.to_dict()] * 2, compiled


def test_transformer_layer_matches_eager() -> None:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        # No dropout: compiled and eager draw different random masks.
        return f8.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)

    _train_side_by_side(
        make, _autocast_step(RECIPES["delayed"]), lambda g: torch.randn(4, 2, 32, generator=g), 3
    )


def test_a_deep_copy_quantizes_into_its_own_state() -> None:
    """Compiled graphs name states by uid: a copy must not record into the original."""
    torch.manual_seed(0)
    original = f8.Linear(32, 16)
    duplicate = copy.deepcopy(original)
    assert duplicate.fp8_meta.forward.uid != original.fp8_meta.forward.uid
    compiled = torch.compile(duplicate, fullgraph=True, backend="aot_eager")
    with f8.autocast(recipe=RECIPES["delayed"]):
        compiled(torch.randn(16, 32)).sum().backward()
    assert duplicate.fp8_meta.forward.update_count.tolist() == [1, 1, 0]
    assert original.fp8_meta.forward.update_count.tolist() == [0, 0, 0]
    assert not original.fp8_meta.forward.amax_history.any()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = f8.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


@pytest.mark.skipif(
    not slot_ops._UNSPECIALIZE_UIDS, reason="this torch cannot unspecialize the states' uids"
)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_blocks_compiled_one_by_one_share_their_graphs(backend: str) -> None:
    """Ten blocks each compiled on its own (block.compile, torchtitan's way) share the graphs a
    torch.nn.Linear stack would: 2, the second for the blocks whose input requires grad. The
    states' uids must be graph inputs, not constants: as constants every block recompiled, and
    the 9th hit Dynamo's recompile limit (a hard error under fullgraph=True). Two steps train
    bit for bit like eager, so each block's ops still find its own states."""

    def make() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[_Block() for _ in range(10)])

    eager, compiled = make(), make()
    for block in compiled:
        block.compile(fullgraph=True, backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled)]
    step = _autocast_step(RECIPES["delayed"])
    gen = torch.Generator().manual_seed(1)
    for i in range(2):
        x = torch.randn(8, 16, generator=gen)
        outs = []
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            outs.append(step(model, x).detach())
            opt.step()
        assert torch.equal(outs[0], outs[1]), f"step {i}: outputs differ"
    _assert_same_model(eager, compiled)
    assert eager[9].lin.fp8_meta.forward.update_count.tolist() == [2, 2, 0]
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]


def test_blocks_compiled_one_by_one_without_automatic_dynamic_compile_a_graph_each() -> None:
    """The documented cost of ``dynamic=False`` (README, docs/performance.md): it turns
    automatic dynamic off, so the uids stay constants and each block compiles its own graph
    (past 8 blocks, only a raised ``torch._dynamo.config.recompile_limit`` lets that finish)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(3)])
    for block in model:
        block.compile(fullgraph=True, backend="aot_eager", dynamic=False)
    with f8.autocast(recipe=RECIPES["delayed"]):
        y = model(torch.randn(8, 16, requires_grad=True))
    y.sum().backward()
    assert counters["stats"]["unique_graphs"] == 3, counters["stats"]


@pytest.mark.slow
def test_inductor_matches_eager_bit_for_bit() -> None:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(f8.Linear(32, 64), torch.nn.ReLU(), f8.Linear(64, 16))

    _train_side_by_side(
        make,
        _autocast_step(RECIPES["delayed"]),
        lambda g: torch.randn(8, 32, generator=g),
        backend="inductor",
    )


def test_gemms_above_the_small_gemm_size_with_a_float32_bias_match_eager() -> None:
    """128 x 128 x 128 GEMMs (above SMALL_GEMM_MACS: upcast, torch.mm, then the epilogue adds
    the float32 bias), aligned and not: the compiled epilogue runs out of place, since torch
    2.11's compiler gave an autograd.Function output changed in place a zero gradient
    (decision 0249). Every gradient and FP8 state entry equals eager's."""

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(f8.Linear(128, 128), torch.nn.ReLU(), f8.Linear(128, 120))

    eager, _ = _train_side_by_side(
        make, _autocast_step(RECIPES["delayed"]), lambda g: torch.randn(128, 128, generator=g), 2
    )
    assert eager[0].weight.grad.abs().max() > 0
    assert eager[2].fp8_meta.backward.update_count.tolist() == [2, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_compiled_modes_match_eager(mode: str) -> None:
    """On a GPU: Inductor (and its CUDA graphs, which keep the enrolling casts outside) trains a
    bfloat16 Linear/ReLU model bit for bit like eager."""

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(f8.Linear(256, 512), torch.nn.ReLU(), f8.Linear(512, 256)).to(
            "cuda", torch.bfloat16
        )

    eager, base = make(), make()
    compiled = torch.compile(base, fullgraph=True, mode=mode)
    recipe = RECIPES["delayed"]
    gen = torch.Generator("cuda").manual_seed(1)
    for _ in range(4):
        x = torch.randn(128, 256, device="cuda", generator=gen).to(torch.bfloat16)
        outs = []
        for model in (eager, compiled):
            # as an optimizer's zero_grad: a gradient kept from the last step would be a CUDA
            # graph output that this step's replay overwrites (reduce-overhead refuses to read it)
            for p in model.parameters():
                p.grad = None
            with f8.autocast(recipe=recipe):
                y = model(x)
            y.float().square().mean().backward()
            outs.append(y.detach().clone())
        assert torch.equal(outs[0], outs[1])
    _assert_same_model(eager, base)


def test_inspector_sees_the_same_numbers_in_a_compiled_model() -> None:
    """The observer runs inside the compiled cast: records equal the eager model's."""

    def records(compile_model: bool) -> list[dict[str, tuple[float, ...]]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(f8.Linear(16, 16), torch.nn.ReLU(), f8.Linear(16, 16))
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compile_model else model
        inspector = f8.Inspector(model)
        x = torch.randn(8, 16)
        out = []
        for _ in range(3):
            with inspector:
                with f8.autocast(recipe=RECIPES["delayed"]):
                    y = run(x)
                y.sum().backward()
                out.append({r.name: (r.amax, r.scale, r.casts, r.snr_db) for r in inspector.step()})
        return out

    eager = records(False)
    assert len(eager[-1]) == 6
    assert records(True) == eager


def test_dynamic_shapes_trace_once_and_match_eager() -> None:
    """``dynamic=True``: batch sizes that need padding to the GEMM alignment and ones that do
    not share one graph, with eager's numbers."""

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(f8.Linear(32, 64), torch.nn.ReLU(), f8.Linear(64, 16))

    eager, base = make(), make()
    compiled = torch.compile(base, fullgraph=True, backend="aot_eager", dynamic=True)
    step = _autocast_step(RECIPES["delayed"])
    gen = torch.Generator().manual_seed(3)
    for rows in (8, 24, 7, 33):
        x = torch.randn(rows, 32, generator=gen)
        assert torch.equal(step(eager, x).detach(), step(compiled, x).detach()), rows
    _assert_same_model(eager, base)
    assert counters["stats"]["unique_graphs"] == 1


def test_autocast_inside_the_compiled_function_is_named() -> None:
    """The autocast belongs around the compiled call: with fullgraph=True entering it inside is
    an error that says so; without, Dynamo falls back to eager there and training works."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(f8.Linear(32, 16))

    def forward(x: torch.Tensor) -> torch.Tensor:
        with f8.autocast(recipe=RECIPES["delayed"]):
            return model(x)

    strict = torch.compile(forward, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"inside a function that torch\.compile is tracing"):
        strict(torch.randn(8, 32))
    lenient = torch.compile(forward, backend="aot_eager")
    lenient(torch.randn(8, 32)).sum().backward()
    assert model[0].fp8_meta.forward.update_count.tolist() == [1, 1, 0]


@pytest.mark.parametrize("input_grad", [True, False], ids=["x-grad", "x-no-grad"])
@pytest.mark.parametrize(
    "override", [(True, False, False), (False, True, True)], ids=["hp-fprop", "hp-dgrad-wgrad"]
)
def test_casts_only_one_pass_uses_stay_in_the_forward(
    override: tuple[bool, bool, bool], input_grad: bool
) -> None:
    """With a high-precision fprop the FP8 weight feeds only dgrad (none at all when x needs no
    gradient): the compiled cast must still run in the forward, before the update event, and
    record as eager does (a compiler may neither move it to the backward nor drop it)."""
    recipe = DelayedScaling(amax_history_len=4, override_linear_precision=override)

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return f8.Linear(32, 16)

    def inputs(gen: torch.Generator) -> torch.Tensor:
        return (torch.randn(16, 32, generator=gen) * 3).requires_grad_(input_grad)

    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(input_grad)
        with f8.autocast(recipe=recipe):
            y = model(x)
        y.float().square().sum().backward()
        return torch.cat([y.flatten(), x.grad.flatten()]) if input_grad else y

    eager, _ = _train_side_by_side(make, step, inputs)
    assert eager.fp8_meta.forward.update_count.tolist()[:2] == [4, 4]


def test_fullgraph_as_the_processs_first_fp8_call() -> None:
    """A compiled call that is the process's first FP8 GEMM traces with ``fullgraph=True`` (it
    used to trace into the native library's loading lock), and later steps reuse its one graph
    (the CPU GEMM backend used to be chosen while the first one traced, so the second step
    recompiled); numbers as eager. In a fresh process: this one has long loaded the library."""
    code = """
        import copy, torch
        from torch._dynamo.utils import counters
        import fp8kit.torch as f8
        from fp8kit.recipe import DelayedScaling
        torch.manual_seed(0)
        model = f8.Linear(32, 32)
        twin = copy.deepcopy(model)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        x = torch.randn(8, 32)
        for m in (compiled, twin):
            for _ in range(3):
                with f8.autocast(recipe=DelayedScaling(amax_history_len=4)):
                    y = m(x)
                y.sum().backward()
        assert torch.equal(model.weight.grad, twin.weight.grad)
        assert torch.equal(model.fp8_meta.forward.scale, twin.fp8_meta.forward.scale)
        print("same", model.fp8_meta.forward.update_count.tolist(),
              "graphs", counters["stats"]["unique_graphs"])
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "same [3, 3, 0] graphs 1"


class _Checkpointed(torch.nn.Module):
    """Two FP8 Linears under ``torch.utils.checkpoint`` (what a compiled graph recomputes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = f8.Linear(32, 32), f8.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(
            lambda t: self.b(torch.relu(self.a(t))), x, use_reentrant=False
        )


def test_a_compiled_recomputation_of_fp8_casts_raises() -> None:
    """A compiled graph that recomputes forward casts in backward would read the updated scales
    and record the amaxes again (silently wrong gradients and state): it raises instead. torch
    2.11's compiled graph saves the casts rather than recompute them (decision 0249): where no
    error comes, the step must equal eager's, bit for bit."""
    torch.manual_seed(0)
    model = _Checkpointed()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 32)
    with f8.autocast(recipe=RECIPES["delayed"]):
        y = compiled(x)
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
        with pytest.raises(RuntimeError, match="recomputed an FP8 forward cast in the backward"):
            y.sum().backward()
        return
    try:
        y.sum().backward()
    except RuntimeError as err:  # an older torch that recomputes too
        assert "recomputed an FP8 forward cast in the backward" in str(err)
        return
    with f8.autocast(recipe=RECIPES["delayed"]):
        eager(x).sum().backward()
    _assert_same_model(eager, model)


def test_compiled_autograd_raises_instead_of_never_updating() -> None:
    """Compiled autograd never runs the engine callback holding the backward update event, so
    the gradient scales would never move: the first FP8 backward cast says so."""
    torch.manual_seed(0)
    model = f8.Linear(32, 16)
    with torch._dynamo.config.patch(compiled_autograd=True):  # torch.compile reads it here

        @torch.compile(backend="aot_eager")
        def backward(loss: torch.Tensor) -> None:
            loss.backward()

    with f8.autocast(recipe=RECIPES["delayed"]):
        y = model(torch.randn(8, 32))
    with pytest.raises(Exception, match="compiled autograd"):
        backward(y.square().mean())
    assert model.fp8_meta.backward.update_count.tolist() == [0, 0]


def test_high_precision_call_traces_after_fp8_steps() -> None:
    """Outside an autocast a module that has run in FP8 is a plain Linear, compiled with
    ``fullgraph=True`` too (the recomputation warning's engine query used to break the graph)."""
    torch.manual_seed(0)
    model = f8.Linear(32, 16)
    with f8.autocast(recipe=RECIPES["delayed"]):
        model(torch.randn(8, 32)).sum().backward()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 32, requires_grad=True)
    expected = torch.nn.functional.linear(x, model.weight, model.bias)
    assert torch.equal(compiled(x), expected)


def test_a_compiled_function_calling_backward_compiles_no_update_event() -> None:
    """A compiled function that runs forward and ``loss.backward()`` (the autocast around it):
    the backward update event runs in the autograd engine's callback while Dynamo's frame hook
    is installed, and must run eagerly, not be compiled into graphs of its own with graph
    breaks that grow as the states change. Numbers as eager."""

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(f8.Linear(32, 64), torch.nn.ReLU(), f8.Linear(64, 16))

    eager, base = make(), make()

    def fwd_bwd(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach()

    compiled = torch.compile(fwd_bwd, backend="aot_eager")
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        x = torch.randn(16, 32, generator=gen)
        losses = []
        for model, fn in ((eager, fwd_bwd), (base, compiled)):
            model.zero_grad(set_to_none=True)
            with f8.autocast(recipe=RECIPES["delayed"]):
                losses.append(fn(model, x))
        assert torch.equal(*losses)
    _assert_same_model(eager, base)
    breaks = [reason.splitlines()[0] for reason in counters["graph_break"]]
    assert all("backward" in reason.lower() for reason in breaks), breaks
    assert counters["stats"]["unique_graphs"] <= 3, counters["stats"]


_OPS = ("fp8kit::quantize_slot", "fp8kit::record_slot", "fp8kit::small_fp8_gemm")


def test_the_fp8kit_ops_have_no_python_dispatch_layers() -> None:
    """The ops compiled graphs call are plain library ops (ADR 0254): one kernel for every
    device and no Python kernel at the Autograd or ADInplaceOrView keys, which a
    ``torch.library.custom_op`` adds and which cost 44-66 us a call on a 2-core EPYC. The slot
    casts keep their contract: the token declared mutated, the cudagraph_unsafe tag, six
    arguments (fp8kit.torch registers the ops when it is imported)."""
    for name in _OPS:
        has = lambda key, name=name: torch._C._dispatch_has_kernel_for_dispatch_key(name, key)  # noqa: E731
        assert has("CompositeExplicitAutograd"), name
        assert not has("Autograd") and not has("ADInplaceOrView"), name
    for op in (torch.ops.fp8kit.quantize_slot.default, torch.ops.fp8kit.record_slot.default):
        args = op._schema.arguments
        assert [a.name for a in args] == [
            "token", "x", "forward_uid", "backward_uid", "event_key", "call"
        ], args  # fmt: skip
        assert args[0].alias_info is not None and args[0].alias_info.is_write, args[0]
        assert all(a.alias_info is None for a in args[1:]), args
        if hasattr(torch.Tag, "cudagraph_unsafe"):
            assert torch.Tag.cudagraph_unsafe in op.tags, op.tags


class _UpcastHead(torch.nn.Module):
    """Two FP8 Linears, the second with FP8 output and input gradient, and an upcast of its
    output inside the graph: where Inductor would fuse a rounding into its neighbour."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = f8.Linear(128, 128)  # 128^3 MACs: above SMALL_GEMM_MACS, the upcast GEMM
        self.head = f8.Linear(128, 16, fp8_output=True, fp8_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).float() * 3.0


@pytest.mark.parametrize(
    "override", [(False, False, False), (False, True, True)], ids=["fp8", "hp-gradients"]
)
def test_inductor_keeps_every_rounding_of_the_fp8_modules(override: tuple[bool, ...]) -> None:
    """Under torch.autocast(bfloat16) the bias reaches the GEMM as bfloat16 and the FP8 output
    and input gradient are dequantized to bfloat16; overridden gradient GEMMs round their float32
    products to bfloat16 and sum the bias gradient in float32. Traced as torch ops, Inductor
    fused those roundings into the float32 ops next to them (emulate_precision_casts is off by
    default) and reordered the sum: these are library ops now (decision 0268), so the compiled
    model trains with eager's bits."""
    recipe = DelayedScaling(amax_history_len=4, override_linear_precision=override)

    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), f8.autocast(recipe=recipe):
            y = model(x)
        y.square().mean().backward()
        return y

    _train_side_by_side(
        _UpcastHead, step, lambda g: torch.randn(128, 128, generator=g), 2, "inductor"
    )


def test_a_call_that_casts_nothing_binds_as_in_eager() -> None:
    """Every GEMM in high precision: no cast op runs, yet eager's call binds the states (history
    length, recorded recipe), so the checkpoints of both models must match; a bind op does it in
    the graph (decision 0268)."""
    recipe = DelayedScaling(amax_history_len=2, override_linear_precision=(True, True, True))

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(f8.Linear(16, 16), f8.LayerNormMLP(16, 32))

    eager, _ = _train_side_by_side(
        make,
        _autocast_step(recipe),
        lambda g: torch.randn(4, 16, generator=g),
        steps=2,
    )
    assert eager[0].fp8_meta.forward.amax_history.shape == (2, 3)


def test_a_compiled_scaled_mm_is_as_free_of_autograd_as_eager() -> None:
    """``f8.scaled_mm`` computes no gradients (its kernels do not record autograd): with a
    bias that requires grad, the compiled call's result requires none either, as in eager,
    instead of a graph whose backward silently skips the bias (the upcast GEMM op)."""
    torch.manual_seed(0)
    one = torch.tensor(1.0)
    a = f8.quantize(torch.randn(128, 128), one, torch.float8_e4m3fn)
    b = f8.quantize(torch.randn(128, 128), one, torch.float8_e4m3fn)
    b = f8.Float8Tensor(b.data.t(), b.scale_inv, b.amax)  # column-major B, 128^3 MACs

    def gemm(bias: torch.Tensor) -> torch.Tensor:
        return f8.scaled_mm(a, b, torch.bfloat16, bias=bias)

    bias = torch.randn(128, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(gemm, backend="aot_eager", fullgraph=True)
    for fn in (gemm, compiled):
        assert not fn(bias).requires_grad
    assert torch.equal(gemm(bias), compiled(bias))
