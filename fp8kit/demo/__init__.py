"""The fp8kit demo: a small byte-level GPT trained in fp32, bf16 and FP8 side by side.

Run it with ``python -m fp8kit.demo``, ``fp8kit demo`` or ``make demo``; see ``docs/demo.md``.
"""

from fp8kit.demo.cli import main

__all__ = ["main"]
