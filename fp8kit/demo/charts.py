"""The demo's charts: loss curves of every variant and the FP8 numerics of the delayed run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8kit.demo.train import RunResult
from fp8kit.torch.inspect import plot_stats

__all__ = ["inspected_run", "plot_fp8", "plot_losses", "write_charts"]

_COLORS = {
    "fp32": "#222222",
    "bf16": "#1f77b4",
    "fp8-delayed": "#d62728",
    "fp8-current": "#2ca02c",
}


def inspected_run(results: Sequence[RunResult]) -> RunResult | None:
    """The FP8 delayed-scaling run, if it ran with the numerics inspector."""
    return next((r for r in results if r.name == "fp8-delayed" and r.stats), None)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start), NaN-free input assumed."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_losses(results: Sequence[RunResult], path: Path) -> None:
    """Training (smoothed) and validation loss of every variant; right panel zooms on the end."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    steps = max((len(r.train_loss) for r in results), default=1)
    window = max(1, steps // 25)
    zoom_from = steps // 2
    zoom_values: list[float] = []
    for r in results:
        color = _COLORS.get(r.name)
        xs = list(range(1, len(r.train_loss) + 1))
        finite = [v if math.isfinite(v) else math.nan for v in r.train_loss]
        smooth = _smooth([v if math.isfinite(v) else 0.0 for v in finite], window)
        vx = [s for s, _ in r.val_loss]
        vy = [v for _, v in r.val_loss]
        for ax, lo in ((axes[0], 0), (axes[1], zoom_from)):
            ax.plot(xs[lo:], smooth[lo:], color=color, linewidth=1.0, alpha=0.55)
            pick = [(s, v) for s, v in zip(vx, vy, strict=True) if s >= lo]
            ax.plot(
                [s for s, _ in pick],
                [v for _, v in pick],
                color=color,
                marker="o",
                markersize=4,
                linewidth=1.8,
                label=r.label,
            )
        zoom_values += smooth[zoom_from:] + [v for s, v in r.val_loss if s >= zoom_from]
    axes[0].set_title("loss over the whole run")
    axes[1].set_title(f"zoom: steps {zoom_from} to {steps}")
    finite_zoom = [v for v in zoom_values if math.isfinite(v)]
    if finite_zoom:
        lo, hi = min(finite_zoom), max(finite_zoom)
        pad = 0.05 * (hi - lo) if hi > lo else 0.05
        axes[1].set_ylim(lo - pad, hi + pad)
    for ax in axes:
        ax.set_xlabel("training step")
        ax.set_ylabel("cross-entropy (nats per byte)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(title="lines: train (smoothed)\ndots: validation", fontsize=9, title_fontsize=8)
    fig.suptitle("Byte-level GPT on the same data: fp32 vs bf16 vs FP8")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fp8(result: RunResult, out: Path) -> list[Path]:
    """Amax and scale per layer, and saturation / flush-to-zero / SNR per layer, over steps."""
    if not result.stats:
        return []
    slots = [
        s for s in ("INPUT", "WEIGHT", "GRAD_OUTPUT") if any(r.slot == s for r in result.stats)
    ]
    first = out / "fp8_amax_scale.png"
    plot_stats(
        result.stats,
        first,
        metrics=("amax", "scale"),
        slots=slots,
        title=f"{result.label}: amax (max |x| per step) and scale, per FP8 GEMM",
    )
    second = out / "fp8_saturation_flush.png"
    plot_stats(
        result.stats,
        second,
        metrics=("saturated", "flushed", "snr_db"),
        slots=slots,
        title=f"{result.label}: saturated and flushed-to-zero elements, quantization SNR",
    )
    return [first, second]


def write_charts(results: Sequence[RunResult], out: Path) -> list[Path]:
    """``loss.png`` and, when FP8 delayed scaling was inspected, its two numerics charts."""
    loss_png = out / "loss.png"
    plot_losses(results, loss_png)
    charts = [loss_png]
    fp8 = inspected_run(results)
    if fp8 is not None:
        charts += plot_fp8(fp8, out)
    return charts
