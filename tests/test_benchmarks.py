"""The benchmark scripts run (smoke test with tiny sizes); speed itself is never asserted."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bench_update", "bench_memory", "bench_host"])
def test_benchmark_smoke(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    module.main(["--quick"])
    out = capsys.readouterr().out
    assert "| " in out and "Machine:" in out


def test_memory_benchmark_counts_fp8_activations_at_a_quarter() -> None:
    import torch

    import fp8kit.torch as f8
    from benchmarks.bench_memory import _stack, saved_bytes

    x = torch.randn(64, 32, requires_grad=True)
    fp32 = saved_bytes(_stack(32, 3, gelu=False), x, fp8=False)
    fp8 = saved_bytes(f8.convert_model(_stack(32, 3, gelu=False)), x, fp8=True)
    assert fp32 == {"weights": 0, "activations": 3 * 64 * 32 * 4}
    assert fp8 == {"weights": 3 * 32 * 32, "activations": 3 * 64 * 32}


def test_bench_gpu_without_cuda_says_so_and_exits_0(tmp_path) -> None:
    """``make bench-gpu`` on a CPU-only machine: one clear line, exit code 0, no JSON."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: bench-gpu would measure")
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device: bench-gpu measures GPU figures only" in proc.stdout
    assert not out.exists()
