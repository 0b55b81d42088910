"""Plot inspector records with matplotlib (Agg backend; matplotlib is an optional dependency)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from fp8kit.torch.inspect.inspector import SlotStats

__all__ = ["plot_stats"]

_LABELS = {
    "amax": ("amax (max |x|)", "log"),
    "scale": ("scale", "log"),
    "saturated": ("saturated (% of elements)", "percent"),
    "flushed": ("flushed to zero (% of elements)", "percent"),
    "snr_db": ("quantization SNR (dB)", "linear"),
}
_SLOT_ORDER = ("INPUT", "WEIGHT", "OUTPUT", "GRAD_OUTPUT", "GRAD_INPUT")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plotting needs matplotlib, which is not installed: run `pip install matplotlib` "
            "(or `pip install fp8kit[demo]`)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _value(metric: str, v: float) -> float:
    kind = _LABELS[metric][1]
    if not math.isfinite(v) or (kind == "log" and v <= 0):
        return math.nan  # a gap in the line, never a bogus point
    return 100.0 * v if kind == "percent" else v


_FAMILIES = ("Blues", "Oranges", "Greens", "Reds", "Purples", "Greys")


def _kind(layer: str) -> str:
    """``"blocks.3.mlp.fc1"`` -> ``"blocks.*.mlp.fc1"``: the layer with its indices wildcarded."""
    return ".".join("*" if part.isdigit() else part for part in layer.split("."))


def _colors(plt: Any, layers: list[str]) -> tuple[dict[str, Any], list[tuple[str, Any]], str]:
    """A color per layer, legend entries, and a legend note.

    Repeated layers of a few kinds (``blocks.N.qkv`` ...) get one color family per kind, lighter
    for earlier layers and darker for later ones, so the legend needs one entry per kind.
    Anything else gets one distinct color per layer.
    """
    kinds: dict[str, list[str]] = {}
    for layer in layers:
        kinds.setdefault(_kind(layer), []).append(layer)
    if len(kinds) <= len(_FAMILIES) and any(len(v) > 1 for v in kinds.values()):
        colors: dict[str, Any] = {}
        entries = []
        for family, (kind, members) in zip(_FAMILIES, kinds.items(), strict=False):
            cmap = plt.get_cmap(family)
            n = len(members)
            for i, layer in enumerate(members):
                colors[layer] = cmap(0.45 + 0.5 * (i / (n - 1) if n > 1 else 1.0))
            entries.append((f"{kind} ({n})" if n > 1 else kind, cmap(0.8)))
        return colors, entries, "lighter: earlier layers, darker: later layers"
    cmap = plt.get_cmap("tab20" if len(layers) <= 20 else "viridis")
    colors = {
        layer: cmap(i if len(layers) <= 20 else i / max(len(layers) - 1, 1))
        for i, layer in enumerate(layers)
    }
    return colors, [(layer, colors[layer]) for layer in layers], ""


def plot_stats(
    records: Sequence[SlotStats],
    path: str | os.PathLike[str],
    *,
    metrics: Sequence[str] = ("amax", "scale"),
    slots: Sequence[str] | None = None,
    title: str | None = None,
) -> None:
    """Save a PNG grid: one row per metric, one column per slot kind, one line per layer.

    Args:
        records: inspector records.
        path: PNG file to write.
        metrics: rows, from ``amax``, ``scale``, ``saturated``, ``flushed``, ``snr_db``.
        slots: columns, slot kinds such as ``("INPUT", "WEIGHT", "GRAD_OUTPUT")`` (default:
            every kind present).
        title: figure title.

    amax and scale use a log axis; the saturated and flushed percentages a symmetric-log axis
    (linear below 0.001%), so a first-step spike does not hide the small fractions after it.
    """
    for m in metrics:
        if m not in _LABELS:
            raise ValueError(f"metrics must be a subset of {list(_LABELS)}, got {m!r}")
    present = {r.slot for r in records}
    if slots is None:
        slots = [s for s in _SLOT_ORDER if s in present] + sorted(present - set(_SLOT_ORDER))
    if not records or not slots or not metrics:
        raise ValueError("nothing to plot: no records for the requested metrics and slots")
    layers = list(dict.fromkeys(r.layer for r in records))
    plt = _pyplot()
    colors, entries, note = _colors(plt, layers)
    fig, axes = plt.subplots(
        len(metrics),
        len(slots),
        figsize=(4.3 * len(slots), 2.8 * len(metrics) + 0.9),
        squeeze=False,
        sharex=True,
    )
    for row, metric in enumerate(metrics):
        label, kind = _LABELS[metric]
        for col, slot in enumerate(slots):
            ax = axes[row][col]
            for layer in layers:
                picked = [r for r in records if r.slot == slot and r.layer == layer]
                if picked:
                    ax.plot(
                        [r.step for r in picked],
                        [_value(metric, getattr(r, metric)) for r in picked],
                        color=colors[layer],
                        linewidth=1.1,
                    )
            if kind == "log" and ax.has_data():
                ax.set_yscale("log")
            elif kind == "percent":
                ax.set_yscale("symlog", linthresh=1e-3)
                ax.set_ylim(bottom=0)
            if row == 0:
                ax.set_title(slot)
            if col == 0:
                ax.set_ylabel(label)
            if row == len(metrics) - 1:
                ax.set_xlabel("training step")
            ax.grid(True, alpha=0.3)
    handles = [plt.Line2D([], [], color=c, linewidth=2.5) for _, c in entries]
    ncol = min(len(entries), 4 if len(entries) <= 8 else 6)
    legend = fig.legend(
        handles,
        [name for name, _ in entries],
        loc="lower center",
        ncol=ncol,
        fontsize=9,
        frameon=False,
        title=note or None,
        title_fontsize=8,
    )
    if title:
        fig.suptitle(title)
    fig.canvas.draw()
    legend_h = legend.get_window_extent().height / fig.bbox.height
    fig.tight_layout(rect=(0, legend_h + 0.01, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
