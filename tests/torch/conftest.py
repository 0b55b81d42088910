"""Fixtures shared by the torch frontend's tests."""

from __future__ import annotations

import pytest
import torch

from tests.torch.emulated_graphs import emulated_make_graphed_callables


@pytest.fixture
def emulated_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.make_graphed_callables`` replaced by the CPU stand-in for one test."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", emulated_make_graphed_callables)
