"""What the report says about the machine: CPU, GPU, core count, software versions and load."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = [
    "IDLE_LOAD",
    "choose_threads",
    "cpu_bf16_units",
    "cpu_model",
    "load_average",
    "machine_info",
]

_BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_bf16_units() -> list[str] | None:
    """The CPU's bf16 matrix / vector units named in ``/proc/cpuinfo`` (AMX-BF16, AVX512-BF16);
    ``[]`` when it lists none, None where there is no ``/proc/cpuinfo`` to read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [name for flag, name in _BF16_FLAGS.items() if flag in flags]
    except OSError:
        return None
    return None


def load_average() -> tuple[float, float, float] | None:
    """1, 5 and 15 minute load averages, where the OS reports them."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """CPU (and GPU when ``device`` is "cuda"), core and thread counts, versions and the load."""
    cuda = device == "cuda"
    return {
        "device": device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "cpu": cpu_model(),
        "cpu_bf16_units": cpu_bf16_units(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": load_average(),
    }


IDLE_LOAD = 0.5  # 1-minute load average below which the machine counts as idle


def choose_threads() -> tuple[int, str]:
    """``(threads, reason)``: torch's default on an idle machine, else 1.

    On a busy machine every parallel region waits for threads that other processes have
    descheduled: measured on 2 shared cores, 2 threads stalled FP8 steps for up to 6 s (median
    0.2 s) while 1 thread ran steadily. On an idle one, 2 threads ran the demo 1.4x faster.
    """
    default = torch.get_num_threads()
    load = load_average()
    if default <= 1:
        return default, f"{default} (torch's default)"
    if load is not None and load[0] < IDLE_LOAD:
        return default, (
            f"{default} (torch's default: the machine was idle, 1-minute load average "
            f"{load[0]:.2f}; `--threads N` overrides)"
        )
    shown = "unknown" if load is None else f"{load[0]:.2f}"
    return 1, (
        f"1 (1-minute load average {shown} at start: other processes were running, and on a "
        "busy machine extra threads stall waiting for each other; `--threads N` overrides)"
    )
