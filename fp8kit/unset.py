"""``UNSET``: the default of a frontend module's argument that an active ``autocast`` fills in
(``recipe``, ``amax_reduction_axes``, ``gradient_accumulation_steps``), told apart from every
value a user may pass, ``None`` included. One marker for every frontend."""

from __future__ import annotations

from typing import Any

__all__ = ["UNSET"]


class _Unset:
    """The marker's type: one hashable instance that pickles as itself."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"  # the module attribute below, so a copy or unpickle is the same object


UNSET: Any = _Unset()
