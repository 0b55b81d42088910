"""The bookkeeping of ``make bench-gpu`` that needs no GPU: section names and time budgets,
repeat counts, ratio columns, table rendering, profiler event counts, result paths.

Kept apart from :mod:`benchmarks.gpu` (which measures) so that it is unit-tested on the CPU
(``tests/test_benchmarks.py``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import markdown_table

SECTIONS = ("linear", "tiny", "syncs", "cast", "gpt", "sub")
NOT_AVAILABLE = "n/a"

# Seconds each section may start new cells in (a cell already running finishes, so a section can
# overrun by one cell). The torch sections add up to ~6 minutes, leaving ~2 minutes of the
# 8-minute target to the sub-benchmarks (which have no budget of their own); the Linear table is
# mostly torch.compile time (4 compiled variants per shape). ``--budget-scale`` stretches all.
SECTION_BUDGET_S = {"linear": 180.0, "tiny": 45.0, "syncs": 20.0, "cast": 20.0, "gpt": 160.0}


def parse_sections(text: str) -> list[str]:
    """``"linear,tiny"`` -> ``["linear", "tiny"]`` in :data:`SECTIONS` order.

    Raises:
        ValueError: an empty list or a name outside :data:`SECTIONS` (the message names
            ``--only`` and the allowed values).
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise ValueError(
            f"--only: unknown or empty section list {text!r}; allowed: {', '.join(SECTIONS)}"
        )
    return [name for name in SECTIONS if name in names]


class Budget:
    """A wall-clock allowance of ``seconds`` starting now; ``clock`` returns seconds."""

    def __init__(
        self, name: str, seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not seconds > 0:
            raise ValueError(f"budget seconds for {name!r} must be > 0, got {seconds!r}")
        self.name = name
        self.seconds = seconds
        self._clock = clock
        self._start = clock()

    def elapsed(self) -> float:
        """Seconds since the budget started."""
        return self._clock() - self._start

    def spent(self) -> bool:
        """True once the allowance is used up: start no new cell."""
        return self.elapsed() >= self.seconds

    def skip_note(self) -> str:
        """The cell text for work skipped because the budget ran out."""
        return f"skipped: {self.name} budget of {self.seconds:.0f} s spent"


def repeats_for(sample_ms: float, target_ms: float = 1000.0, lo: int = 10, hi: int = 100) -> int:
    """Timed repeats so that one cell measures for about ``target_ms``, clamped to [lo, hi].

    ``sample_ms``: the duration of one run (ms, > 0; a non-positive or non-finite sample gives
    ``hi``).
    """
    if not (sample_ms > 0 and math.isfinite(sample_ms)):
        return hi
    return max(lo, min(hi, int(target_ms / sample_ms)))


_HOLD_CYCLES = 5_000_000  # a few milliseconds of GPU clock: longer than one call's host work


def kernel_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the GPU (one pair of CUDA events per call), its kernels
    alone: a sleep kernel holds the stream while the host launches them, so the start event
    fires when they are queued (without it, an idle GPU timed the host's launch work too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_HOLD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cell(fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``"error: <type>: <message>"``: one failing variant must not end a table."""
    try:
        return fn()
    except Exception as exc:  # recorded in the table instead
        message = " ".join(str(exc).split())[:160]
        return f"error: {type(exc).__name__}: {message}"


def is_number(value: Any) -> bool:
    """A measured figure (int or float, not bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def with_ratios(row: Mapping[str, Any], references: Mapping[str, str]) -> dict[str, Any]:
    """``row`` plus, for every numeric entry ``v`` and reference ``label -> key`` with a numeric
    ``row[key]``, an entry ``"<name> / <label>"`` = ``v / row[key]`` rounded to 2 decimals
    (the reference itself gets none).

    A missing or non-numeric reference (an error string, "n/a") adds no ratio for it.
    """
    out = dict(row)
    for label, key in references.items():
        ref = row.get(key)
        if not is_number(ref) or ref == 0:
            continue
        for name, value in row.items():
            if is_number(value) and name != key:
                out[f"{name} / {label}"] = round(value / ref, 2)
    return out


def flatten(row: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one level with ``"outer: inner"`` keys; a non-dict becomes ``{"": v}``."""
    if not isinstance(row, Mapping):
        return {prefix: row}
    out: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}: {key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def format_value(value: Any) -> str:
    """A table cell: floats with 3 significant decimals at most, others as ``str``."""
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2e}"
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def render_table(rows: Mapping[str, Any], first: str = "") -> str:
    """Markdown table of ``{row name: row}``: one column per key seen in any flattened row."""
    flat = {name: flatten(row) for name, row in rows.items()}
    columns: list[str] = []
    for row in flat.values():
        columns += [key for key in row if key not in columns]
    body = [[name, *(format_value(row.get(c, "")) for c in columns)] for name, row in flat.items()]
    return markdown_table([first, *(c or "value" for c in columns)], body)


def transpose(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{row: {column: v}}`` -> ``{column: {row: v}}`` (column order of first appearance)."""
    out: dict[str, dict[str, Any]] = {}
    for row_name, row in rows.items():
        for column, value in row.items():
            out.setdefault(column, {})[row_name] = value
    return out


_COPY_ACTIVITIES = ("gpu_memcpy", "gpu_memset")


def device_event_kind(event: Any) -> str | None:
    """``"kernel"``, ``"copy"`` (memcpy / memset) or ``"annotation"`` for a profiler event on the
    CUDA timeline, None for a host event. An annotation is a ``record_function`` range that the
    profiler also draws on the device timeline (compiled regions carry them): not a kernel."""
    if event.device_type != torch.autograd.DeviceType.CUDA:
        return None
    activity = getattr(event, "activity_type", None)
    if getattr(event, "is_user_annotation", False) or activity == "gpu_user_annotation":
        return "annotation"
    if activity in _COPY_ACTIVITIES or event.name.startswith(("Memcpy", "Memset")):
        return "copy"
    return "kernel"


def count_profile_events(events: Iterable[Any]) -> dict[str, int]:
    """Counts over ``torch.profiler`` function events of one step.

    Returns ``kernels`` (device kernels), ``copies`` (device memcpy / memset), ``aten`` (every
    ``aten::`` CPU op, nested ones included: the convention of the shared MEASUREMENTS table,
    35 for a CPU ``nn.Linear`` step) and ``aten top-level`` (``aten::`` ops with no ``aten::``
    ancestor, i.e. the calls made from Python or autograd).
    """
    counts = {"kernels": 0, "copies": 0, "aten": 0, "aten top-level": 0}
    for event in events:
        kind = device_event_kind(event)
        if kind == "kernel":
            counts["kernels"] += 1
        elif kind == "copy":
            counts["copies"] += 1
        elif kind is None and event.name.startswith("aten::"):
            counts["aten"] += 1
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            counts["aten top-level"] += int(parent is None)
    return counts


def sub_result_path(out_path: str, name: str) -> str:
    """Where sub-benchmark ``name`` saves its JSON, beside ``out_path``:
    ``o/gpu.json`` -> ``o/gpu.<name>.json`` (``.json`` added when ``out_path`` has no suffix)."""
    path = Path(out_path)
    return str(path.with_name(f"{path.stem}.{name}{path.suffix or '.json'}"))
