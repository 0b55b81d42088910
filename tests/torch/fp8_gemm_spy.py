"""Every FP8 GEMM a module makes, recorded and checked against float64 math.

fp8kit's modules run each FP8 GEMM through ``fp8_linear`` (docs/decisions/0401). A spy wraps that
function in the modules' namespaces and keeps every call's operands and result, so a test can
check each GEMM on the operands it really got (:func:`assert_e4m3_gemm`) and the high-precision
code between GEMMs separately, against float64 math.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from fp8kit.formats import E4M3
from tests.reference import FLOAT32_UNIT_ROUNDOFF, fp8_round


@dataclass
class GemmCall:
    """One ``fp8_linear`` call: ``x`` ``(*, K)``, ``weight`` ``(N, K)``, ``y`` ``(*, N)``."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    gemm: int
    y: torch.Tensor


def spy_fp8_linear(monkeypatch: pytest.MonkeyPatch, *modules: ModuleType) -> list[GemmCall]:
    """Wrap ``fp8_linear`` in each of ``modules``; the returned list fills as GEMMs run."""
    calls: list[GemmCall] = []
    for module in modules:
        real = module.fp8_linear

        def spy(x: torch.Tensor, weight: torch.Tensor, bias: Any, run: Any, *, _real=real,
                **kw: Any) -> torch.Tensor:  # fmt: skip
            y = _real(x, weight, bias, run, **kw)
            calls.append(
                GemmCall(
                    x.detach().clone(),
                    weight.detach().clone(),
                    None if bias is None else bias.detach().clone(),
                    kw.get("gemm", 0),
                    y.detach().clone(),
                )
            )
            return y

        monkeypatch.setattr(module, "fp8_linear", spy)
    return calls


def assert_e4m3_gemm(call: GemmCall) -> None:
    """``y`` is the E4M3 GEMM of its operands at scale 1 (a fresh delayed-scaling state).

    Reference: both operands rounded to E4M3 (round to nearest even, docs/semantics.md section
    2), products and sums in float64, plus the bias. The E4M3 x E4M3 products are exact in
    float32, so summing K of them, adding the bias and rounding the result errs by at most
    (K + 3) u (sum |x_q| |w_q| + |b|), u = 2^-24 (as tests/torch/matmul_reference.py). The
    same bound around the high-precision product ``x W^T + b`` must fail somewhere: rounding to
    E4M3 moves an operand by up to 2^-4 of itself, far more than that bound.
    """
    k = call.x.shape[-1]
    x = call.x.reshape(-1, k).double().numpy()
    w = call.weight.double().numpy()
    b = np.zeros(1) if call.bias is None else call.bias.double().numpy()
    xq, wq = fp8_round(x, E4M3), fp8_round(w, E4M3)
    reference = xq @ wq.T + b
    bound = (k + 3) * FLOAT32_UNIT_ROUNDOFF * (np.abs(xq) @ np.abs(wq).T + np.abs(b))
    got = call.y.reshape(-1, w.shape[0]).double().numpy()
    outside = np.abs(got - reference) > bound
    assert not outside.any(), (
        f"GEMM {call.gemm}: {int(outside.sum())} of {got.size} outputs off the E4M3 reference, "
        f"worst {np.max(np.abs(got - reference) - bound):.3g} beyond the bound"
    )
    assert (np.abs(got - (x @ w.T + b)) > bound).any(), f"GEMM {call.gemm} ran in high precision"
