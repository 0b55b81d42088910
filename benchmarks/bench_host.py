"""Host overhead of a tiny FP8 Linear training step vs ``nn.Linear`` (issue 9, item 3).

At these sizes the GEMMs cost little, so the ratio is the Python and launch work around the
kernels. Both variants are timed round-robin in one process (median of rounds).
"""

from __future__ import annotations

import argparse

import torch

import fp8kit.torch as f8
from benchmarks.common import machine_note, markdown_table, round_robin
from fp8kit.recipe import DelayedScaling


def step_times(size: int, repeats: int, calls: int = 20) -> dict[str, float]:
    """Median microseconds per training step of ``nn.Linear`` and ``f8.Linear`` (size x size)."""
    torch.manual_seed(0)
    x = torch.randn(size, size, requires_grad=True)
    base, fp8 = torch.nn.Linear(size, size), f8.Linear(size, size)
    recipe = DelayedScaling(amax_history_len=16)

    def plain() -> None:
        for _ in range(calls):
            base(x).sum().backward()

    def fp8_step() -> None:
        for _ in range(calls):
            with f8.autocast(recipe=recipe):
                y = fp8(x)
            y.sum().backward()

    seconds = round_robin({"nn.Linear": plain, "fp8kit delayed": fp8_step}, repeats, warmup=2)
    return {name: s / calls * 1e6 for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 15
    rows = []
    for size in (32, 256):
        t = step_times(size, repeats)
        ratio = t["fp8kit delayed"] / t["nn.Linear"]
        rows.append([f"{size} x {size}", f"{t['nn.Linear']:.0f}", f"{t['fp8kit delayed']:.0f}",
                     f"{ratio:.2f}x"])  # fmt: skip
    text = f"Machine: {machine_note()}\n\n" + markdown_table(
        ["Linear", "nn.Linear us / step", "fp8kit us / step", "fp8kit / nn.Linear"], rows
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
