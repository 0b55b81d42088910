"""The Keras / TensorFlow examples run and do what they say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tf_low_level_loop_tracks_a_drifting_range() -> None:
    rows = _load("tf_low_level_qdq").main(steps=6, verbose=False)
    # step 0 quantizes with scale 1: no saturation yet for c ~ 16, and the delayed scales keep
    # the FP8 output at FP8 resolution (E4M3 operands and output: a few percent)
    assert max(r["rel_err"] for r in rows) < 0.1
    assert rows[0]["c_scale_used"] == 1.0 and rows[1]["c_scale_used"] != 1.0
    # the next scale is fmax * 2**-margin / max(window), margin 1
    assert np.isclose(rows[0]["c_scale_next"], 224.0 / rows[0]["c_amax"], rtol=1e-6)


def test_keras_seed004_example_trains() -> None:
    losses = _load("keras_dense_seed004").main(steps=24, verbose=False)
    assert losses["tape"][-1] < 0.5 * losses["tape"][0]
    assert losses["fit"][-1] < losses["fit"][0] or len(losses["fit"]) == 1
