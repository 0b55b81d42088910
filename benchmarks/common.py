"""Shared pieces of the benchmark scripts: machine description, round-robin timing, tables."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

ALLOCATOR_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> str:
    """The 1/5/15-minute load averages, or "n/a"."""
    try:
        return " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def machine_note() -> str:
    """One line: CPU, cores, torch threads, load average, allocator settings, torch version."""
    load = loadavg()
    alloc = ", ".join(f"{k}={os.environ[k]}" for k in ALLOCATOR_ENV if k in os.environ)
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, load average {load}, allocator: "
        f"{alloc or 'glibc defaults'}"
    )


def round_robin_samples(
    variants: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each variant in each of ``repeats`` interleaved rounds (one call of
    each variant per round), so that load changes hit every variant alike."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def round_robin(
    variants: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call of each variant over :func:`round_robin_samples`' rounds."""
    samples = round_robin_samples(variants, repeats, warmup)
    return {name: statistics.median(values) for name, values in samples.items()}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
