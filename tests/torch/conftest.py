"""Fixtures shared by the torch frontend's tests."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.torch.emulated_graphs import emulated_make_graphed_callables


@pytest.fixture
def emulated_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.make_graphed_callables`` replaced by the CPU stand-in for one test."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", emulated_make_graphed_callables)


@pytest.fixture(autouse=True)
def seeded_torch(request: pytest.FixtureRequest) -> None:
    """torch's global generator seeded from the test's id: a test that draws with
    ``torch.randn`` and sets no seed itself gets the same inputs alone as in the full suite
    (tests/README.md, "Random inputs and seeds")."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
