"""Activation memory saved for backward: fp8kit's FP8 Linear vs fp32 nn.Linear.

Run: ``python -m benchmarks.bench_memory``.

Counts the bytes of every tensor autograd saves for backward (``saved_tensors_hooks``), once per
storage, for a stack of Linears (4096 tokens, 1024 features, 4 layers with GELU between), split
into parameters (shared with the model: no extra memory) and everything else (activations and
FP8 copies, the memory a step really adds). Deterministic: no timing involved.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import fp8kit.torch as f8
from benchmarks.common import machine_note, markdown_table


def _stack(width: int, depth: int, gelu: bool) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if gelu and i < depth - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def saved_bytes(model: nn.Module, x: torch.Tensor, fp8: bool) -> dict[str, int]:
    """Bytes saved for backward by one forward (each storage once), by kind: ``weights`` (FP8
    copies of weights), ``activations`` (everything else that is not a parameter)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    seen: set[int] = set()
    totals = {"weights": 0, "activations": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            is_weight_copy = t.element_size() == 1 and tuple(t.shape) in weight_shapes
            totals["weights" if is_weight_copy else "activations"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if fp8:
            with f8.autocast():
                model(x)
        else:
            model(x)
    return totals


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="1024 tokens, width 256")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.width = 1024, 256
    x = torch.randn(args.tokens, args.width, requires_grad=True)
    mib = 2**20
    rows = []
    for gelu in (False, True):
        what = "Linears + GELU" if gelu else "Linears only"
        fp32 = saved_bytes(_stack(args.width, args.depth, gelu), x, fp8=False)
        fp8 = saved_bytes(f8.convert_model(_stack(args.width, args.depth, gelu)), x, fp8=True)
        base = fp32["activations"] + fp32["weights"]
        for name, t in (("fp32 nn.Linear", fp32), ("fp8kit f8.Linear", fp8)):
            total = t["activations"] + t["weights"]
            rows.append(
                [
                    what,
                    name,
                    f"{t['activations'] / mib:.1f}",
                    f"{t['weights'] / mib:.1f}",
                    f"{total / mib:.1f}",
                    f"{t['activations'] / fp32['activations']:.2f}x",
                    f"{total / base:.2f}x",
                ]
            )
    text = "\n".join(
        [
            f"Machine: {machine_note()}",
            f"{args.depth} layers {args.width} -> {args.width}, {args.tokens} tokens; "
            "MiB saved for backward besides the parameters themselves",
            "",
            markdown_table(
                [
                    "model",
                    "variant",
                    "activations",
                    "FP8 weight copies",
                    "total",
                    "activations vs fp32",
                    "total vs fp32",
                ],
                rows,
            ),
        ]
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
