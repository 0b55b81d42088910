"""The benchmark scripts run (smoke test with tiny sizes); speed itself is never asserted."""

from __future__ import annotations

import re

import pytest

from benchmarks.run_all import BENCHMARKS
from fp8kit.torch import kernels


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(BENCHMARKS) - {"bench_keras", "kernel_census"}))
def test_benchmark_smoke(name: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Every ``make bench`` script runs and prints a table (bench_keras and kernel_census have
    tests of their own: tests/keras/test_bench_keras.py, tests/torch/test_kernels.py). capfd:
    bench_reduction's ranks print from processes of their own."""
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    module.main(["--quick"])
    out = capfd.readouterr().out
    table = re.search(r"^\|.*\|$", out, re.MULTILINE) is not None
    said_why = not kernels.native_available() and "native kernel" in out  # nothing to compare
    said_why = said_why or (not kernels.triton_available() and "triton is not installed" in out)
    assert table or said_why, out[-2000:]


def test_memory_benchmark_counts_fp8_activations_at_a_quarter() -> None:
    import torch

    import fp8kit.torch as f8
    from benchmarks.bench_memory import _stack, saved_bytes

    x = torch.randn(64, 32, requires_grad=True)
    fp32 = saved_bytes(_stack(32, 3, gelu=False), x, fp8=False)
    fp8 = saved_bytes(f8.convert_model(_stack(32, 3, gelu=False)), x, fp8=True)
    assert fp32 == {"weights": 0, "activations": 3 * 64 * 32 * 4}
    assert fp8 == {"weights": 3 * 32 * 32, "activations": 3 * 64 * 32}


def test_bench_gpu_without_cuda_says_so_and_exits_0(tmp_path) -> None:
    """``make bench-gpu`` on a CPU-only machine: one clear line, exit code 0, no JSON."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: bench-gpu would measure")
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device: bench-gpu measures GPU figures only" in proc.stdout
    assert not out.exists()


def test_gpu_profile_checks_its_parts_then_needs_cuda(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks.gpu_profile``: an unknown part is refused by name before anything runs;
    without CUDA it says so and writes nothing."""
    import torch

    from benchmarks import gpu_profile

    with pytest.raises(SystemExit):
        gpu_profile.main(["--only", "host,kernel", "--out-dir", str(tmp_path)])
    assert "--only takes a comma-separated list of ('host', 'calls', 'kernels')" in (
        capsys.readouterr().err
    )
    if torch.cuda.is_available():
        return
    gpu_profile.main(["--out-dir", str(tmp_path / "out")])
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# bench-gpu's CPU-testable parts: benchmarks/gpu_common.py (bookkeeping) and the step builders of
# benchmarks/gpu_measure.py that take a device.


def test_bench_gpu_rejects_unknown_sections(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.gpu import parse_args
    from benchmarks.gpu_common import parse_sections

    assert parse_sections(" gpt,linear ,cast") == ["linear", "cast", "gpt"]  # SECTIONS order
    for bad in ("linear,bogus", "", " , "):
        with pytest.raises(ValueError, match=r"--only.*allowed: linear, tiny, syncs, cast, gpt"):
            parse_sections(bad)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--only", "tiny,nope"])
    assert exit_info.value.code == 2
    assert "--only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--budget-scale", "0"])
    assert parse_args(["--only", "cast"]).sections == ["cast"]


def test_bench_gpu_picks_the_gpt_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.gpu import GPT_SIZES, parse_args

    small, large = GPT_SIZES
    assert parse_args([]).gpt_sizes == [small, large]
    assert parse_args(["--quick"]).gpt_sizes == [small]
    assert parse_args(["--quick", "--gpt", "large"]).gpt_sizes == [large]
    assert parse_args(["--gpt", "all"]).gpt_sizes == [small, large]
    with pytest.raises(SystemExit):
        parse_args(["--gpt", "huge"])
    assert "--gpt: invalid choice: 'huge'" in capsys.readouterr().err


def test_budget_runs_out_on_its_clock() -> None:
    from benchmarks.gpu_common import Budget

    now = [100.0]
    budget = Budget("linear", 30.0, clock=lambda: now[0])
    assert not budget.spent() and budget.elapsed() == 0.0
    now[0] = 129.5
    assert not budget.spent()
    now[0] = 130.0
    assert budget.spent()
    assert budget.skip_note() == "skipped: linear budget of 30 s spent"
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="'gpt' must be > 0"):
            Budget("gpt", bad)


def test_repeats_for_aims_at_the_target_time_within_bounds() -> None:
    from benchmarks.gpu_common import repeats_for

    assert repeats_for(20.0, target_ms=1000.0) == 50
    assert repeats_for(500.0, target_ms=1000.0) == 10  # at least lo
    assert repeats_for(0.001, target_ms=1000.0) == 100  # at most hi
    assert repeats_for(3.0, target_ms=100.0, lo=20, hi=500) == 33
    for odd in (0.0, -1.0, float("nan"), float("inf")):
        assert repeats_for(odd) == 100


def test_cell_turns_a_failure_into_its_text() -> None:
    from benchmarks.gpu_common import cell

    assert cell(lambda: 1.5) == 1.5

    def fail() -> None:
        raise RuntimeError("CUDA out of memory.\n  Tried to allocate 2 GiB")

    assert cell(fail) == "error: RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"


def test_ratios_to_the_floor_and_to_bf16() -> None:
    from benchmarks.gpu_common import with_ratios

    row = {"bf16": 2.0, "fp8": 3.0, "torchao": "n/a", "floor": 1.5, "flag": True}
    out = with_ratios(row, {"floor": "floor", "bf16": "bf16"})
    assert out == {
        **row,
        "bf16 / floor": 1.33,
        "fp8 / floor": 2.0,
        "fp8 / bf16": 1.5,
        "floor / bf16": 0.75,
    }
    # An unmeasured or zero reference adds no ratios for it; the input is not modified.
    assert with_ratios({"a": 1.0, "floor": "error: X"}, {"floor": "floor"}) == {
        "a": 1.0,
        "floor": "error: X",
    }
    assert with_ratios({"a": 1.0, "z": 0.0}, {"z": "z"}) == {"a": 1.0, "z": 0.0}
    assert "fp8 / floor" not in row


def test_tables_flatten_nested_rows_and_format_numbers() -> None:
    from benchmarks.gpu_common import flatten, format_value, render_table

    assert flatten({"a": 1, "b": {"c": 2, "d": {"e": 3}}}) == {"a": 1, "b: c": 2, "b: d: e": 3}
    assert flatten("n/a") == {"": "n/a"}
    assert [format_value(v) for v in (1.23456, 2.0, 1234.6, 0.00123, 0.0, 7, "x")] == [
        "1.235",
        "2",
        "1235",
        "1.23e-03",
        "0",
        "7",
        "x",
    ]
    table = render_table(
        {"small": {"bf16": {"tokens/s": 766000, "peak GiB": 2.5}}, "big": "error: OOM"}, "model"
    )
    assert table.splitlines() == [
        "| model | bf16: tokens/s | bf16: peak GiB | value |",
        "|---|---|---|---|",
        "| small | 766000 | 2.5 |  |",
        "| big |  |  | error: OOM |",
    ]


def test_linear_tables_are_split_into_ms_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.gpu import print_linear
    from benchmarks.gpu_common import with_ratios

    row = with_ratios({"bf16": 2.0, "fp8": 3.0, "floor": 1.5}, {"floor": "floor", "bf16": "bf16"})
    print_linear({"4096x1024x1024": row, "8192x8192x8192": "error: OOM", "note": {"x": "y"}})
    out = capsys.readouterr().out
    assert "| 4096x1024x1024 | 2 | 3 | 1.5 |" in out  # ms
    assert "| 4096x1024x1024 | 1.33 | 2 |" in out  # / floor: bf16, fp8
    assert "| 4096x1024x1024 | 1.5 | 0.75 |" in out  # / bf16: fp8, floor
    assert "8192x8192x8192: error: OOM" in out and 'note: {"x": "y"}' in out


class _Event:
    """Stand-in for a profiler FunctionEvent (the fields count_profile_events reads)."""

    def __init__(self, name: str, device: str = "cpu", parent=None, activity=None) -> None:
        import torch

        self.name = name
        self.device_type = getattr(torch.autograd.DeviceType, device.upper())
        self.cpu_parent = parent
        self.activity_type = activity


def test_profile_counts_separate_kernels_copies_and_aten_levels() -> None:
    from benchmarks.gpu_common import count_profile_events

    engine = _Event("autograd::engine::evaluate_function: MmBackward0")
    linear = _Event("aten::linear")
    addmm = _Event("aten::addmm", parent=_Event("aten::t", parent=linear))
    events = [
        linear,
        addmm,
        _Event("aten::mm", parent=engine),
        _Event("cudaLaunchKernel"),
        _Event("sm90_xmma_gemm_bf16", "cuda", activity="kernel"),
        _Event("triton_cast", "cuda"),  # no activity field (older torch): by name
        _Event("Memcpy HtoD (Pageable -> Device)", "cuda", activity="gpu_memcpy"),
        _Event("Memset (Device)", "cuda"),
        # a record_function range drawn on the device timeline (compiled regions): no kernel
        _Event("CompiledFunction", "cuda", activity="gpu_user_annotation"),
    ]
    assert count_profile_events(events) == {
        "kernels": 2,
        "copies": 2,
        "aten": 3,
        "aten top-level": 2,
    }


def test_profile_counts_of_a_real_cpu_step() -> None:
    """On the CPU profile of an nn.Linear step: no device events, nested aten ops counted."""
    import torch
    from torch import nn

    from benchmarks.gpu_common import count_profile_events
    from benchmarks.gpu_measure import training_step

    layer = nn.Linear(16, 16)
    step = training_step(layer, torch.randn(8, 16, requires_grad=True), torch.randn(8, 16), None)
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    counts = count_profile_events(prof.events())
    assert counts["kernels"] == counts["copies"] == 0
    assert counts["aten"] > counts["aten top-level"] >= 4  # linear, 2 mm, sum at least


def test_sub_benchmark_results_sit_beside_the_main_json() -> None:
    from benchmarks.gpu_common import sub_result_path

    assert sub_result_path("out/gpu.json", "gpu_jax") == "out/gpu.gpu_jax.json"
    assert sub_result_path("results", "gpu_kernels") == "results.gpu_kernels.json"
    assert sub_result_path("/a.b/r.txt", "gpu_keras") == "/a.b/r.gpu_keras.txt"


def test_training_step_clears_gradients_and_runs_fp8() -> None:
    """Each step starts from None gradients (no accumulation), bf16 and fp8kit alike."""
    import torch
    from torch import nn

    import fp8kit.torch as f8
    from benchmarks.gpu_measure import DELAYED, fp8_linear_like, training_step
    from tests.seeding import choose_seed

    seed = choose_seed()
    torch.manual_seed(seed)
    base = nn.Linear(32, 16)
    x = torch.randn(64, 32, dtype=torch.float64).float().requires_grad_()
    dy = torch.randn(64, 16)
    want_dx = dy.double() @ base.weight.double()
    want_dw = dy.double().t() @ x.double()
    step = training_step(base, x, dy, None)
    for _ in range(2):
        step()
    # float32 math against float64: a second accumulated step would be off by 100%.
    close = {"rtol": 1e-5, "atol": 1e-5, "msg": f"seed {seed}"}
    torch.testing.assert_close(x.grad.double(), want_dx, **close)
    torch.testing.assert_close(base.weight.grad.double(), want_dw, **close)
    torch.testing.assert_close(base.bias.grad.double(), dy.double().sum(0), **close)

    fp8 = fp8_linear_like(base)
    assert isinstance(fp8, f8.Linear) and fp8 is not base
    assert torch.equal(fp8.weight, base.weight) and torch.equal(fp8.bias, base.bias)
    step = training_step(fp8, x, dy, DELAYED)
    for _ in range(3):
        step()
    # FP8 gradients: E5M2 dY, relative error ~0.06 (shared MEASUREMENTS); not accumulated (3x).
    for got, want in ((x.grad, want_dx), (fp8.weight.grad, want_dw)):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 0.15, f"seed {seed}: relative error {rel:.3f}"


def test_gpt_training_step_trains_the_demo_model_in_fp8() -> None:
    """bench-gpu's and gpu_profile's GPT step (on the CPU here): each step moves every
    parameter, leaves no gradient behind (set to None after the optimizer) and runs fp8kit's
    update events (the first FP8 layer's scale leaves 1 after its first events)."""
    import torch

    from benchmarks.gpu_measure import DELAYED, gpt_training_step
    from fp8kit.demo.model import GPTConfig

    config = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    step, model = gpt_training_step(config, 2, DELAYED, device="cpu")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for _ in range(3):
        step()
    for name, p in model.named_parameters():
        assert p.grad is None, name
        assert not torch.equal(p, before[name]), name
    scales = [m.fp8_meta.forward.scale for m in model.modules() if hasattr(m, "fp8_meta")]
    assert scales and not torch.all(scales[0] == 1)


@pytest.mark.parametrize("recipe_name", ["bf16", "delayed"])
def test_gpt_training_step_in_cuda_graphs_trains_like_eager(
    recipe_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench-gpu's CUDA-graphed GPT (whole model and loss in one capture, the CPU stand-in for
    torch's capture here): its losses, parameters and FP8 states after each step are bit for
    bit those of the eager step."""
    import torch

    from benchmarks.gpu_measure import DELAYED, gpt_training_step
    from fp8kit.demo.model import GPTConfig
    from tests.torch.emulated_graphs import assert_same_state, emulated_make_graphed_callables

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", emulated_make_graphed_callables)
    recipe = DELAYED if recipe_name == "delayed" else None
    config = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    eager_step, eager = gpt_training_step(config, 2, recipe, device="cpu")
    graphed_step, graphed = gpt_training_step(config, 2, recipe, mode="graphed", device="cpu")
    assert "forward" in graphed.__dict__  # the capture replaced the forward
    for _ in range(3):
        assert torch.equal(eager_step(), graphed_step())
        assert_same_state(eager, graphed)
    counts = [m.fp8_meta.forward.update_count for m in graphed.modules() if hasattr(m, "fp8_meta")]
    assert counts and all(c.max() == (0 if recipe is None else 3) for c in counts)


def test_gpt_training_step_names_a_bad_mode() -> None:
    from benchmarks.gpu_measure import gpt_training_step
    from fp8kit.demo.model import GPTConfig

    with pytest.raises(
        ValueError, match="mode must be one of eager, compiled, graphed, got 'cuda'"
    ):
        gpt_training_step(GPTConfig(block_size=4, n_layer=1, n_head=1, n_embd=8), 1, None, "cuda")


def test_torchao_module_is_the_base_linear_converted() -> None:
    import torch
    from torch import nn

    from benchmarks.gpu_measure import torchao_linear_like, torchao_problem

    if torchao_problem() is not None:
        pytest.skip(f"torchao not importable: {torchao_problem()}")
    base = nn.Linear(32, 16)
    model = torchao_linear_like(base)
    (layer,) = model.children()
    assert type(layer).__name__ == "Float8Linear"
    assert torch.equal(layer.weight, base.weight) and torch.equal(layer.bias, base.bias)


def test_floor_gemms_follow_the_scaled_mm_layout_contract() -> None:
    """The three GEMMs of the floor: A row-major, B column-major, right shapes and values
    (FP8 operands are exact in float64; the only error is the bf16 rounding of each output)."""
    import torch

    from benchmarks.gpu_measure import FloorOperands, check_scaled_mm_dims, floor_gemms
    from tests.seeding import choose_seed

    seed = choose_seed()
    torch.manual_seed(seed)
    m, k, n = 48, 64, 32
    ops = FloorOperands.random(m, k, n, device="cpu")
    pairs = ((ops.x, ops.w.t()), (ops.dy, ops.w_t.t()), (ops.dy_t, ops.x_t.t()))
    for a, b in pairs:
        assert a.is_contiguous() and b.t().is_contiguous()
    assert (ops.x.dtype, ops.w.dtype, ops.dy.dtype) == (
        torch.float8_e4m3fn,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
    x, w, dy, bias = (t.double() for t in (ops.x, ops.w, ops.dy, ops.bias))
    refs = (x @ w.t() + bias, dy @ w, dy.t() @ x)
    for got, want, shape in zip(floor_gemms(ops), refs, ((m, n), (m, k), (n, k)), strict=True):
        assert got.shape == shape and got.dtype == torch.bfloat16
        # bf16 has an 8-bit significand: each rounding is within 2**-8 relative; the bias may be
        # added after a first rounding, so allow two roundings plus the float32 accumulation.
        tol = 2**-7 * (want.abs() + bias.abs().max()) + 1e-6
        assert ((got.double() - want).abs() <= tol).all(), f"seed {seed}"
    check_scaled_mm_dims(16, 32, 4096)
    with pytest.raises(ValueError, match=r"divisible by 16, got \{'K': 40\}"):
        check_scaled_mm_dims(16, 40, 32)


def test_fp8kit_commit_prefers_the_environment(monkeypatch) -> None:
    """FP8KIT_COMMIT wins over git (a copied tree's .git can be older), git wins over n/a."""
    import subprocess

    from benchmarks import gpu

    monkeypatch.delenv("FP8KIT_COMMIT", raising=False)
    assert gpu.fp8kit_commit()  # this checkout: a hash, or n/a without git
    monkeypatch.setenv("FP8KIT_COMMIT", "abc1234")
    assert gpu.fp8kit_commit() == "abc1234"  # even with this checkout's .git beside it

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert gpu.fp8kit_commit() == "abc1234"
    monkeypatch.delenv("FP8KIT_COMMIT")
    assert gpu.fp8kit_commit() == "n/a"


def test_sub_benchmarks_are_saved_after_each_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A time limit on the sub-benchmarks (JAX compiles for minutes) used to lose every
    result: the section saved only at its end. Now the caller gets the results so far after
    each module, and a failing module holds its error without stopping the others."""
    import sys
    import types

    from benchmarks import gpu

    def failing(path: str) -> None:
        raise RuntimeError("no GPU")

    mains = {"_fake_kernels": lambda path: {"ms": 1.0}, "_fake_jax": failing}
    for name, main in mains.items():
        module = types.ModuleType(f"benchmarks.{name}")
        module.main = main  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, f"benchmarks.{name}", module)
    monkeypatch.setattr(gpu, "SUB_BENCHMARKS", tuple(mains))
    saved: list[dict] = []
    results = gpu.sub_section("out/gpu.json", lambda so_far: saved.append(dict(so_far)))
    assert [list(s) for s in saved] == [["_fake_kernels"], ["_fake_kernels", "_fake_jax"]]
    assert saved[0]["_fake_kernels"] == {"ms": 1.0} and "no GPU" in str(results["_fake_jax"])
