"""Everything the demo writes: ``report.md``, the PNG charts and the metrics (CSV and JSON)."""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8kit.demo.charts import inspected_run
from fp8kit.demo.model import GPTConfig
from fp8kit.demo.progress import format_duration
from fp8kit.demo.train import RunResult, TrainConfig
from fp8kit.torch.inspect import DEFINITIONS, write_csv, write_json

__all__ = [
    "OUTPUT_FILES",
    "TARGET_GAP_PERCENT",
    "RunInfo",
    "fmt_number",
    "machine_was_busy",
    "speed_note",
    "summary_rows",
    "target_verdicts",
    "write_report",
]

TARGET_GAP_PERCENT = 2.0
OUTPUT_FILES = (
    "report.md",
    "metrics.csv",
    "results.json",
    "fp8_stats.csv",
    "fp8_stats.json",
    "loss.png",
    "fp8_amax_scale.png",
    "fp8_saturation_flush.png",
)
"""Every file a run may write into its folder (charts included); a new run removes them first,
so a folder never mixes two runs' files."""


@dataclass
class RunInfo:
    """The settings and environment of one demo run (for the report)."""

    model: GPTConfig
    train: TrainConfig
    num_parameters: int
    corpus_source: str
    corpus_train_bytes: int
    corpus_val_bytes: int
    recipes: dict[str, dict[str, Any]]
    bf16_note: str
    gemm_note: str
    threads_note: str
    machine: dict[str, Any]
    device: str = "cpu"
    command: str = "python -m fp8kit.demo"
    quick: bool = False
    total_wall_s: float = 0.0
    load_after: tuple[float, float, float] | None = None
    threads: int = 1  # torch threads the run trained with (its CPU share of load_after)


# ---------------------------------------------------------------------------------------------
# Summary numbers


def gap_percent(result: RunResult, baseline: RunResult | None) -> float:
    """Final validation loss relative to the baseline's, in percent (NaN without a baseline)."""
    if baseline is None or not math.isfinite(baseline.final_val_loss):
        return math.nan
    return 100.0 * (result.final_val_loss - baseline.final_val_loss) / baseline.final_val_loss


def _baseline(results: Sequence[RunResult], name: str = "fp32") -> RunResult | None:
    return next((r for r in results if r.name == name), None)


def _speed_ratio(result: RunResult, base: RunResult | None) -> float:
    """tokens/s of ``result`` over the baseline's; NaN without a baseline with a real speed."""
    if base is None or base.emulated or not base.tokens_per_s > 0:
        return math.nan
    return result.tokens_per_s / base.tokens_per_s


def summary_rows(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One dict per variant: final losses, gap to fp32, throughput and its ratios to fp32 and to
    bf16 (NaN where that variant did not run, or ran emulated so its speed is not real)."""
    base = _baseline(results)
    bf16 = _baseline(results, "bf16")
    rows = []
    for r in results:
        rows.append(
            {
                "variant": r.name,
                "label": r.label,
                "steps": len(r.train_loss),
                "final_train_loss": r.final_train_loss,
                "final_val_loss": r.final_val_loss,
                "gap_to_fp32_percent": gap_percent(r, base),
                "tokens_per_s": r.tokens_per_s,
                "speed_vs_fp32": _speed_ratio(r, base),
                "speed_vs_bf16": _speed_ratio(r, bf16),
                "emulated": r.emulated,
                "wall_s": r.wall_s,
                "diverged": r.diverged,
                "finite": all(math.isfinite(v) for v in r.train_loss)
                and all(math.isfinite(v) for _, v in r.val_loss),
            }
        )
    return rows


def target_verdicts(results: Sequence[RunResult]) -> list[tuple[str, bool | None, str]]:
    """``(variant, met, sentence)`` for each FP8 variant against the 2% / no-NaN targets.

    ``met`` is None when the comparison could not be made (no finite fp32 run): the run
    finished, but nothing says whether it is within 2% of fp32.
    """
    base = _baseline(results)
    out: list[tuple[str, bool | None, str]] = []
    for r in results:
        if not r.name.startswith("fp8"):
            continue
        gap = gap_percent(r, base)
        finite = r.diverged is None and math.isfinite(r.final_val_loss)
        if finite and not math.isfinite(gap):
            out.append(
                (
                    r.name,
                    None,
                    f"{r.label}: finished with finite losses (validation loss "
                    f"{r.final_val_loss:.4f}); the {TARGET_GAP_PERCENT:g}% gap to fp32 was not "
                    "checked: no fp32 run with a finite loss to compare with",
                )
            )
            continue
        met = finite and abs(gap) <= TARGET_GAP_PERCENT
        if not finite:
            why = f"did not finish with a finite loss ({r.diverged or 'NaN'})"
        else:
            why = (
                f"validation loss {r.final_val_loss:.4f} vs fp32 "
                f"{base.final_val_loss:.4f}: {gap:+.2f}% "
                f"({'within' if met else 'outside'} the {TARGET_GAP_PERCENT:g}% target)"
            )
        out.append((r.name, met, f"{r.label}: {why}"))
    return out


# ---------------------------------------------------------------------------------------------
# Metrics files


def _num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def write_metrics(results: Sequence[RunResult], info: RunInfo, out: Path) -> list[Path]:
    """``metrics.csv`` (one row per variant and step) and ``results.json`` (everything)."""
    csv_path = out / "metrics.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["variant", "step", "train_loss", "val_loss", "step_time_s", "inspected"])
        for r in results:
            val = dict(r.val_loss)
            if 0 in val:
                w.writerow([r.name, 0, "", val[0], "", ""])
            for i, (loss, t, insp) in enumerate(
                zip(r.train_loss, r.step_time, r.inspected, strict=True)
            ):
                w.writerow([r.name, i + 1, loss, val.get(i + 1, ""), t, int(insp)])
    json_path = out / "results.json"
    payload = {
        "summary": [{k: _num(v) for k, v in row.items()} for row in summary_rows(results)],
        "targets": [
            {"variant": n, "met": met, "detail": s} for n, met, s in target_verdicts(results)
        ],
        "model": info.model.to_dict(),
        "num_parameters": info.num_parameters,
        "training": info.train.__dict__,
        "recipes": info.recipes,
        "corpus": {
            "source": info.corpus_source,
            "train_bytes": info.corpus_train_bytes,
            "val_bytes": info.corpus_val_bytes,
        },
        "bf16": info.bf16_note,
        "fp8_gemm": info.gemm_note,
        "machine": info.machine,
        "load_average_at_end": info.load_after,
        "total_wall_s": info.total_wall_s,
        "quick": info.quick,
        "curves": {
            r.name: {
                "train_loss": [_num(v) for v in r.train_loss],
                "val_loss": [[s, _num(v)] for s, v in r.val_loss],
                "step_time_s": r.step_time,
            }
            for r in results
        },
    }
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, allow_nan=False)
        f.write("\n")
    return [csv_path, json_path]


# ---------------------------------------------------------------------------------------------
# report.md


def fmt_number(v: float | None, spec: str, suffix: str = "") -> str:
    """``format(v, spec) + suffix``, or ``"n/a"`` for None and NaN (a number not measured)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec) + suffix


def machine_was_busy(info: RunInfo) -> bool:
    """Whether other processes' 1-minute load average exceeded half the cores, at the start of
    the run or at its end: they then took CPU time from some variants and not from others. The
    end's load average includes the run's own work, which is taken off: up to ``info.threads``
    after minutes of training on the CPU, one thread (the host driving it) on a GPU."""
    start = info.machine.get("load_average_at_start")
    if start is None:
        return False
    others = start[0]
    if info.load_after is not None:
        own = info.threads if info.device == "cpu" else 1
        others = max(others, info.load_after[0] - own)
    return others > 0.5 * (info.machine.get("cpu_count") or 1)


_BUSY_NOTE = (
    "This machine was busy during the run (load average under Machine): the variants ran one "
    "after another while other processes came and went, so this run's tokens/s are not "
    "comparable between variants."
)


def speed_note(info: RunInfo) -> list[str]:
    """What the tokens/s figures of this run mean on its device, and what to expect elsewhere.

    No figures of other machines are quoted here: docs/benchmarks.md holds measured ones.
    """
    busy = [_BUSY_NOTE, ""] if machine_was_busy(info) else []  # its own paragraph
    if info.device == "cuda":
        gpu = info.machine.get("gpu") or "a CUDA GPU"
        return [
            *busy,
            f"This run trained on {gpu}. The FP8 GEMMs ran in `torch._scaled_mm` (cuBLASLt's "
            "FP8 GEMM); the bf16 variant is native `torch.autocast(device_type='cuda', "
            "dtype=torch.bfloat16)`. The FP8 variants keep float32 weights and activations "
            "around their FP8 GEMMs, and attention, the LM head and the optimizer run in "
            "float32, so *speed vs bf16* compares fp8kit as this demo uses it with a bf16 "
            "autocast model, not the two GEMM kernels. This model is small (a step is "
            f"{info.train.batch_size * info.model.block_size} tokens through GEMMs "
            f"{info.model.n_embd} to {info.model.ffn_mult * info.model.n_embd} wide): per-layer "
            "costs that do not shrink with the GEMM (the casts, the scale bookkeeping, kernel "
            "launches) weigh more than the GEMMs themselves, so do not read these figures as "
            "FP8's speed-up on large models. Measured numbers, with their machines: "
            "docs/benchmarks.md.",
        ]
    return [
        *busy,
        "This run trained on the CPU, where no FP8 arithmetic exists: the FP8 GEMMs ran as "
        "float32 GEMMs of exactly upcast FP8 operands (see *FP8 GEMM* under Setup), so each FP8 "
        "variant does the fp32 variant's work plus the casts, scale bookkeeping and upcasts, "
        "and on an otherwise idle CPU runs slower than fp32. Its *speed vs fp32* shows that "
        "overhead, not the speed of FP8 hardware; the numbers worth reading on a CPU are the "
        "losses. Whether a bf16 matmul beats float32 on a CPU depends on its units and on "
        "torch's kernels for them (AMX-BF16 usually does; AVX512-BF16 alone may not; this CPU: "
        f"{_bf16_units_text(info.machine)}); this run measured it (*bf16* under Setup). An "
        "emulated bf16 variant's tokens/s is not a bf16 speed, and *speed vs bf16* is then n/a; "
        "a native bf16 variant slower than fp32 makes *speed vs bf16* flatter FP8. On a GPU "
        "with FP8 tensor cores (Hopper, Ada), run with `--device cuda` (the default "
        "`--device auto` picks CUDA when it is there): the FP8 GEMMs then run on the tensor "
        "cores and the report compares tokens/s with native bf16. Expect FP8 to pay off on "
        "large GEMMs only; at this demo's size the per-layer overheads dominate on a GPU too. "
        "Measured numbers, with their machines: docs/benchmarks.md.",
    ]


def _bf16_units_text(machine: dict[str, Any]) -> str:
    units = machine.get("cpu_bf16_units")
    if units is None:
        return "unknown"
    return ", ".join(units) if units else "none listed in /proc/cpuinfo"


def _stats_summary(result: RunResult) -> list[str]:
    """Worst values over the run per slot kind (after the first step, which uses scale 1)."""
    lines = []
    later = [r for r in result.stats if r.step > 1] or result.stats
    for slot in ("INPUT", "WEIGHT", "GRAD_OUTPUT"):
        picked = [r for r in later if r.slot == slot]
        if not picked:
            continue
        snr = [r.snr_db for r in picked if math.isfinite(r.snr_db)]
        lines.append(
            f"| {slot} | {picked[0].fp8_format} | {max(r.saturated for r in picked) * 100:.4f}% "
            f"| {max(r.flushed for r in picked) * 100:.4f}% "
            f"| {fmt_number(min(snr) if snr else math.nan, '.1f')} "
            f"| {fmt_number(statistics.median(snr) if snr else math.nan, '.1f')} |"
        )
    return lines


def _target_lines(results: Sequence[RunResult]) -> list[str]:
    """The targets paragraph: met / NOT met / not checked, one line per FP8 variant."""
    verdicts = target_verdicts(results)
    if not verdicts:
        return []
    if any(met is False for _, met, _ in verdicts):
        head = "**Targets NOT met**"
    elif all(met for _, met, _ in verdicts):
        head = "**Targets met**"
    else:
        head = "**Targets not checked**: no fp32 run to compare with"
    marks = {True: "✅", False: "❌", None: "➖"}
    return [
        f"{head} (targets: FP8 final validation loss within {TARGET_GAP_PERCENT:g}% of fp32, "
        "no divergence, no NaN):",
        *(f"- {marks[met]} {sentence}" for _, met, sentence in verdicts),
        "",
    ]


def render_report(results: Sequence[RunResult], info: RunInfo, charts: Sequence[Path]) -> str:
    """The Markdown text of ``report.md``."""
    m = info.model
    t = info.train
    lines = ["# fp8kit demo: training a small GPT in FP8", ""]
    if info.quick:
        lines += ["> `--quick` run: a tiny smoke test, its numbers mean nothing.", ""]
    lines += _target_lines(results)
    lines += [
        "## Results",
        "",
        "| variant | final train loss | final val loss | gap to fp32 | tokens/s | speed vs fp32 "
        "| speed vs bf16 | wall time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary_rows(results):
        gap = row["gap_to_fp32_percent"]
        gap_text = "—" if row["variant"] == "fp32" else fmt_number(gap, "+.2f", "%")
        lines.append(
            f"| {row['label']} | {fmt_number(row['final_train_loss'], '.4f')} "
            f"| {fmt_number(row['final_val_loss'], '.4f')} | {gap_text} "
            f"| {fmt_number(row['tokens_per_s'], ',.0f')} "
            f"| {fmt_number(row['speed_vs_fp32'], '.2f', 'x')} "
            f"| {fmt_number(row['speed_vs_bf16'], '.2f', 'x')} "
            f"| {format_duration(row['wall_s'])} |"
        )
    lines += [
        "",
        f"Losses are cross-entropies in nats per byte. *Final train loss*: mean over the last 10% "
        f"of the steps. *Final val loss*: {t.eval_windows} held-out windows of "
        f"{m.block_size} bytes after the last step, evaluated in the variant's own arithmetic. "
        "*Gap*: (val loss − fp32 val loss) / fp32 val loss. *tokens/s*: tokens per step over the "
        "median step time (forward, backward, optimizer; evaluation and the steps the numerics "
        "inspector sampled are excluded). *Speed vs fp32 / vs bf16*: tokens/s ratio, higher is "
        "faster. *Wall time*: the whole variant, evaluation and inspection included. *n/a*: not "
        "measured in this run (the variant compared with did not run, or ran emulated, or the "
        "inspector sampled every step of the variant).",
        "",
        "### What the speed figures mean",
        "",
        *speed_note(info),
        "",
    ]
    for chart in charts:
        if chart.name == "loss.png":
            lines += ["![Loss curves of all variants](loss.png)", ""]
    fp8 = inspected_run(results)
    if fp8 is not None:
        lines += [
            "## FP8 delayed scaling: what the numerics inspector saw",
            "",
            f"Statistics of every FP8 cast, sampled every {t.inspect_every} steps by "
            "`fp8kit.torch.inspect.Inspector`, one line per GEMM (`blocks.N.qkv`, "
            "`blocks.N.proj`, `blocks.N.mlp.fc1`, `blocks.N.mlp.fc2`). INPUT and WEIGHT are "
            "E4M3 (forward), GRAD_OUTPUT is E5M2 (backward). The scale of step k comes from the "
            "amax history up to step k−1 (delayed scaling); step 1 uses scale 1.",
            "",
            "![amax and scale per layer](fp8_amax_scale.png)",
            "",
            "![saturation, flush to zero and SNR per layer](fp8_saturation_flush.png)",
            "",
            "Worst values over the run (step 1, quantized with scale 1, left out):",
            "",
            "| slot | format | max saturated | max flushed to zero | min SNR (dB) "
            "| median SNR (dB) |",
            "|---|---|---:|---:|---:|---:|",
            *_stats_summary(fp8),
            "",
            "Definitions: "
            + "; ".join(f"*{k}* = {DEFINITIONS[k]}" for k in ("saturated", "flushed", "snr_db"))
            + ".",
            "",
        ]
    lines += [
        "## Setup",
        "",
        f"- **Model**: decoder-only GPT, {m.n_layer} blocks, width {m.n_embd}, {m.n_head} heads, "
        f"MLP {m.ffn_mult * m.n_embd} (GELU), context {m.block_size} bytes, vocabulary "
        f"{m.vocab_size} (bytes), {info.num_parameters:,} parameters. Each block: "
        "`f8.LayerNormLinear` (qkv) → causal attention (`scaled_dot_product_attention`) → "
        "`f8.Linear` (projection), then `f8.LayerNormMLP`; residual connections around both.",
        "- **In FP8** (FP8 variants): the qkv, projection, fc1 and fc2 GEMMs, forward (fprop) and "
        "backward (dgrad, wgrad). **High precision**: embeddings, layer norms, attention, the "
        "LM head (tied to the token embedding: its logits feed the loss directly, and keeping "
        "it out of FP8 is common practice) and the loss.",
        f"- **Training**: {t.steps} steps of {t.batch_size} × {m.block_size} bytes, AdamW "
        f"(lr {t.lr:g}, betas 0.9/0.95, weight decay {t.weight_decay:g} on matrices), "
        f"{t.warmup_steps} warm-up steps then cosine decay to {t.min_lr_ratio:g} × lr, "
        f"gradient clipping at {t.grad_clip:g}, seed {t.seed}. Every variant starts from the "
        "same weights and sees the same batches in the same order.",
        f"- **Corpus**: {info.corpus_source}; {info.corpus_train_bytes:,} bytes for training, "
        f"{info.corpus_val_bytes:,} held out (the last 10%).",
        f"- **bf16**: {info.bf16_note}",
        f"- **FP8 GEMM**: {info.gemm_note}",
        "- **Recipes**:",
    ]
    for name, recipe in info.recipes.items():
        lines.append(f"  - {name}: `{json.dumps(recipe)}`")
    mach = info.machine
    load0 = mach.get("load_average_at_start")
    lines += [
        "",
        "## Machine",
        "",
        f"- Device: {info.device}"
        + (f" ({mach.get('gpu')}, CUDA {mach.get('cuda')})" if info.device == "cuda" else ""),
        f"- CPU: {mach['cpu']} ({mach['cpu_count']} logical cores, vector capability "
        f"{mach['cpu_capability']}, bf16 units: {_bf16_units_text(mach)})",
        f"- Threads: {info.threads_note}",
        f"- Software: torch {mach['torch']}, Python {mach['python']}, {mach['platform']}",
    ]
    if load0 is not None:
        after = info.load_after
        lines.append(
            f"- Load average (1/5/15 min) at start {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}"
            + (f", at end {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}" if after else "")
            + (
                f": other processes were competing for the {mach['cpu_count']} cores, "
                "so timings are pessimistic and not comparable between variants"
                if machine_was_busy(info)
                else ""
            )
        )
    lines += [
        f"- Total wall time of this run: {format_duration(info.total_wall_s)}",
        "",
        "## Files",
        "",
        "- `report.md`: this report",
        f"- {', '.join(f'`{c.name}`' for c in charts)}: the charts",
        "- `metrics.csv`: per variant and step: training loss, validation loss (when evaluated), "
        "step time",
        "- `results.json`: the summary, settings, machine and all curves",
    ]
    if fp8 is not None:
        lines.append(
            "- `fp8_stats.csv`, `fp8_stats.json`: the inspector's per-step statistics of every "
            "FP8 slot (FP8 delayed scaling)"
        )
    lines += ["", f"Reproduce: `{info.command}`.", ""]
    return "\n".join(lines)


def write_report(
    results: Sequence[RunResult], info: RunInfo, out: Path, charts: Sequence[Path]
) -> list[Path]:
    """The metrics files, the inspector's statistics and ``report.md``; returns their paths."""
    written = write_metrics(results, info, out)
    fp8 = inspected_run(results)
    if fp8 is not None:
        write_csv(fp8.stats, out / "fp8_stats.csv")
        write_json(fp8.stats, out / "fp8_stats.json")
        written += [out / "fp8_stats.csv", out / "fp8_stats.json"]
    report = out / "report.md"
    report.write_text(render_report(results, info, charts), encoding="utf-8")
    return [report, *written]
