"""tests/seeding.py: a failure report names its seed, and that seed reruns the same inputs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.seeding import SEED_ENV, choose_seed

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = "from tests.seeding import pytest_runtest_makereport, rng  # noqa: F401\n"
FAILING_TEST = textwrap.dedent(
    """
    def test_draws(rng):
        drawn = int(rng.integers(0, 2**62))
        assert drawn < 0, f"drew {drawn}"
    """
)


def _run_inner(folder: Path, seed: str | None) -> str:
    """Run the failing test in a fresh pytest (numpy only: about a second); return its output."""
    env = {k: v for k, v in os.environ.items() if k != SEED_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if seed is not None:
        env[SEED_ENV] = seed
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0, done.stdout  # the inner test always fails
    return done.stdout + done.stderr


def test_failure_report_names_the_seed_that_reproduces_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_inner.py").write_text(FAILING_TEST)
    first = _run_inner(tmp_path, None)
    reported = re.search(rf"{SEED_ENV}=(\d+) python -m pytest 'test_inner.py::test_draws'", first)
    assert reported, first
    drawn = re.search(r"drew (\d+)", first)
    assert drawn, first
    again = _run_inner(tmp_path, reported.group(1))
    assert f"drew {drawn.group(1)}" in again, again  # the same inputs
    assert f"{SEED_ENV}={reported.group(1)} " in again  # and the same report


def test_seed_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SEED_ENV, "4242")
    assert choose_seed() == 4242
    for bad in ("0x10", "-1", str(2**32), "seed"):
        monkeypatch.setenv(SEED_ENV, bad)
        with pytest.raises(ValueError, match=f"{SEED_ENV} must be an integer in"):
            choose_seed()
    monkeypatch.delenv(SEED_ENV)
    seeds = {choose_seed() for _ in range(4)}
    assert len(seeds) > 1 and all(0 <= s < 2**32 for s in seeds)  # fresh without the variable
