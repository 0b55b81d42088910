"""Numerics inspector: opt-in per-step statistics of every FP8 slot of a model.

``Inspector(model)`` records, for each slot cast during a step, the amax, the scale, the fraction
of saturated and of flushed-to-zero elements and the quantization SNR (definitions in
:mod:`fp8kit.torch.inspect.stats`); it exports them to CSV, JSON or TensorBoard and plots them.
Nothing runs while no inspector is attached.
"""

from fp8kit.torch.inspect.export import DEFINITIONS, METRICS, write_csv, write_json
from fp8kit.torch.inspect.inspector import Inspector, SlotName, SlotStats, attached_inspector
from fp8kit.torch.inspect.plot import plot_stats
from fp8kit.torch.inspect.stats import cast_statistics

__all__ = [
    "DEFINITIONS",
    "METRICS",
    "Inspector",
    "SlotName",
    "SlotStats",
    "attached_inspector",
    "cast_statistics",
    "plot_stats",
    "write_csv",
    "write_json",
]
