"""The demo's charts: loss curves of every variant and the FP8 numerics of the delayed run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8kit.demo.train import RunResult
from fp8kit.torch.inspect import plot_stats

__all__ = [
    "inspected_run",
    "plot_fp8",
    "plot_losses",
    "plot_saturation_flush",
    "write_charts",
]

_COLORS = {
    "fp32": "#222222",
    "bf16": "#1f77b4",
    "fp8-delayed": "#d62728",
    "fp8-current": "#2ca02c",
}
_MARKERS = {"fp32": "o", "bf16": "s", "fp8-delayed": "^", "fp8-current": "D"}


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


def _train_dashes(index: int, count: int) -> tuple[float, tuple[float, float]]:
    """Dash pattern of variant ``index`` of ``count``: 4-point dashes, shifted per variant so
    that coinciding training curves show every variant's colour in turn instead of one blend."""
    return (4.0 * index, (4.0, 4.0 * max(count - 1, 1)))


def plot_losses(results: Sequence[RunResult], path: Path) -> None:
    """Validation loss (solid lines with markers) and smoothed training loss (thin dashed lines,
    same colour) of every variant; the right panel zooms on the second half of the run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    steps = max((len(r.train_loss) for r in results), default=1)
    window = max(1, steps // 25)
    zoom_from = steps // 2
    zoom_values: list[float] = []
    for i, r in enumerate(results):
        color = _COLORS.get(r.name)
        xs = list(range(1, len(r.train_loss) + 1))
        finite = [v if math.isfinite(v) else math.nan for v in r.train_loss]
        smooth = _smooth([v if math.isfinite(v) else 0.0 for v in finite], window)
        dashes = _train_dashes(i, len(results))
        # validation markers: a shape per variant, later variants smaller, so coinciding points
        # stay visible one inside the other
        marker = {"marker": _MARKERS.get(r.name, "o"), "markersize": max(8.5 - 1.3 * i, 4.0)}
        for ax, lo in ((axes[0], 0), (axes[1], zoom_from)):
            ax.plot(xs[lo:], smooth[lo:], color=color, linewidth=1.0, linestyle=dashes)
            pick = [(s, v) for s, v in r.val_loss if s >= lo]
            ax.plot(
                [s for s, _ in pick],
                [v for _, v in pick],
                color=color,
                linestyle="-",
                linewidth=1.8,
                label=r.label,
                **marker,
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
    variant_legend = axes[0].legend(loc="upper right", fontsize=9, title="variant (colour)")
    axes[0].add_artist(variant_legend)
    style = [
        plt.Line2D([], [], color="0.3", linestyle="-", marker="o", markersize=6, linewidth=1.8),
        plt.Line2D([], [], color="0.3", linestyle=(0, (4.0, 4.0)), linewidth=1.0),
    ]
    axes[0].legend(
        style,
        ["validation (held-out text)", "train (smoothed)"],
        loc="lower left",
        fontsize=9,
        title="line style",
    )
    fig.suptitle("Byte-level GPT on the same data: fp32 vs bf16 vs FP8")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_NUMERIC_ROWS = (
    ("saturated", "saturated\n(% of elements, log)"),
    ("flushed", "flushed to zero\n(% of elements, log)"),
    ("snr_db", "quantization SNR (dB)"),
)
_FAMILIES = ("Blues", "Oranges", "Greens", "Reds", "Purples", "Greys")


def _layer_colors(plt: Any, layers: Sequence[str]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """A colour per layer: one colour family per GEMM kind (``blocks.*.qkv``), lighter for
    earlier blocks; and one legend entry per kind."""
    kinds: dict[str, list[str]] = {}
    for layer in layers:
        kind = ".".join("*" if part.isdigit() else part for part in layer.split("."))
        kinds.setdefault(kind, []).append(layer)
    colors: dict[str, Any] = {}
    entries = []
    for k, (kind, members) in enumerate(kinds.items()):
        cmap = plt.get_cmap(_FAMILIES[k % len(_FAMILIES)])
        for j, layer in enumerate(members):
            colors[layer] = cmap(0.45 + 0.5 * (j / (len(members) - 1) if len(members) > 1 else 1))
        entries.append((f"{kind} ({len(members)})" if len(members) > 1 else kind, cmap(0.8)))
    return colors, entries


def _percent_axis(ax: Any, series: Sequence[Sequence[float]], what: str) -> float | None:
    """Log axis for percentages that may be tiny or zero; returns the floor zeros are drawn at.

    The floor is one decade below the smallest non-zero value and is labelled "0". When every
    value is zero nothing is plotted and the panel says so (returns None).
    """
    nonzero = [v for line in series for v in line if math.isfinite(v) and v > 0]
    if not nonzero:
        ax.set_ylim(-1, 1)
        ax.set_yticks([0])
        ax.set_yticklabels(["0"])
        ax.text(
            0.5,
            0.5,
            f"no element {what} at any sampled step (0%)",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            color="0.3",
        )
        return None
    low = math.floor(math.log10(min(nonzero))) - 1
    high = math.ceil(math.log10(max(nonzero) * 2.5))
    floor = 10.0**low
    ax.set_yscale("log")
    ax.set_ylim(floor / 1.6, 10.0**high)
    step = max(1, math.ceil((high - low) / 5))  # at most ~6 labelled decades, the floor always
    ax.set_yticks([10.0**e for e in range(low, high + 1, step)])
    ax.axhline(floor, color="0.6", linewidth=0.8, linestyle=":")
    formatter = ax.yaxis.get_major_formatter()

    def label(y: float, pos: int | None = None) -> str:
        return "0" if math.isclose(y, floor, rel_tol=1e-6) else formatter(y, pos)

    ax.yaxis.set_major_formatter(label)  # matplotlib wraps a function in a FuncFormatter
    return floor


def plot_saturation_flush(result: RunResult, path: Path, slots: Sequence[str]) -> None:
    """Saturated and flushed-to-zero percentages (log axis with a floor for zero, so tiny values
    stay readable) and the quantization SNR, per slot kind (columns) and GEMM (lines)."""
    plt = _pyplot()
    layers = list(dict.fromkeys(r.layer for r in result.stats))
    colors, entries = _layer_colors(plt, layers)
    fig, axes = plt.subplots(
        len(_NUMERIC_ROWS), len(slots), figsize=(4.4 * len(slots), 8.6), squeeze=False, sharex=True
    )
    for col, slot in enumerate(slots):
        picked = {
            layer: [r for r in result.stats if r.slot == slot and r.layer == layer]
            for layer in layers
        }
        picked = {layer: rows for layer, rows in picked.items() if rows}
        for row, (metric, ylabel) in enumerate(_NUMERIC_ROWS):
            ax = axes[row][col]
            scale = 1.0 if metric == "snr_db" else 100.0
            series = {
                layer: [scale * getattr(r, metric) for r in rows] for layer, rows in picked.items()
            }
            floor = None
            if metric != "snr_db":
                floor = _percent_axis(ax, list(series.values()), metric.replace("_", " "))
                if floor is None:
                    series = {}
            for layer, values in series.items():
                ys = [
                    (floor if floor is not None and v == 0 else v) if math.isfinite(v) else math.nan
                    for v in values
                ]
                ax.plot(
                    [r.step for r in picked[layer]],
                    ys,
                    color=colors[layer],
                    linewidth=1.1,
                    marker="." if len(ys) <= 60 else None,
                    markersize=3,
                )
            if row == 0:
                formats = sorted({r.fp8_format for rows in picked.values() for r in rows})
                ax.set_title(f"{slot} ({', '.join(formats)})")
            if col == 0:
                ax.set_ylabel(ylabel)
            if row == len(_NUMERIC_ROWS) - 1:
                ax.set_xlabel("training step")
            ax.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], color=c, linewidth=2.5) for _, c in entries]
    legend = fig.legend(
        handles,
        [name for name, _ in entries],
        loc="lower center",
        ncol=min(len(entries), 4),
        fontsize=9,
        frameon=False,
        title="lighter: earlier blocks, darker: later blocks; a 0 at the bottom of a log axis "
        "means no element at that step",
        title_fontsize=8,
    )
    fig.suptitle(f"{result.label}: saturated and flushed-to-zero elements, quantization SNR")
    fig.canvas.draw()
    legend_h = legend.get_window_extent().height / fig.bbox.height
    fig.tight_layout(rect=(0, legend_h + 0.01, 1, 1))
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
    plot_saturation_flush(result, second, slots)
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
