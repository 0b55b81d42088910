"""``make bench-gpu``: the GPU figures of issue 9 (the tables of shared MEASUREMENTS' H100 section).

Sections (printed as markdown, saved as JSON after each one; ``--only`` picks some):

1. ``linear``: one Linear training step (bf16 weights and activations, bias, ``x`` requiring
   grad; forward + backward, fp8kit's update events included; gradients set to None before each
   step so no accumulation kernel runs) for six M x K x N shapes: bf16 eager / compiled, fp8kit
   delayed and current (eager / ``torch.compile`` of the module), torchao ``Float8Linear``
   (tensorwise default, compiled / eager; "n/a" when torchao does not import) and the floor: the
   step's three FP8 GEMMs alone on pre-quantized operands. Milliseconds (median of CUDA-event
   timings) and each variant's ratio to the floor and to bf16.
2. ``tiny``: one 256 x 256 Linear step (the time is host overhead): wall microseconds, CUDA
   kernels and memcpy/memsets, aten calls (all levels, and top-level); 200 stacked layers.
3. ``syncs``: host synchronisations per step (``torch.cuda.set_sync_debug_mode("warn")``),
   first and steady step, and whether a step passes under ``"error"``.
4. ``cast``: quantize bandwidth (bytes read + written) against ``copy_``, 64M elements.
5. ``gpt``: tokens/s and peak memory of the demo GPT (``fp8kit.demo.model``) at 6 x 512 and
   12 x 2048, bf16 autocast vs fp8kit delayed / current, AdamW.
6. ``sub``: ``benchmarks.gpu_kernels`` / ``gpu_jax`` / ``gpu_keras`` ``main(path)``, each saving
   its own JSON beside ``--out``; a module that does not import is noted and skipped.

Each section has a time budget (``gpu_common.SECTION_BUDGET_S``): once spent, its remaining cells
read "skipped". A failing cell holds its error text and the run goes on. Without CUDA the script
prints one line and exits 0. Only fp8kit's public API is used.

Run: ``make bench-gpu``, or on a GPU machine without a venv
``PYTHONPATH=$PWD python3 -m benchmarks.gpu --out $OUT/gpu.json`` (``benchmarks/gpu_run.sh``
also installs carried wheels and runs the tests). ``docs/benchmarks.md`` explains the tables.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib
import importlib.metadata
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fp8kit.torch as f8
from benchmarks.gpu_common import (
    NOT_AVAILABLE,
    SECTION_BUDGET_S,
    SECTIONS,
    Budget,
    cell,
    is_number,
    kernel_ms,
    parse_sections,
    render_table,
    sub_result_path,
    with_ratios,
)
from benchmarks.gpu_measure import (
    CURRENT,
    DELAYED,
    Step,
    compiled,
    count_syncs,
    cuda_time_ms,
    floor_step,
    fp8_linear_like,
    gpt_training_step,
    graphed,
    kernels_cast_transpose,
    profile_counts,
    strict_step,
    torchao_linear_like,
    torchao_problem,
    training_step,
    wall_us,
)
from fp8kit.demo.model import GPTConfig
from fp8kit.torch import kernels

NO_CUDA = "no CUDA device: bench-gpu measures GPU figures only (see docs/benchmarks.md)"
SHAPES = (
    (16384, 4096, 4096),
    (16384, 4096, 14336),
    (16384, 14336, 4096),
    (8192, 8192, 8192),
    (8192, 1024, 4096),
    (4096, 1024, 1024),
)
QUICK_SHAPES = (SHAPES[0], SHAPES[1], SHAPES[5])
BF16 = "bf16"
FLOOR = "3 FP8 GEMMs (floor)"
TORCHAO_VARIANTS = ("torchao compiled", "torchao eager")
# the quick ones first: JAX compiles for minutes, and a time limit must not cost the others
SUB_BENCHMARKS = ("gpu_kernels", "gpu_keras", "gpu_jax")
CAST_ELEMENTS = 64 * 2**20  # 8192 x 8192
TINY = 256
STACK_DEPTH = 200
GPT_SIZES = {
    # name: (config, batch)
    "GPT 6x512 ctx 256 batch 64": (GPTConfig(block_size=256, n_layer=6, n_head=8, n_embd=512), 64),
    "GPT 12x2048 ctx 1024 batch 8": (
        GPTConfig(block_size=1024, n_layer=12, n_head=16, n_embd=2048),
        8,
    ),
}
GPT_STEPS = (3, 15)  # warm-up, timed
GPT_CHOICES = {"small": list(GPT_SIZES)[:1], "large": list(GPT_SIZES)[1:], "all": list(GPT_SIZES)}
"""``--gpt``'s values and the :data:`GPT_SIZES` each runs."""


# ---------------------------------------------------------------------------------------------
# Environment


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return NOT_AVAILABLE


def fp8kit_commit() -> str:
    """The ``FP8KIT_COMMIT`` environment variable when set (a copied tree: the lent GPU's copy
    carried a ``.git`` from an older commit on 2026-11-28), else the short commit of the fp8kit
    checkout (``-dirty`` with local changes), else "n/a"."""
    if os.environ.get("FP8KIT_COMMIT"):
        return os.environ["FP8KIT_COMMIT"]
    repo = Path(f8.__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=9"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("FP8KIT_COMMIT", NOT_AVAILABLE)


def environment() -> dict[str, str]:
    """Date, GPU, library versions, the fp8kit commit and the recipes timed."""
    major, minor = torch.cuda.get_device_capability()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": f"{torch.cuda.get_device_name()} (sm_{major}{minor})",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": _version("triton"),
        "jax": _version("jax"),
        "torchao": _version("torchao"),
        "fp8kit_commit": fp8kit_commit(),
        "delayed recipe": repr(DELAYED),
        "current recipe": repr(CURRENT),
    }


# ---------------------------------------------------------------------------------------------
# 1. Linear steps


def linear_section(shapes: tuple[tuple[int, int, int], ...], budget: Budget) -> dict[str, Any]:
    """``{"MxKxN": {variant: ms, "<variant> / floor": r, "<variant> / bf16": r}}``."""
    torchao_missing = torchao_problem()
    rows: dict[str, Any] = {}
    for m, k, n in shapes:
        rows[f"{m}x{k}x{n}"] = cell(
            lambda m=m, k=k, n=n: linear_row(m, k, n, budget, torchao_missing)
        )
        gc.collect()
        torch.cuda.empty_cache()
    if torchao_missing:
        rows["note"] = {"torchao": f"{NOT_AVAILABLE}: {torchao_missing}"}
    return rows


def linear_row(
    m: int, k: int, n: int, budget: Budget, torchao_missing: str | None
) -> dict[str, Any]:
    """One shape: ms per step of every variant (about half a second of timed steps each after
    three warm-up steps, compilation included there), then the ratios."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    base = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    variants: dict[str, Callable[[], Step]] = {
        BF16: lambda: training_step(base, x, dy, None),
        "bf16 compiled": lambda: training_step(compiled(base), x, dy, None),
        "fp8kit delayed": lambda: training_step(fp8_linear_like(base), x, dy, DELAYED),
        "fp8kit delayed compiled": lambda: training_step(
            compiled(fp8_linear_like(base)), x, dy, DELAYED
        ),
        "fp8kit current": lambda: training_step(fp8_linear_like(base), x, dy, CURRENT),
        "fp8kit current compiled": lambda: training_step(
            compiled(fp8_linear_like(base)), x, dy, CURRENT
        ),
        "torchao compiled": lambda: training_step(compiled(torchao_linear_like(base)), x, dy, None),
        "torchao eager": lambda: training_step(torchao_linear_like(base), x, dy, None),
        FLOOR: lambda: floor_step(m, k, n),
    }
    row: dict[str, Any] = {}
    for name, make in variants.items():
        if name in TORCHAO_VARIANTS and torchao_missing:
            row[name] = NOT_AVAILABLE
        elif budget.spent():
            row[name] = budget.skip_note()
        else:
            row[name] = cell(lambda make=make: round(cuda_time_ms(make(), target_ms=500.0), 3))
    return with_ratios(row, {"floor": FLOOR, "bf16": BF16})


def print_linear(rows: dict[str, Any]) -> None:
    """Three tables: ms, ratio to the floor, ratio to bf16 (rows: shapes)."""
    shapes = {name: row for name, row in rows.items() if isinstance(row, dict) and name != "note"}
    for title, suffix in (("ms per step", ""), ("/ floor", " / floor"), ("/ bf16", " / bf16")):
        table = {}
        for shape, row in shapes.items():
            if suffix:
                table[shape] = {k[: -len(suffix)]: v for k, v in row.items() if k.endswith(suffix)}
            else:
                table[shape] = {k: v for k, v in row.items() if " / " not in k}
        print(f"\nLinear training step, {title}:\n")
        print(render_table(table, "M x K x N"))
    for name, row in rows.items():
        if not isinstance(row, dict) or name == "note":
            print(f"{name}: {row if not isinstance(row, dict) else json.dumps(row)}")
    if "note" in rows:
        print(f"note: {json.dumps(rows['note'])}")


# ---------------------------------------------------------------------------------------------
# 2. Tiny step


def tiny_section(budget: Budget) -> dict[str, Any]:
    """``{"steps": {variant: {"wall us", "kernels", "copies", "aten", "aten top-level",
    "wall / bf16"}}, "stacked": {"layers", "bf16 ms", "fp8kit delayed ms", "extra ms per
    layer"}}``."""
    torch.manual_seed(0)
    x = torch.randn(TINY, TINY, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TINY, TINY, device="cuda", dtype=torch.bfloat16)
    base = nn.Linear(TINY, TINY, device="cuda", dtype=torch.bfloat16)
    torchao_missing = torchao_problem()
    variants: dict[str, Callable[[], Step]] = {
        "bf16 nn.Linear": lambda: training_step(base, x, dy, None),
        "fp8kit delayed": lambda: training_step(fp8_linear_like(base), x, dy, DELAYED),
        "fp8kit current": lambda: training_step(fp8_linear_like(base), x, dy, CURRENT),
        "torchao eager": lambda: training_step(torchao_linear_like(base), x, dy, None),
        "torchao compiled": lambda: training_step(compiled(torchao_linear_like(base)), x, dy, None),
        "bf16 CUDA graph": lambda: training_step(
            graphed(copy.deepcopy(base), (x,), None), x, dy, None
        ),
        "fp8kit delayed CUDA graph": lambda: training_step(
            graphed(fp8_linear_like(base), (x,), DELAYED), x, dy, DELAYED
        ),
    }
    rows: dict[str, Any] = {}
    for name, make in variants.items():
        if name in TORCHAO_VARIANTS and torchao_missing:
            rows[name] = NOT_AVAILABLE
        elif budget.spent():
            rows[name] = budget.skip_note()
        else:
            rows[name] = cell(lambda make=make: _tiny_row(make()))
    reference = rows["bf16 nn.Linear"]
    for row in rows.values():
        if isinstance(row, dict) and isinstance(reference, dict):
            row["wall / bf16"] = round(row["wall us"] / reference["wall us"], 2)
    stacked = budget.skip_note() if budget.spent() else cell(_stack_row)
    return {"steps": rows, "stacked": stacked}


def _tiny_row(step: Step) -> dict[str, Any]:
    counts = profile_counts(step)
    return {"wall us": round(wall_us(step), 1), **counts}


def _stack_row() -> dict[str, float]:
    """ms per step of ``STACK_DEPTH`` Linear(256) layers, bf16 vs fp8kit delayed."""
    x = torch.randn(TINY, TINY, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TINY, TINY, device="cuda", dtype=torch.bfloat16)
    out: dict[str, float] = {"layers": STACK_DEPTH}
    for name, layer, recipe in (
        ("bf16 ms", nn.Linear, None),
        ("fp8kit delayed ms", f8.Linear, DELAYED),
    ):
        model = nn.Sequential(
            *(layer(TINY, TINY, device="cuda", dtype=torch.bfloat16) for _ in range(STACK_DEPTH))
        )
        out[name] = round(wall_us(training_step(model, x, dy, recipe), warmup=3) / 1e3, 2)
    out["extra ms per layer"] = round((out["fp8kit delayed ms"] - out["bf16 ms"]) / STACK_DEPTH, 3)
    return out


# ---------------------------------------------------------------------------------------------
# 3. Host syncs


def _sync_models() -> dict[str, Callable[[], nn.Module]]:
    kw: dict[str, Any] = {"device": "cuda", "dtype": torch.bfloat16}
    return {
        "Linear": lambda: f8.Linear(1024, 1024, **kw),
        "LayerNormLinear+Linear+LayerNormMLP": lambda: nn.Sequential(
            f8.LayerNormLinear(1024, 1024, **kw),
            f8.Linear(1024, 1024, **kw),
            f8.LayerNormMLP(1024, 4096, **kw),
        ),
    }


def sync_section(budget: Budget) -> dict[str, Any]:
    """``{"<model> <recipe>": {"first step", "steady step", "error mode"}}``: syncs counted on a
    fresh model's first step and on its fifth; the sixth runs under ``"error"``."""
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    rows: dict[str, Any] = {}
    for model_name, make in _sync_models().items():
        for recipe_name, recipe in (("delayed", DELAYED), ("current", CURRENT)):
            name = f"{model_name} {recipe_name}"
            if budget.spent():
                rows[name] = budget.skip_note()
                continue

            def measure(make: Callable[[], nn.Module] = make, recipe: Any = recipe) -> dict:
                step = training_step(make(), x, dy, recipe)
                first = count_syncs(step)
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                steady = count_syncs(step)
                return {"first step": first, "steady step": steady, "error mode": strict_step(step)}

            rows[name] = cell(measure)
    return rows


# ---------------------------------------------------------------------------------------------
# 4. Cast bandwidth


def cast_section(budget: Budget) -> dict[str, Any]:
    """GB/s (bytes read + written: input once, each FP8 output once) of ``copy_`` and of
    fp8kit's casts for 64M bfloat16 / float32 elements, and each cast's fraction of the copy's."""
    e4m3 = torch.float8_e4m3fn
    rows: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(8192, CAST_ELEMENTS // 8192, device="cuda", dtype=dtype)
        buf = torch.empty_like(x)
        scale = torch.full((), 0.5, device="cuda")
        size = x.numel() * x.element_size()
        variants: dict[str, tuple[Step, int]] = {
            "copy_": (lambda x=x, buf=buf: buf.copy_(x), 2 * size),
            "f8.quantize": (lambda x=x, s=scale: f8.quantize(x, s, e4m3), size + x.numel()),
            # current scaling reads x twice (its amax, then the cast): both reads are counted
            "f8.quantize_current": (
                lambda x=x: f8.quantize_current(x, e4m3),
                2 * size + x.numel(),
            ),
            "cast+transpose (kernels.cast_fp8)": (
                lambda x=x, s=scale: kernels_cast_transpose(x, s, e4m3),
                size + 2 * x.numel(),
            ),
            "f8.quantize_current transpose": (
                lambda x=x: f8.quantize_current(x, e4m3, transpose=True),
                2 * size + 2 * x.numel(),
            ),
        }
        row: dict[str, Any] = {}
        for name, (step, moved) in variants.items():
            if budget.spent():
                row[f"{name} GB/s"] = budget.skip_note()
                continue
            # kernels alone (kernel_ms): a call's host work (tens of us on the H200's host)
            # must not count as device time in a bandwidth
            row[f"{name} GB/s"] = cell(
                lambda step=step, moved=moved: round(moved / kernel_ms(step) / 1e6, 1)
            )
        copy = row["copy_ GB/s"]
        for name in variants:
            value = row[f"{name} GB/s"]
            if name != "copy_" and is_number(value) and is_number(copy):
                row[f"{name} / copy"] = round(value / copy, 2)
        rows[str(dtype).removeprefix("torch.")] = row
        del x, buf
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# 5. GPT throughput


GPT_VARIANTS = (  # (name, recipe, mode of gpt_training_step, the bf16 variant it is compared with)
    (BF16, None, "eager", BF16),
    ("fp8kit delayed", DELAYED, "eager", BF16),
    ("fp8kit current", CURRENT, "eager", BF16),
    ("bf16 compiled", None, "compiled", "bf16 compiled"),
    ("fp8kit delayed compiled", DELAYED, "compiled", "bf16 compiled"),
    # last: a capture that fails could leave the process's CUDA state unusable
    ("bf16 CUDA graph", None, "graphed", "bf16 CUDA graph"),
    ("fp8kit delayed CUDA graph", DELAYED, "graphed", "bf16 CUDA graph"),
)


def gpt_section(sizes: list[str], budget: Budget) -> dict[str, Any]:
    """``{size: {variant: {"tokens/s", "peak GiB", "vs bf16"}}}`` for the :data:`GPT_SIZES`
    named in ``sizes`` (bf16 = the same model with FP8 off: ``torch.autocast`` bf16 only; a
    graphed or compiled variant is compared with bf16 run the same way)."""
    rows: dict[str, Any] = {}
    for size in sizes:
        config, batch = GPT_SIZES[size]
        row: dict[str, Any] = {}
        for variant, recipe, mode, _ in GPT_VARIANTS:
            if budget.spent():
                row[variant] = budget.skip_note()
                continue
            row[variant] = cell(
                lambda c=config, b=batch, r=recipe, m=mode: gpt_throughput(c, b, r, m)
            )
            gc.collect()
            torch.cuda.empty_cache()
        for variant, recipe, _, reference_name in GPT_VARIANTS:
            value, reference = row[variant], row[reference_name]
            if recipe is not None and isinstance(value, dict) and isinstance(reference, dict):
                value["vs bf16"] = round(value["tokens/s"] / reference["tokens/s"], 2)
        rows[size] = row
    return rows


def gpt_throughput(
    config: GPTConfig, batch: int, recipe: Any, mode: str = "eager"
) -> dict[str, Any]:
    """Tokens/s over ``GPT_STEPS[1]`` AdamW steps after ``GPT_STEPS[0]`` warm-up steps, and the
    peak allocated GiB of those steps (``torch.cuda.max_memory_allocated``); ``mode`` as
    :func:`~benchmarks.gpu_measure.gpt_training_step` (``"compiled"``: the FP8 modules trace
    into torch.compile's graphs; ``"graphed"``: the whole model, loss included, in CUDA graphs,
    captured before the warm-up steps)."""
    step, model = gpt_training_step(config, batch, recipe, mode)
    warmup, timed = GPT_STEPS
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(timed):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "tokens/s": round(timed * batch * config.block_size / seconds),
        "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "params M": round(model.num_parameters() / 1e6, 1),
    }


# ---------------------------------------------------------------------------------------------
# 6. Sub-benchmarks


def sub_section(out_path: str, saved: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Each ``benchmarks.<name>.main(path)`` of :data:`SUB_BENCHMARKS`; a module that raises
    ImportError is noted as skipped, one that fails holds its error. ``saved`` gets the results
    so far after each module (a time limit keeps them)."""
    gc.collect()
    torch.cuda.empty_cache()  # give the cached blocks back before JAX / Keras allocate
    results: dict[str, Any] = {}
    for name in SUB_BENCHMARKS:
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except Exception as exc:  # JAX / Keras may fail to import in other ways than ImportError
            results[name] = f"skipped: {type(exc).__name__}: {exc}"
            print(f"\n{name}: skipped: {exc}")
            continue
        print(f"\n## {name}\n", flush=True)
        path = sub_result_path(out_path, name)
        results[name] = cell(lambda module=module, path=path: module.main(path))
        saved(results)
    return results


# ---------------------------------------------------------------------------------------------


def print_section(name: str, result: Any) -> None:
    """A section's tables (the Linear one split by unit, the tiny step apart from the stack)."""
    if not isinstance(result, dict):
        print(result)
    elif name == "linear":
        print_linear(result)
    elif name == "tiny":
        print("\n" + render_table(result["steps"], f"Linear({TINY}) step"))
        print("\n" + render_table({"stacked": result["stacked"]}))
    else:
        print("\n" + render_table(result))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="bench-gpu.json", help="JSON results path")
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections, of: {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--quick", action="store_true", help="three Linear shapes and the small GPT only"
    )
    parser.add_argument(
        "--gpt",
        choices=tuple(GPT_CHOICES),
        default=None,
        help="GPT sizes to time (default: all, small with --quick)",
    )
    parser.add_argument(
        "--budget-scale",
        type=float,
        default=1.0,
        help="multiply every section's time budget (default budgets target ~8 minutes in all)",
    )
    args = parser.parse_args(argv)
    try:
        args.sections = parse_sections(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.budget_scale > 0:
        parser.error(f"--budget-scale must be > 0, got {args.budget_scale}")
    args.gpt_sizes = GPT_CHOICES[args.gpt or ("small" if args.quick else "all")]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the chosen sections, print their tables, save the JSON after each; ``{}`` and a
    message without CUDA."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return {}
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    results: dict[str, Any] = {"environment": environment(), "seconds": {}}
    shown = {k: v for k, v in results["environment"].items() if "recipe" not in k}
    print("environment: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    print("recipes: f8.DelayedScaling() and f8.Float8CurrentScaling() defaults (JSON: environment)")
    runners: dict[str, Callable[[Budget], Any]] = {
        "linear": lambda b: linear_section(QUICK_SHAPES if args.quick else SHAPES, b),
        "tiny": tiny_section,
        "syncs": sync_section,
        "cast": cast_section,
        "gpt": lambda b: gpt_section(args.gpt_sizes, b),
    }
    for name in args.sections:
        start = time.perf_counter()
        if name == "sub":
            results[name] = sub_section(
                args.out, lambda sub: _save(args.out, {**results, "sub": sub})
            )
        else:
            budget = Budget(name, SECTION_BUDGET_S[name] * args.budget_scale)
            print(f"\n## {name}", flush=True)
            results[name] = cell(lambda run=runners[name], budget=budget: run(budget))
            print_section(name, results[name])
        results["seconds"][name] = round(time.perf_counter() - start, 1)
        print(f"({name}: {results['seconds'][name]} s)", flush=True)
        # A Triton failure switches fp8kit's CUDA casts to torch for the rest of the process:
        # say so next to the figures it affects.
        results.setdefault("triton off after", {})[name] = kernels.triton_error()
        if kernels.triton_error() is not None:
            print(
                f"WARNING: fp8kit's Triton kernels are off ({kernels.triton_error()}); "
                "fp8kit figures from here on time its torch kernels",
                flush=True,
            )
        _save(args.out, results)  # after every section: a timeout keeps the rest
    print(f"\nsaved {args.out}")
    return results


def _save(path: str, results: dict[str, Any]) -> None:
    """Write ``results`` as JSON to ``path`` (its folder created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
