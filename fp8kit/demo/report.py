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
    "TARGET_GAP_PERCENT",
    "RunInfo",
    "summary_rows",
    "write_report",
]

TARGET_GAP_PERCENT = 2.0


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
    quick: bool = False
    total_wall_s: float = 0.0
    load_after: tuple[float, float, float] | None = None


# ---------------------------------------------------------------------------------------------
# Summary numbers


def gap_percent(result: RunResult, baseline: RunResult | None) -> float:
    """Final validation loss relative to the baseline's, in percent (NaN without a baseline)."""
    if baseline is None or not math.isfinite(baseline.final_val_loss):
        return math.nan
    return 100.0 * (result.final_val_loss - baseline.final_val_loss) / baseline.final_val_loss


def _baseline(results: Sequence[RunResult]) -> RunResult | None:
    return next((r for r in results if r.name == "fp32"), None)


def summary_rows(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One dict per variant: final losses, gap to fp32, throughput and its ratio to fp32."""
    base = _baseline(results)
    rows = []
    for r in results:
        speed = (
            r.tokens_per_s / base.tokens_per_s if base is not None and base.tokens_per_s else None
        )
        rows.append(
            {
                "variant": r.name,
                "label": r.label,
                "steps": len(r.train_loss),
                "final_train_loss": r.final_train_loss,
                "final_val_loss": r.final_val_loss,
                "gap_to_fp32_percent": gap_percent(r, base),
                "tokens_per_s": r.tokens_per_s,
                "speed_vs_fp32": math.nan if speed is None else speed,
                "wall_s": r.wall_s,
                "diverged": r.diverged,
                "finite": all(math.isfinite(v) for v in r.train_loss)
                and all(math.isfinite(v) for _, v in r.val_loss),
            }
        )
    return rows


def target_verdicts(results: Sequence[RunResult]) -> list[tuple[str, bool, str]]:
    """``(variant, met, sentence)`` for each FP8 variant against the 2% / no-NaN targets."""
    base = _baseline(results)
    out = []
    for r in results:
        if not r.name.startswith("fp8"):
            continue
        gap = gap_percent(r, base)
        finite = r.diverged is None and math.isfinite(r.final_val_loss)
        if base is None:
            out.append((r.name, finite, f"{r.label}: no fp32 run to compare with"))
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
        w.writerow(["variant", "step", "lr_step_loss", "val_loss", "step_time_s", "inspected"])
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


def _fmt(v: float, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _stats_summary(result: RunResult) -> list[str]:
    """Worst values over the run per slot kind (after the first step, which uses scale 1)."""
    lines = []
    later = [r for r in result.stats if r.step > 0] or result.stats
    for slot in ("INPUT", "WEIGHT", "GRAD_OUTPUT"):
        picked = [r for r in later if r.slot == slot]
        if not picked:
            continue
        snr = [r.snr_db for r in picked if math.isfinite(r.snr_db)]
        lines.append(
            f"| {slot} | {picked[0].fp8_format} | {max(r.saturated for r in picked) * 100:.4f}% "
            f"| {max(r.flushed for r in picked) * 100:.4f}% "
            f"| {_fmt(min(snr) if snr else math.nan, '.1f')} "
            f"| {_fmt(statistics.median(snr) if snr else math.nan, '.1f')} |"
        )
    return lines


def render_report(results: Sequence[RunResult], info: RunInfo, charts: Sequence[Path]) -> str:
    """The Markdown text of ``report.md``."""
    m = info.model
    t = info.train
    lines = ["# fp8kit demo: training a small GPT in FP8", ""]
    if info.quick:
        lines += ["> `--quick` run: a tiny smoke test, its numbers mean nothing.", ""]
    verdicts = target_verdicts(results)
    if verdicts:
        all_met = all(met for _, met, _ in verdicts)
        lines.append(
            "**Targets "
            + ("met" if all_met else "NOT met")
            + f"** (FP8 final validation loss within {TARGET_GAP_PERCENT:g}% of fp32, "
            "no divergence, no NaN):"
        )
        lines += [f"- {'✅' if met else '❌'} {s}" for _, met, s in verdicts]
        lines.append("")
    lines += [
        "## Results",
        "",
        "| variant | final train loss | final val loss | gap to fp32 | tokens/s | speed vs fp32 "
        "| wall time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary_rows(results):
        gap = row["gap_to_fp32_percent"]
        gap_text = "—" if row["variant"] == "fp32" else _fmt(gap, "+.2f")
        if math.isfinite(gap) and row["variant"] != "fp32":
            gap_text += "%"
        lines.append(
            f"| {row['label']} | {_fmt(row['final_train_loss'], '.4f')} "
            f"| {_fmt(row['final_val_loss'], '.4f')} "
            f"| {gap_text} "
            f"| {_fmt(row['tokens_per_s'], ',.0f')} | {_fmt(row['speed_vs_fp32'], '.2f')}x "
            f"| {format_duration(row['wall_s'])} |"
        )
    lines += [
        "",
        f"Losses are cross-entropies in nats per byte. *Final train loss*: mean over the last 10% "
        f"of the steps. *Final val loss*: {t.eval_windows} held-out windows of "
        f"{m.block_size} bytes after the last step, evaluated in the variant's own arithmetic. "
        "*Gap*: (val loss − fp32 val loss) / fp32 val loss. *tokens/s*: tokens per step over the "
        "median step time (forward, backward, optimizer; evaluation and the steps the numerics "
        "inspector sampled are excluded). *Speed vs fp32*: tokens/s ratio, higher is faster. "
        "*Wall time*: the whole variant, evaluation and inspection included.",
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
            "amax history up to step k−1 (delayed scaling); step 0 uses scale 1.",
            "",
            "![amax and scale per layer](fp8_amax_scale.png)",
            "",
            "![saturation, flush to zero and SNR per layer](fp8_saturation_flush.png)",
            "",
            "Worst values over the run (step 0, quantized with scale 1, left out):",
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
        f"- CPU: {mach['cpu']} ({mach['cpu_count']} logical cores, vector capability "
        f"{mach['cpu_capability']})",
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
                "so timings are pessimistic"
                if max(load0[0], (after or load0)[0]) > 0.5 * (mach["cpu_count"] or 1)
                else ""
            )
        )
    lines += [
        f"- Total wall time of this run: {format_duration(info.total_wall_s)}",
        "",
        "## Files",
        "",
        "- `report.md`: this report",
        "- `loss.png`, `fp8_amax_scale.png`, `fp8_saturation_flush.png`: the charts",
        "- `metrics.csv`: per variant and step: training loss, validation loss (when evaluated), "
        "step time",
        "- `results.json`: the summary, settings, machine and all curves",
        "- `fp8_stats.csv`, `fp8_stats.json`: the inspector's per-step statistics of every FP8 "
        "slot (FP8 delayed scaling)",
        "",
        f"Reproduce: `python -m fp8kit.demo --steps {t.steps} --seed {t.seed}`"
        + (" --quick" if info.quick else "")
        + ".",
        "",
    ]
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
