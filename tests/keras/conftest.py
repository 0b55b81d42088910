"""Keras test setup: the TensorFlow backend and two logical CPU devices, before TF starts.

Keras fixes its backend when it is first imported, so ``KERAS_BACKEND`` is set here, before any
test module imports keras; the JAX and torch backends are exercised in subprocesses
(``test_backends.py``). The two logical CPUs serve the ``MirroredStrategy`` tests and must be
configured before TensorFlow initialises its runtime.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if "keras" in sys.modules and os.environ.get("KERAS_BACKEND") != "tensorflow":
    pytest.skip("keras was imported earlier with another backend", allow_module_level=True)
os.environ["KERAS_BACKEND"] = "tensorflow"
# LLVM optimisation level 0 shortens XLA's CPU compile time (tiny shapes, many programs); IEEE
# float semantics are the same at every level (tests/jax/conftest.py sets the same flag).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

# Triton (imported by torch._dynamo / fp8kit.torch) and TensorFlow each bundle LLVM; loading
# Triton *after* TensorFlow aborts the process ("Option ... registered more than once"), while
# the other order works. Load it first so that later torch tests in this process are safe.
for _name in ("triton", "torch._dynamo"):
    with contextlib.suppress(ImportError):
        __import__(_name)

tf = pytest.importorskip("tensorflow")
pytest.importorskip("keras")

try:
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
except RuntimeError:  # runtime already initialised: MirroredStrategy tests skip themselves
    pass


# The ``rng`` fixture (FP8KIT_TEST_SEED reproduces a reported seed, tests/README.md) and the hook
# that reports its seed on failure, shared with the other test packages.
from tests.seeding import pytest_runtest_makereport, rng  # noqa: E402, F401
