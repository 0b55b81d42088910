"""The Keras benchmark scripts run (tiny shapes); speed itself is never asserted."""

from __future__ import annotations

import pytest

from benchmarks import bench_keras, gpu_keras


@pytest.mark.slow
def test_bench_keras_quick_smoke() -> None:
    out = bench_keras.main(["--quick", "--backend", "tensorflow"])
    for variant in bench_keras.VARIANTS:
        assert f"| tensorflow | {variant} |" in out
    assert "Machine:" in out


def test_gpu_keras_without_a_gpu_skips_cleanly(monkeypatch, tmp_path, capsys) -> None:
    """No backend sees a GPU: skipped, saying why per backend (a probe that failed to import
    keras reports that, not a missing GPU)."""
    why = {"tensorflow": "ModuleNotFoundError: No module named 'keras'", "jax": "no CUDA GPU"}
    monkeypatch.setattr(gpu_keras, "gpu_backends", lambda: ([], why))
    result = gpu_keras.main(str(tmp_path / "out.json"))
    assert result["skipped"] == (
        "tensorflow: ModuleNotFoundError: No module named 'keras'; jax: no CUDA GPU"
    )
    assert "No module named 'keras'" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()
