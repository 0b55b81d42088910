"""The runnable examples run and do what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_low_level_gemm_loop_tracks_a_drifting_range(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    import fp8kit.torch as f8
    from fp8kit.formats import E4M3
    from tests.torch.matmul_reference import assert_fp8_matmul_output

    calls = []
    real = f8.fp8_matmul

    def recording(a, b, **kwargs):
        out = real(a, b, **kwargs)
        calls.append((a, b, kwargs, out))
        return out

    monkeypatch.setattr(f8, "fp8_matmul", recording)
    errors = _load("torch_low_level_gemm").main(steps=8)
    # Each step's FP8 GEMM with bias, ReLU and FP8 output is exact up to float32 rounding: every
    # output code against float64 math on the step's FP8 operands (tests/torch/matmul_reference).
    assert len(calls) == 8
    for a, b, kwargs, out in calls:
        assert kwargs["activation"] == "relu" and isinstance(out, f8.Float8Tensor)
        scale = float(kwargs["out_scale"])
        assert_fp8_matmul_output(out, a, b, kwargs["bias"], "relu", scale, E4M3)
    # What is left of the error against the unquantized float result is the three E4M3 roundings
    # (A, B and the output C). RNE to E4M3 errs by at most half a quantum, 2^-4 relative at a
    # mantissa of 1; uniform over the quantum and over log-spread mantissas its RMS is
    # 2^-4 / sqrt(3) * sqrt(E[1/m^2]) = 0.036 * 0.74 = 0.027. Independent per element, the A and
    # B errors add in quadrature through the 256-term sums (random signs), the output's on top:
    # sqrt(3) * 0.027 = 0.046. The delayed scales lag the 1.5x-per-step drift, so the few
    # elements of A beyond last step's amax saturate: measured 0.047 to 0.068; 0.08 bounds it.
    assert max(errors) < 0.08, errors
