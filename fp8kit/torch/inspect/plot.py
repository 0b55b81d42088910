"""Plot inspector records with matplotlib (an optional dependency).

The figure is a plain ``matplotlib.figure.Figure`` rendered by the Agg canvas directly, so
plotting never touches pyplot or the process's matplotlib backend (a notebook's inline backend
stays as it is; docs/decisions/0243).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from fp8kit.torch.inspect.inspector import SlotStats

__all__ = ["plot_stats", "stats_figure"]

_LABELS = {
    "amax": ("amax (max |x|)", "log"),
    "scale": ("scale", "log"),
    "saturated": ("saturated (% of elements)", "percent"),
    "flushed": ("flushed to zero (% of elements)", "percent"),
    "snr_db": ("quantization SNR (dB)", "linear"),
}
_SLOT_ORDER = ("INPUT", "WEIGHT", "OUTPUT", "GRAD_OUTPUT", "GRAD_INPUT")


class _Mpl(NamedTuple):
    """The parts of matplotlib the plot uses (no pyplot)."""

    Figure: Any
    FigureCanvasAgg: Any
    Line2D: Any
    colormaps: Any


def _matplotlib() -> _Mpl:
    """matplotlib's figure, Agg canvas, line and colormap registry, imported on first use.

    matplotlib is optional (``fp8kit[demo]``), so it is imported here rather than at module
    level: ``import fp8kit.torch`` must work, and stay fast, without it.
    """
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError:
        raise RuntimeError(
            "plotting needs matplotlib, which is not installed: run `pip install matplotlib` "
            "(or `pip install fp8kit[demo]`)"
        ) from None
    return _Mpl(Figure, FigureCanvasAgg, Line2D, colormaps)


def _value(metric: str, v: float) -> float:
    kind = _LABELS[metric][1]
    if not math.isfinite(v) or (kind == "log" and v <= 0):
        return math.nan  # a gap in the line, never a bogus point
    return 100.0 * v if kind == "percent" else v


_FAMILIES = ("Blues", "Oranges", "Greens", "Reds", "Purples", "Greys")


def _kind(layer: str) -> str:
    """``"blocks.3.mlp.fc1"`` -> ``"blocks.*.mlp.fc1"``: the layer with its indices wildcarded.

    A path of indices only (``"0"``, ``"2.1"``: an ``nn.Sequential``'s children) is its own
    kind: wildcarding it would leave no name to tell its layers apart.
    """
    parts = layer.split(".")
    if all(part.isdigit() for part in parts):
        return layer
    return ".".join("*" if part.isdigit() else part for part in parts)


def _colors(colormaps: Any, layers: list[str]) -> tuple[dict[str, Any], list[tuple[str, Any]], str]:
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
            cmap = colormaps[family]
            n = len(members)
            for i, layer in enumerate(members):
                colors[layer] = cmap(0.45 + 0.5 * (i / (n - 1) if n > 1 else 1.0))
            entries.append((f"{kind} ({n})" if n > 1 else kind, cmap(0.8)))
        return colors, entries, "lighter: earlier layers, darker: later layers"
    cmap = colormaps["tab20" if len(layers) <= 20 else "viridis"]
    colors = {
        layer: cmap(i if len(layers) <= 20 else i / max(len(layers) - 1, 1))
        for i, layer in enumerate(layers)
    }
    return colors, [(layer, colors[layer]) for layer in layers], ""


def _isolated(values: Sequence[float]) -> list[bool]:
    """Which points have no finite neighbour: a line draws nothing there, so they get a marker
    (a layer sampled once, or a value between two gaps)."""
    finite = [math.isfinite(v) for v in values]
    return [
        f and not (i > 0 and finite[i - 1]) and not (i + 1 < len(finite) and finite[i + 1])
        for i, f in enumerate(finite)
    ]


def stats_figure(
    records: Sequence[SlotStats],
    *,
    metrics: Sequence[str] = ("amax", "scale"),
    slots: Sequence[str] | None = None,
    title: str | None = None,
) -> Any:
    """A ``matplotlib.figure.Figure``: one row per metric, one column per slot kind, one line
    per layer (arguments as in :func:`plot_stats`).

    The figure is not registered with pyplot: show it in a notebook by evaluating it, or save it
    with ``fig.savefig(path)``; nothing needs closing.
    """
    if isinstance(metrics, str):  # would be read letter by letter
        raise TypeError(
            f"metrics must be a sequence of metric names such as ('amax',), got {metrics!r}"
        )
    for m in metrics:
        if m not in _LABELS:
            raise ValueError(f"metrics must be a subset of {list(_LABELS)}, got {m!r}")
    present = {r.slot for r in records}
    if slots is None:
        slots = [s for s in _SLOT_ORDER if s in present] + sorted(present - set(_SLOT_ORDER))
    elif isinstance(slots, str):  # would be read letter by letter
        raise TypeError(f"slots must be a sequence of slot kinds such as ('INPUT',), got {slots!r}")
    elif records and set(slots) - present:
        raise ValueError(
            f"slots must be kinds the records hold ({sorted(present)}), got "
            f"{sorted(set(slots) - present)} among {list(slots)}"
        )
    if not records or not slots or not metrics:
        raise ValueError("nothing to plot: no records for the requested metrics and slots")
    layers = list(dict.fromkeys(r.layer for r in records))
    mpl = _matplotlib()
    colors, entries, note = _colors(mpl.colormaps, layers)
    fig = mpl.Figure(figsize=(4.3 * len(slots), 2.8 * len(metrics) + 0.9))
    mpl.FigureCanvasAgg(fig)  # attaches itself as fig.canvas: Agg rendering, no backend switch
    axes = fig.subplots(len(metrics), len(slots), squeeze=False, sharex=True)
    for row, metric in enumerate(metrics):
        label, kind = _LABELS[metric]
        for col, slot in enumerate(slots):
            ax = axes[row][col]
            for layer in layers:
                picked = [r for r in records if r.slot == slot and r.layer == layer]
                if picked:
                    values = [_value(metric, getattr(r, metric)) for r in picked]
                    ax.plot(
                        [r.step for r in picked],
                        values,
                        color=colors[layer],
                        linewidth=1.1,
                        marker="o",
                        markersize=3.5,
                        markevery=_isolated(values),
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
    handles = [mpl.Line2D([], [], color=c, linewidth=2.5) for _, c in entries]
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
    return fig


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
    A point with no finite neighbour (a layer sampled once) is drawn as a marker. Rendered with
    the Agg canvas directly: matplotlib's backend is left as it is.
    """
    fig = stats_figure(records, metrics=metrics, slots=slots, title=title)
    fig.savefig(path, dpi=110)
