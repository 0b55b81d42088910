"""Fresh random inputs on every run, yet every failure reproducible from its report.

Tests that take the ``rng`` fixture get a numpy generator seeded from ``os.urandom`` (so repeated
runs keep exploring new inputs), or from the ``FP8KIT_TEST_SEED`` environment variable when it is
set. A failing test's report carries a "random seed" section with the exact command that reruns
it on the same inputs (tests/README.md). A conftest activates this module by importing
:func:`rng` and :func:`pytest_runtest_makereport` into its namespace.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import numpy as np
import pytest

__all__ = ["SEED_ENV", "choose_seed", "pytest_runtest_makereport", "rng"]

SEED_ENV = "FP8KIT_TEST_SEED"
_SEED = pytest.StashKey[int]()


def choose_seed() -> int:
    """``FP8KIT_TEST_SEED`` if set (an integer in [0, 2**32)), else 4 bytes of ``os.urandom``."""
    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        return int.from_bytes(os.urandom(4), "little")
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**32:
        raise ValueError(f"{SEED_ENV} must be an integer in [0, 2**32), got {text!r}")
    return seed


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A numpy generator seeded by :func:`choose_seed`; the seed is reported if the test fails."""
    seed = choose_seed()
    request.node.stash[_SEED] = seed
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Add the seed and the rerun command to the report of a failed test that used ``rng``."""
    report = yield
    seed = item.stash.get(_SEED, None)
    if seed is not None and report.failed:
        text = f"rerun with these inputs: {SEED_ENV}={seed} python -m pytest '{item.nodeid}'"
        add = getattr(report.longrepr, "addsection", None)
        if add is not None:
            add("random seed", text)  # part of the failure's traceback report: always shown
        else:
            report.sections.append(("random seed", text))
    return report
