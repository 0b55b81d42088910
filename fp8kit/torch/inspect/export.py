"""Write inspector records to CSV, JSON or TensorBoard (the latter only if it is installed)."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from fp8kit.torch.inspect.inspector import SlotStats

__all__ = ["DEFINITIONS", "METRICS", "write_csv", "write_json", "write_tensorboard"]

METRICS = ("amax", "scale", "saturated", "flushed", "snr_db", "nonfinite_events")
"""The per-step numbers written to TensorBoard (a non-finite value is left out: the
``nonfinite_events`` count shows an infinite amax)."""

DEFINITIONS = {
    "amax": "max |x| of the high-precision tensor, NaN ignored (max over the step's casts)",
    "scale": "factor x was multiplied by before the FP8 cast (the step's last cast)",
    "saturated": "count(|float32(x) * scale| > fmax) / numel",
    "flushed": "count(x != 0 and q == 0) / numel",
    "snr_db": "10 * log10(sum x^2 / sum (x - dequantized q)^2) over finite x; inf = exact",
    "casts": "number of casts into the slot during the step",
    "numel": "elements cast into the slot during the step (denominator of the fractions)",
    "nonfinite_events": "update events so far whose amax was infinite (the scale kept then)",
    "direction": "forward (INPUT, WEIGHT, OUTPUT slots) or backward (GRAD_OUTPUT, GRAD_INPUT)",
    "fp8_format": "the FP8 format of the slot's casts (E4M3 or E5M2)",
}

_COLUMNS = tuple(f.name for f in fields(SlotStats))


def _json_number(value: Any) -> Any:
    """Finite floats as numbers; inf / -inf / nan as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def write_csv(records: Sequence[SlotStats], path: str | os.PathLike[str]) -> None:
    """One row per (step, slot), columns as the :class:`SlotStats` fields."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(_COLUMNS)
        for r in records:
            writer.writerow([getattr(r, c) for c in _COLUMNS])


def write_json(records: Sequence[SlotStats], path: str | os.PathLike[str]) -> None:
    """``{"definitions": {...}, "records": [{field: value}, ...]}``, strict JSON."""
    payload = {
        "definitions": DEFINITIONS,
        "records": [{k: _json_number(v) for k, v in r.to_dict().items()} for r in records],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, allow_nan=False)
        f.write("\n")


def write_tensorboard(
    records: Sequence[SlotStats], log_dir: str | os.PathLike[str] | None, *, writer: Any = None
) -> None:
    """Add every metric of :data:`METRICS` as a scalar ``fp8/<metric>/<slot name>`` at its step
    (finite values only: an infinite amax shows as a step of ``nonfinite_events``).

    Args:
        records: inspector records.
        log_dir: TensorBoard run folder (ignored when ``writer`` is given).
        writer: an open ``torch.utils.tensorboard.SummaryWriter`` to write into (left open).

    Raises:
        RuntimeError: when ``torch.utils.tensorboard`` cannot be imported (the ``tensorboard``
            package is not installed); fp8kit does not depend on it.
    """
    own = writer is None
    if own:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError(
                "TensorBoard export needs the tensorboard package, which is not installed "
                f"({exc}): run `pip install tensorboard`, or use to_csv / to_json instead"
            ) from None
        writer = SummaryWriter(log_dir=None if log_dir is None else os.fspath(log_dir))
    try:
        for r in records:
            for metric in METRICS:
                value = getattr(r, metric)
                if math.isfinite(value):
                    writer.add_scalar(f"fp8/{metric}/{r.name}", value, r.step)
    finally:
        if own:
            writer.close()
