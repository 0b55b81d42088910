"""Frozen FP8 layers in training, TensorFlow backend (the torch backend runs the same cases in
backend_smoke.py): frozen weights follow fp8kit.torch's rules (forward event without a backward
pass, dY cast only for a gradient GEMM whose result is needed)."""

from __future__ import annotations

import pytest

from tests.keras import frozen_cases

pytest.importorskip("torch")


@pytest.mark.parametrize("wgrad_hp", [False, True], ids=["fp8", "wgrad_hp"])
@pytest.mark.parametrize("freeze", ["variables"])
def test_frozen_prefix_matches_fp8kit_torch(freeze, wgrad_hp) -> None:
    """a -> b -> c, a and b frozen, two fit steps: a and b update their forward state only and
    b casts no dY (its dX feeds only a, which needs no gradient), as fp8kit.torch; the old code
    recorded b's dY."""
    frozen_cases.check_frozen_prefix(freeze, wgrad_hp)
