"""``make bench-gpu``: the GPU figures of issue 9 / shared MEASUREMENTS' "H100 GPU" section.

Tables (printed as markdown and saved as JSON):

1. ``linear``: Linear training steps (bf16 weights and activations, bias, x requires grad,
   forward + backward incl. fp8kit's update events) for six shapes: bf16 eager / compiled,
   fp8kit delayed and current (eager / compiled), torchao ``Float8Linear`` (compiled / eager,
   when torchao imports) and the floor of three pre-quantized ``_scaled_mm`` GEMMs; ms and ratios.
2. ``tiny``: one 256 x 256 Linear step: wall microseconds, CUDA kernels and aten calls per step.
3. ``syncs``: host synchronisations in one training step (``torch.cuda.set_sync_debug_mode``).
4. ``cast``: quantize bandwidth of fp8kit vs ``copy_`` (bytes read + written).
5. ``gpt``: tokens/s and peak memory of a GPT, bf16 vs fp8kit delayed / current.

Then the sub-benchmarks of other frontends / kernels when their modules exist
(``benchmarks.gpu_kernels``, ``benchmarks.gpu_jax``, ``benchmarks.gpu_keras``, each with
``main(out_json_path) -> dict``). Without CUDA it says so and exits 0.

Run on a GPU machine without a venv: ``PYTHONPATH=$PWD python3 -m benchmarks.gpu --out o.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fp8kit.torch as f8
from benchmarks.common import markdown_table
from fp8kit.demo.model import GPT, GPTConfig
from fp8kit.recipe import DelayedScaling, Float8CurrentScaling

NO_CUDA = "no CUDA device: bench-gpu measures GPU figures only (see docs/benchmarks.md)"
SHAPES = (
    (16384, 4096, 4096),
    (16384, 4096, 14336),
    (16384, 14336, 4096),
    (8192, 8192, 8192),
    (8192, 1024, 4096),
    (4096, 1024, 1024),
)
QUICK_SHAPES = (SHAPES[0], SHAPES[4], SHAPES[5])
DELAYED = DelayedScaling(amax_history_len=16)
CURRENT = Float8CurrentScaling()
SUB_BENCHMARKS = ("gpu_kernels", "gpu_jax", "gpu_keras")
Step = Callable[[], None]


def environment() -> dict[str, str]:
    """Date, GPU, library versions and the fp8kit commit."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
    }
    for name in ("triton", "torchao", "jax"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception:  # optional packages: any import failure means absent
            env[name] = "n/a"
    try:
        env["fp8kit_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["fp8kit_commit"] = "n/a"
    return env


def cuda_time(step: Step, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``step`` over ``repeats`` runs, timed with CUDA events."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cell(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the error as a string: one failing variant must not end the table."""
    try:
        return fn()
    except Exception as exc:  # recorded in the table instead
        return f"error: {type(exc).__name__}: {str(exc)[:120]}"


# ---------------------------------------------------------------------------------------------
# Linear steps


def _linear_step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe: Any) -> Step:
    def step() -> None:
        if recipe is None:
            y = layer(x)
        else:
            with f8.autocast(recipe=recipe):
                y = layer(x)
        y.backward(dy)

    return step


def _torchao_layer(k: int, n: int, compiled: bool) -> nn.Module:
    from torchao.float8 import convert_to_float8_training  # optional: not installed everywhere

    model = nn.Sequential(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
    convert_to_float8_training(model)
    return torch.compile(model) if compiled else model


def _floor_step(m: int, k: int, n: int) -> Step:
    """Three ``_scaled_mm`` calls on pre-quantized operands in the layouts cuBLASLt wants."""
    one = torch.ones((), device="cuda")
    x = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    w_t = w.t().contiguous()
    x_t = x.t().contiguous()
    dy = torch.randn(m, n, device="cuda").to(torch.float8_e5m2)
    dy_t = dy.t().contiguous()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = torch.bfloat16

    def step() -> None:
        torch._scaled_mm(
            x, w.t(), scale_a=one, scale_b=one, bias=bias, out_dtype=out, use_fast_accum=True
        )
        torch._scaled_mm(dy, w_t.t(), scale_a=one, scale_b=one, out_dtype=out)
        torch._scaled_mm(dy_t, x_t.t(), scale_a=one, scale_b=one, out_dtype=out)

    return step


def linear_table(shapes: tuple[tuple[int, int, int], ...], repeats: int) -> dict[str, Any]:
    """Milliseconds per Linear training step for each variant and shape, with ratios."""
    rows = {}
    for m, k, n in shapes:
        rows[f"{m}x{k}x{n}"] = _linear_row(m, k, n, repeats)
        torch.cuda.empty_cache()
    return rows


def _linear_row(m: int, k: int, n: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    base = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    fp8 = f8.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    fp8.load_state_dict(base.state_dict(), strict=False)
    variants: dict[str, Callable[[], Step]] = {
        "bf16": lambda: _linear_step(base, x, dy, None),
        "bf16 compiled": lambda: _linear_step(torch.compile(base), x, dy, None),
        "fp8kit delayed": lambda: _linear_step(fp8, x, dy, DELAYED),
        "fp8kit delayed compiled": lambda: _linear_step(torch.compile(fp8), x, dy, DELAYED),
        "fp8kit current": lambda: _linear_step(fp8, x, dy, CURRENT),
        "fp8kit current compiled": lambda: _linear_step(torch.compile(fp8), x, dy, CURRENT),
        "torchao compiled": lambda: _linear_step(_torchao_layer(k, n, True), x, dy, None),
        "torchao eager": lambda: _linear_step(_torchao_layer(k, n, False), x, dy, None),
        "3 FP8 GEMMs (floor)": lambda: _floor_step(m, k, n),
    }
    row: dict[str, Any] = {}
    for name, make in variants.items():
        row[name] = _cell(lambda make=make: round(cuda_time(make(), repeats), 3))
    floor, bf16 = row["3 FP8 GEMMs (floor)"], row["bf16"]
    for name in list(variants):
        if isinstance(row[name], float) and isinstance(floor, float):
            row[f"{name} / floor"] = round(row[name] / floor, 2)
        if isinstance(row[name], float) and isinstance(bf16, float):
            row[f"{name} / bf16"] = round(row[name] / bf16, 2)
    return row


# ---------------------------------------------------------------------------------------------
# Tiny step: host overhead, kernels, aten calls


def _profile_counts(step: Step) -> tuple[int, int]:
    """(CUDA kernels, aten calls) of one ``step`` after warm-up."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    kernels = aten = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
        elif event.name.startswith("aten::"):
            aten += 1
    return kernels, aten


def _wall_us(step: Step, n: int = 200) -> float:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def tiny_table() -> dict[str, Any]:
    """Wall us, kernels and aten calls (all levels, as the profiler lists them) per tiny step."""
    torch.manual_seed(0)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    base = nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)
    fp8 = f8.Linear(256, 256, device="cuda", dtype=torch.bfloat16)
    variants: dict[str, Callable[[], Step]] = {
        "bf16 nn.Linear": lambda: _linear_step(base, x, dy, None),
        "fp8kit delayed": lambda: _linear_step(fp8, x, dy, DELAYED),
        "fp8kit current": lambda: _linear_step(fp8, x, dy, CURRENT),
        "torchao eager": lambda: _linear_step(_torchao_layer(256, 256, False), x, dy, None),
        "torchao compiled": lambda: _linear_step(_torchao_layer(256, 256, True), x, dy, None),
    }
    rows: dict[str, Any] = {}
    for name, make in variants.items():

        def measure(make: Callable[[], Step] = make) -> dict[str, Any]:
            step = make()
            kernels, aten = _profile_counts(step)
            return {"wall_us": round(_wall_us(step), 1), "kernels": kernels, "aten": aten}

        rows[name] = _cell(measure)
    bf16 = rows["bf16 nn.Linear"]
    for row in rows.values():
        if isinstance(row, dict) and isinstance(bf16, dict):
            row["wall vs bf16"] = round(row["wall_us"] / bf16["wall_us"], 2)
    rows["200 stacked Linear(256)"] = _cell(_stack_times)
    return rows


def _stack_times() -> dict[str, float]:
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out: dict[str, float] = {}
    for name, cls, recipe in (("bf16 ms", nn.Linear, None), ("fp8kit ms", f8.Linear, DELAYED)):
        model = nn.Sequential(
            *[cls(256, 256, device="cuda", dtype=torch.bfloat16) for _ in range(200)]
        )

        def step(model: nn.Module = model, recipe: Any = recipe) -> None:
            with f8.autocast(enabled=recipe is not None, recipe=recipe):
                y = model(x)
            y.sum().backward()

        out[name] = round(_wall_us(step, n=20) / 1000, 2)
    return out


# ---------------------------------------------------------------------------------------------
# Host syncs


def sync_table() -> dict[str, Any]:
    """Host syncs of one training step (after warm-up) per recipe; "error" mode pass/fail."""
    model = nn.Sequential(
        f8.Linear(1024, 1024, device="cuda", dtype=torch.bfloat16),
        f8.LayerNormMLP(1024, 4096, device="cuda", dtype=torch.bfloat16),
    )
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    rows: dict[str, Any] = {}
    for name, recipe in (("delayed", DELAYED), ("current", CURRENT)):

        def step(recipe: Any = recipe) -> None:
            with f8.autocast(recipe=recipe):
                y = model(x)
            y.float().square().mean().backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            strict = "pass"
        except RuntimeError as exc:
            strict = f"fail: {str(exc)[:120]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rows[name] = {"syncs per step": syncs, "sync_debug_mode=error": strict}
    return rows


# ---------------------------------------------------------------------------------------------
# Cast bandwidth


def cast_table(numel: int = 64 * 2**20, repeats: int = 20) -> dict[str, Any]:
    """GB/s (bytes read + written) of copy_, fp8kit quantize and cast+transpose, 64M elements."""
    rows: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(8192, numel // 8192, device="cuda", dtype=dtype)
        buf = torch.empty_like(x)
        scale = torch.full((), 0.5, device="cuda")
        nbytes = x.numel() * x.element_size()
        copy_ms = cuda_time(lambda x=x, buf=buf: buf.copy_(x), repeats)
        quant_ms = cuda_time(
            lambda x=x, scale=scale: f8.quantize(x, scale, torch.float8_e4m3fn), repeats
        )
        row = {
            "copy GB/s": round(2 * nbytes / copy_ms / 1e6, 1),
            "quantize GB/s": round((nbytes + x.numel()) / quant_ms / 1e6, 1),
        }
        row["quantize / copy"] = round(row["quantize GB/s"] / row["copy GB/s"], 2)
        rows[str(dtype).replace("torch.", "")] = row
    return rows


# ---------------------------------------------------------------------------------------------
# GPT throughput


def gpt_table(quick: bool) -> dict[str, Any]:
    """Tokens/s and peak GiB per variant for the two GPT sizes (AdamW, bf16 autocast)."""
    configs = {
        "GPT 6x512 ctx 256 batch 64": (
            GPTConfig(block_size=256, n_layer=6, n_head=8, n_embd=512),
            64,
        ),
        "GPT 12x2048 ctx 1024 batch 8": (
            GPTConfig(block_size=1024, n_layer=12, n_head=16, n_embd=2048),
            8,
        ),
    }
    if quick:
        configs.pop("GPT 12x2048 ctx 1024 batch 8")
    rows: dict[str, Any] = {}
    for name, (config, batch) in configs.items():
        row: dict[str, Any] = {}
        for variant, recipe in (
            ("bf16", None),
            ("fp8kit delayed", DELAYED),
            ("fp8kit current", CURRENT),
        ):
            row[variant] = _cell(
                lambda c=config, b=batch, r=recipe: _gpt_run(c, b, r)  # type: ignore[misc]
            )
        bf16 = row["bf16"]
        for variant in ("fp8kit delayed", "fp8kit current"):
            if isinstance(row[variant], dict) and isinstance(bf16, dict):
                row[variant]["vs bf16"] = round(row[variant]["tokens/s"] / bf16["tokens/s"], 2)
        rows[name] = row
    return rows


def _gpt_run(config: GPTConfig, batch: int, recipe: Any, steps: int = 20) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), device="cuda")
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ctx = f8.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
            with ctx:
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "tokens/s": round(steps * batch * config.block_size / seconds),
        "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    return result


# ---------------------------------------------------------------------------------------------


def _print_table(title: str, rows: dict[str, Any]) -> None:
    columns: list[str] = []
    for row in rows.values():
        for key in row if isinstance(row, dict) else ["value"]:
            if key not in columns:
                columns.append(key)
    body = [
        [name, *[(row.get(c, "") if isinstance(row, dict) else row) for c in columns]]
        for name, row in rows.items()
    ]
    print(f"\n## {title}\n")
    print(markdown_table(["", *columns], body))


def run_sub_benchmarks(out_path: str | None) -> dict[str, Any]:
    """Each ``benchmarks.<name>.main(path)`` that exists; a missing module is noted."""
    results: dict[str, Any] = {}
    for name in SUB_BENCHMARKS:
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ImportError as exc:
            results[name] = f"skipped: {exc}"
            continue
        sub_path = None if out_path is None else out_path.replace(".json", f".{name}.json")
        results[name] = _cell(lambda module=module, sub_path=sub_path: module.main(sub_path))
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-gpu.json", help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="three shapes, the small GPT only")
    parser.add_argument(
        "--only",
        default="linear,tiny,syncs,cast,gpt,sub",
        help="comma-separated sections: linear, tiny, syncs, cast, gpt, sub",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per cell")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return {}
    sections = {s.strip() for s in args.only.split(",")}
    results: dict[str, Any] = {"environment": environment()}
    print("environment:", json.dumps(results["environment"]))
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "linear": lambda: linear_table(QUICK_SHAPES if args.quick else SHAPES, args.repeats),
        "tiny": tiny_table,
        "syncs": sync_table,
        "cast": cast_table,
        "gpt": lambda: gpt_table(args.quick),
        "sub": lambda: run_sub_benchmarks(args.out),
    }
    for name, run in runners.items():
        if name not in sections:
            continue
        results[name] = _cell(run)
        if isinstance(results[name], dict) and name != "sub":
            _print_table(name, results[name])
        with open(args.out, "w") as f:  # saved after every section: a timeout keeps the rest
            json.dump(results, f, indent=2, default=str)
    print(f"\nsaved {args.out}")
    return results


if __name__ == "__main__":
    main()
