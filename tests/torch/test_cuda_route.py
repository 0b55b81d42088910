"""The CUDA kernel route of the torch modules gives the CPU route's bytes (issue 9, CPU gates).

CI has no GPU, and the Triton kernels are checked one by one elsewhere (test_kernels.py,
test_update_kernel.py). This checks the path around them as a GPU runs it: the modules' casts
through the bound Triton cast instead of the prepared native call, the pooled update events on
the Triton update kernel, ``torch._scaled_mm`` GEMMs and torch dequantization. Training runs
(tests/torch/cuda_route.py) on both routes must agree bit for bit: outputs, every FP8 state
buffer, parameter gradients.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.torch import cuda_route

REPO = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers (NaN payloads and -0 compared exactly)."""
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional: pip install -c constraints.txt triton)")
    out = tmp_path_factory.mktemp("cuda-route") / "routes.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "FP8KIT_CPU_GEMM": "scaled_mm"}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.torch.cuda_route", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out)


def test_the_cuda_route_ran_on_triton(routes: dict[str, object]) -> None:
    assert routes["triton error"] is None
    calls = routes["triton calls"]
    assert all(n > 0 for n in calls.values()), calls
    assert calls.keys() == {"cast", "cast_current", "delayed_update", "slot_cast"}


@pytest.mark.parametrize("scenario", list(cuda_route._scenarios()))
def test_cuda_route_equals_cpu_route(routes: dict[str, object], scenario: str) -> None:
    cpu, cuda = routes[f"cpu/{scenario}"], routes[f"cuda/{scenario}"]
    for i, (a, b) in enumerate(zip(cpu["outputs"], cuda["outputs"], strict=True)):
        assert torch.equal(_bits(a), _bits(b)), f"output of call {i}"
    for part in ("state", "grads"):
        assert cpu[part].keys() == cuda[part].keys()
        for key, a in cpu[part].items():
            b = cuda[part][key]
            assert a.dtype == b.dtype and a.shape == b.shape, (part, key)
            assert torch.equal(_bits(a), _bits(b)), (part, key)
    # the runs did train: the forward state moved off its initial scale of 1
    scales = [v for k, v in cpu["state"].items() if k.endswith("forward.scale")]
    if "current" not in scenario or "first step" in scenario:
        assert scales and any(bool((s != 1).any()) for s in scales)


_LAYER = {"triton._cast_2d_kernel": 3, "aten._scaled_mm.default": 3, "triton._dbias_kernel": 1}


@pytest.mark.parametrize(
    ("recipe", "dtype", "expected"),
    [
        ("DelayedScaling", "torch.bfloat16", {**_LAYER, "triton._delayed_update_kernel": 2}),
        (
            "DelayedScaling",
            "torch.float32",  # cuBLASLt fuses a bias into a 16-bit output only
            {**_LAYER, "aten.add.Tensor": 1, "triton._delayed_update_kernel": 2},
        ),
        ("Float8CurrentScaling", "torch.bfloat16", {**_LAYER, "triton._amax_kernel": 3}),
    ],
)
def test_cuda_route_kernels_per_linear_step(
    routes: dict[str, object], recipe: str, dtype: str, expected: dict[str, int]
) -> None:
    """What a GPU launches for one steady step of a biased Linear, counted on the CUDA route:
    per cast one Triton pass (x and W with their transposes, dY with its transpose and the
    bias gradient's per-tile partial sums, which one small kernel reduces), three
    ``_scaled_mm`` and one update kernel per event. Issue 9's budget: at most 8 kernels per
    Linear forward + backward under delayed scaling, at most 3 per update event."""
    launches = routes[f"launches/{recipe}/{dtype}"]
    assert launches == expected
    layer = {k: v for k, v in launches.items() if k != "triton._delayed_update_kernel"}
    if recipe == "DelayedScaling":
        assert sum(layer.values()) <= 8
