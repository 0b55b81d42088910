"""Cost of one delayed-scaling update event for 10 / 100 / 1000 modules.

Run: ``python -m benchmarks.bench_update`` (``--quick`` for a smoke run).

Each module is an ``f8.Linear`` (forward state ``(L, 3)``); all ran in the step, so the event
rolls every slot. Reports the median wall time of the event (the exit of ``f8.autocast``) and the
number of aten ops it dispatches: the op count must not depend on the module count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8kit.torch as f8
from benchmarks.common import machine_note, markdown_table
from fp8kit.recipe import DelayedScaling


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def event_cost(num_modules: int, history_len: int, repeats: int) -> tuple[float, int]:
    """Median seconds of one forward update event, and its aten op count."""
    recipe = DelayedScaling(amax_history_len=history_len)
    layers = [f8.Linear(16, 16) for _ in range(num_modules)]
    x = torch.randn(2, 16)
    times = []
    ops = 0
    for i in range(repeats + 2):  # the first event lays the states out in one pool
        ctx = f8.autocast(recipe=recipe)
        ctx.__enter__()
        for layer in layers:
            layer(x)
        if i == repeats + 1:
            with CountOps() as counter:
                ctx.__exit__(None, None, None)
            ops = sum(counter.ops.values())
            continue
        start = time.perf_counter()
        ctx.__exit__(None, None, None)
        if i > 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times), ops


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer modules and repeats")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    counts = (10, 100) if args.quick else (10, 100, 1000)
    repeats = 3 if args.quick else args.repeats
    rows = []
    for history_len in (16, 1024):
        for n in counts:
            seconds, ops = event_cost(n, history_len, repeats)
            rows.append([n, history_len, f"{seconds * 1e3:.2f}", ops])
    text = "\n".join(
        [
            f"Machine: {machine_note()}",
            "",
            markdown_table(["modules", "L", "ms / event (median)", "aten ops / event"], rows),
        ]
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
