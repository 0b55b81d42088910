"""Command line of the demo: ``python -m fp8kit.demo`` / ``fp8kit demo`` / ``make demo``.

Bad input (``--corpus``, ``--out``, ``--steps``, ``--variants``, ``--device``, ...) ends with one
line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

import torch

from fp8kit.demo.charts import write_charts
from fp8kit.demo.corpus import DEFAULT_MAX_BYTES, Corpus, CorpusError, load_corpus
from fp8kit.demo.machine import choose_threads, load_average, machine_info
from fp8kit.demo.model import GPT, GPTConfig
from fp8kit.demo.precision import VARIANTS, bf16_slowdown, make_variant
from fp8kit.demo.progress import format_duration
from fp8kit.demo.report import OUTPUT_FILES, RunInfo, fmt_number, summary_rows, write_report
from fp8kit.demo.train import RunResult, TrainConfig, train_variant
from fp8kit.torch import gemm
from fp8kit.torch.quantization import quantize

__all__ = ["DEFAULT_OUT", "DEFAULT_STEPS", "DEVICES", "QUICK_OUT", "UsageError", "main"]

DEFAULT_OUT = "fp8kit-demo"
QUICK_OUT = "fp8kit-demo-quick"  # --quick never overwrites the full run's report
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_STEPS = 250
QUICK_STEPS = 6
MODEL = GPTConfig()
QUICK_MODEL = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, ffn_mult=2)
BF16_SLOW = 3.0  # bf16 matmul this many times slower than float32: emulate


class UsageError(Exception):
    """Invalid command-line input; the message is shown as is."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass(frozen=True)
class Options:
    """Validated command-line options."""

    steps: int
    variants: tuple[str, ...]
    out: Path
    seed: int
    quick: bool
    corpus: Path | None
    bf16: str
    threads: int | None
    device: str  # "cpu" or "cuda" (``--device auto`` resolved)
    command: str  # the command line that reproduces this run


def _parser(prog: str) -> _Parser:
    p = _Parser(
        prog=prog,
        description=(
            "Train a small byte-level GPT with fp8kit in fp32, bf16, FP8 delayed scaling and FP8 "
            "current scaling on the same data, and write a report with charts."
        ),
    )
    p.add_argument(
        "--steps",
        type=str,
        default=None,
        help=f"training steps per variant (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)",
    )
    p.add_argument(
        "--variants",
        type=str,
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)",
    )
    p.add_argument(
        "--out",
        type=str,
        default=None,
        help=f"output folder (default {DEFAULT_OUT}/, with --quick {QUICK_OUT}/)",
    )
    p.add_argument("--seed", type=str, default="0", help="seed of weights and data order")
    p.add_argument(
        "--quick", action="store_true", help="a tiny model and a few steps (a smoke test)"
    )
    p.add_argument(
        "--corpus",
        type=str,
        default=None,
        help="a text file or a folder of text files to train on (default: the Python "
        "standard library's sources)",
    )
    p.add_argument(
        "--bf16",
        choices=("auto", "native", "emulated"),
        default="auto",
        help="bf16 variant: torch.autocast, or rounding emulation where bf16 matmul is slow "
        "(auto: measure and decide)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where to train (auto: cuda when torch.cuda.is_available(), else cpu)",
    )
    p.add_argument(
        "--threads",
        type=str,
        default=None,
        help="torch CPU threads (default: torch's on an idle machine, else 1; see docs/demo.md)",
    )
    return p


def _int(name: str, text: str, minimum: int, maximum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{name} must be an integer, got {text!r}") from None
    if not minimum <= value <= maximum:
        raise UsageError(f"{name} must be between {minimum} and {maximum}, got {value}")
    return value


def _variants(text: str) -> tuple[str, ...]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise UsageError(f"--variants must name at least one of {', '.join(VARIANTS)}")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise UsageError(
            f"--variants: unknown variant {unknown[0]!r} (choose from {', '.join(VARIANTS)})"
        )
    if len(set(names)) != len(names):
        raise UsageError(f"--variants lists a variant twice: {text!r}")
    return tuple(v for v in VARIANTS if v in names)  # fixed order: fp32 first


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the current folder for a relative path)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def _output_folder(text: str) -> Path:
    """Check that ``--out`` can be written to, creating nothing (a run whose other inputs turn
    out to be bad must leave no folder behind; :func:`_make_output_folder` creates it)."""
    if not text.strip():
        raise UsageError("--out must not be empty")
    out = Path(text).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {text} exists and is not a folder")
    if out.is_dir():
        _prove_writable(out, text)
        return out
    base = _existing_ancestor(out)
    if not base.is_dir():
        raise UsageError(f"--out: cannot write to folder {text}: {base} is not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"--out: cannot write to folder {text}: {base} is not writable")
    return out


def _prove_writable(out: Path, text: str) -> None:
    """Create and delete a temporary file in the folder ``out`` (``text``: as the user typed)."""
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=".fp8kit-write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"--out: cannot write to folder {text}: {reason}") from None


def _make_output_folder(out: Path) -> None:
    """Create ``--out`` once every input is known to be valid, before training starts, and
    remove an earlier run's files from it (:data:`OUTPUT_FILES`; other files stay), so the
    folder never holds charts or statistics of another run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUT_FILES:
            (out / name).unlink(missing_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"--out: cannot write to folder {out}: {reason}") from None
    _prove_writable(out, str(out))


def _device(choice: str) -> str:
    """Resolve ``--device``: ``"cpu"`` or ``"cuda"``; asking for CUDA without it is an error."""
    available = torch.cuda.is_available()
    if choice == "auto":
        return "cuda" if available else "cpu"
    if choice == "cuda" and not available:
        raise UsageError(
            "--device cuda: CUDA is not available here (torch.cuda.is_available() is False); "
            "use --device cpu or --device auto"
        )
    return choice


def _command(prog: str, opts: Options, variants_given: bool) -> str:
    """The command line that reproduces the run (steps, seed and device spelled out)."""
    parts = [prog, "--steps", str(opts.steps), "--seed", str(opts.seed), "--device", opts.device]
    if variants_given:
        parts += ["--variants", ",".join(opts.variants)]
    if opts.corpus is not None:
        parts += ["--corpus", str(opts.corpus)]
    if opts.bf16 != "auto":
        parts += ["--bf16", opts.bf16]
    if opts.quick:
        parts.append("--quick")
    return " ".join(parts)


def parse_options(argv: list[str] | None, prog: str) -> Options:
    """Parse and validate ``argv``; raises :class:`UsageError` with a one-line message."""
    args = _parser(prog).parse_args(argv)
    default_steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    steps = default_steps if args.steps is None else _int("--steps", args.steps, 1, 1_000_000)
    seed = _int("--seed", args.seed, 0, 2**63 - 1)
    threads = None if args.threads is None else _int("--threads", args.threads, 1, 1024)
    variants = _variants(args.variants)
    corpus = None
    if args.corpus is not None:
        if not args.corpus.strip():
            raise UsageError("--corpus must not be empty")
        corpus = Path(args.corpus).expanduser()
        if not corpus.exists():
            raise UsageError(f"--corpus: no such file or folder: {args.corpus}")
    device = _device(args.device)
    out = _output_folder(
        args.out if args.out is not None else QUICK_OUT if args.quick else DEFAULT_OUT
    )
    opts = Options(
        steps, variants, out, seed, args.quick, corpus, args.bf16, threads, device, command=""
    )
    return replace(opts, command=_command(prog, opts, variants != VARIANTS))


def _train_config(opts: Options) -> TrainConfig:
    if opts.quick:
        return TrainConfig(
            steps=opts.steps,
            batch_size=4,
            warmup_steps=min(2, max(1, opts.steps // 10)),
            eval_every=max(1, opts.steps // 2),
            eval_windows=8,
            inspect_every=2,  # leaves steps that are not inspected for the tokens/s figure
            seed=opts.seed,
        )
    return replace(
        TrainConfig(),
        steps=opts.steps,
        # a tenth of a short run (at most the default): the cosine decay the report describes
        # then still happens
        warmup_steps=min(TrainConfig.warmup_steps, max(1, opts.steps // 10)),
        eval_every=min(TrainConfig.eval_every, opts.steps),
        seed=opts.seed,
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _decide_bf16(mode: str, wanted: bool, device: str = "cpu") -> tuple[str, str]:
    """``(mode, note for the report)`` of the bf16 variant on ``device`` ("cpu" or "cuda")."""
    if not wanted:
        return "native", "not run"
    if mode != "auto":
        return mode, (
            f"torch.autocast(device_type={device!r}, dtype=torch.bfloat16), chosen with "
            "--bf16 native"
            if mode == "native"
            else "emulated (chosen with --bf16 emulated): matmul operands, results and gradients "
            "rounded to bf16, float32 accumulation"
        )
    if device == "cuda":
        return "native", "torch.autocast(device_type='cuda', dtype=torch.bfloat16)"
    slow = bf16_slowdown()
    if slow > BF16_SLOW:
        return "emulated", (
            f"emulated: a bf16 matmul measured {slow:.0f}x slower than float32 on this CPU, so "
            "the bf16 variant rounds matmul operands, results and gradients to bf16 and "
            "accumulates in float32, which is what bf16 autocast computes (its tokens/s is "
            "therefore not a bf16 speed)"
        )
    return "native", (
        f"torch.autocast(device_type='cpu', dtype=torch.bfloat16) (bf16 matmul measured "
        f"{slow:.2f}x the float32 time on this CPU)"
    )


def _gemm_note(device: str = "cpu") -> str:
    """How the FP8 GEMMs run on ``device`` (for the report)."""
    if device == "cuda":
        return "`torch._scaled_mm` (cuBLASLt's FP8 GEMM on the GPU's FP8 tensor cores)"
    if gemm.cpu_gemm_backend() == "dequant":
        return (
            "fp8kit's CPU backend `dequant`: the FP8 operands are upcast to float32 (exact) and "
            "multiplied with float32 accumulation, then scaled by scale_inv_a * scale_inv_b: the "
            "same GEMM as `torch._scaled_mm`, whose CPU kernel is a slow reference kernel on "
            "some CPUs (docs/decisions/0001). `FP8KIT_CPU_GEMM=scaled_mm` selects `_scaled_mm`"
        )
    return "`torch._scaled_mm` (FP8KIT_CPU_GEMM=scaled_mm)"


def run(opts: Options) -> int:
    """Train every variant, write the outputs, print the summary. Returns the exit code.

    torch's thread count is restored afterwards (the demo may change it).
    """
    threads_before = torch.get_num_threads()
    try:
        return _run(opts)
    finally:
        torch.set_num_threads(threads_before)


def _threads(opts: Options) -> str:
    """Set torch's thread count for the run; returns the sentence for the report."""
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
        return f"{opts.threads} (--threads)"
    if opts.quick:
        return f"{torch.get_num_threads()} (--quick keeps torch's current setting)"
    threads, reason = choose_threads()
    torch.set_num_threads(threads)
    return reason


def _require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "the demo draws its charts with matplotlib, which is not installed: "
            "pip install 'fp8kit[demo]' (or pip install matplotlib)"
        )


def _run(opts: Options) -> int:
    started = time.perf_counter()
    _require_matplotlib()  # fail now, not after minutes of training
    threads_note = _threads(opts)
    machine = machine_info(opts.device)
    model_cfg = QUICK_MODEL if opts.quick else MODEL
    cfg = _train_config(opts)
    corpus: Corpus = load_corpus(
        opts.corpus,
        max_bytes=200_000 if opts.quick else DEFAULT_MAX_BYTES,
        min_bytes=model_cfg.block_size + 2,
    )
    bf16_mode, bf16_note = _decide_bf16(opts.bf16, "bf16" in opts.variants, opts.device)
    wants_fp8 = any(v.startswith("fp8") for v in opts.variants)
    variants = [make_variant(v, bf16_mode, opts.device) for v in opts.variants]
    _make_output_folder(opts.out)  # only now: a rejected run leaves no empty folder behind
    params = GPT(model_cfg).num_parameters()
    _say(
        f"fp8kit demo: {len(variants)} variant(s) x {cfg.steps} steps of "
        f"{cfg.batch_size}x{model_cfg.block_size} bytes, GPT with {params:,} parameters, "
        f"{torch.get_num_threads()} threads, device {opts.device}"
    )
    _say(f"corpus: {corpus.source}, {corpus.num_bytes:,} bytes; output: {opts.out}/")
    if wants_fp8:
        # builds / loads fp8kit's cast kernel before any timing
        quantize(torch.ones(64, device=opts.device), 1.0, torch.float8_e4m3fn)
    device = torch.device(opts.device)
    results = [
        train_variant(
            variant, model_cfg, cfg, corpus, inspect=variant.name == "fp8-delayed", device=device
        )
        for variant in variants
    ]
    recipes = {v.label: v.recipe.to_dict() for v in variants if v.recipe is not None}
    info = RunInfo(
        model=model_cfg,
        train=cfg,
        num_parameters=params,
        corpus_source=corpus.source,
        corpus_train_bytes=corpus.train.numel(),
        corpus_val_bytes=corpus.val.numel(),
        recipes=recipes,
        bf16_note=bf16_note,
        gemm_note=_gemm_note(opts.device) if wants_fp8 else "not run",
        threads_note=threads_note,
        machine=machine,
        device=opts.device,
        command=opts.command,
        quick=opts.quick,
        threads=torch.get_num_threads(),
    )
    charts = write_charts(results, opts.out)
    info.load_after = load_average()
    info.total_wall_s = time.perf_counter() - started
    write_report(results, info, opts.out, charts)
    _print_summary(results, opts.out, info.total_wall_s)
    return 0


def _print_summary(results: list[RunResult], out: Path, wall: float) -> None:
    print(f"{'variant':<22}{'val loss':>10}{'gap':>9}{'tokens/s':>11}{'vs fp32':>9}{'vs bf16':>9}")
    for row in summary_rows(results):
        print(
            f"{row['label']:<22}{fmt_number(row['final_val_loss'], '.4f'):>10}"
            f"{fmt_number(row['gap_to_fp32_percent'], '+.2f', '%'):>9}"
            f"{fmt_number(row['tokens_per_s'], ',.0f'):>11}"
            f"{fmt_number(row['speed_vs_fp32'], '.2f', 'x'):>9}"
            f"{fmt_number(row['speed_vs_bf16'], '.2f', 'x'):>9}"
        )
    print(f"report: {out / 'report.md'}  (total {format_duration(wall)})")


def main(argv: list[str] | None = None, prog: str = "python -m fp8kit.demo") -> int:
    """Entry point; returns the process exit code (2 for bad input)."""
    try:
        opts = parse_options(argv, prog)
        return run(opts)
    except (UsageError, CorpusError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
