"""Read the dots of a lowered JAX program (StableHLO text) for the FP8 lowering gate.

``jax.jit(f).lower(...).as_text()`` keeps nested jitted functions as ``func.func private``
functions reached by ``call``; one function can be called from several places. :func:`dots`
walks the call graph from ``main`` and returns every ``stablehlo.dot_general`` once per call
that executes it, with what a GPU compiler needs to see around it (docs/jax.md, "Lowering").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")
_DOT = re.compile(
    r"^\s*(%[\w#]+) = stablehlo\.dot_general (%[\w#]+), (%[\w#]+), "
    r"(?:batching_dims = \[([\d, ]*)\] x \[([\d, ]*)\], )?"
    r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\].*"
    r": \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)"
)
_MULTIPLY = re.compile(r"^\s*(%[\w#]+) = stablehlo\.multiply (%[\w#]+), (%[\w#]+) :")


def _tensor(t: str) -> tuple[tuple[int, ...], str]:
    """``tensor<8x48xf8E4M3FN>`` -> ``((8, 48), "f8E4M3FN")``."""
    parts = t[len("tensor<") : -1].split("x")
    return tuple(int(p) for p in parts[:-1]), parts[-1]


def _dims(s: str | None) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",")) if s and s.strip() else ()


@dataclass(frozen=True)
class Dot:
    """One executed ``dot_general``: operand / result element types and shapes, and how its
    result is used inside its function."""

    function: str
    lhs_type: str
    rhs_type: str
    out_type: str
    lhs_shape: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    scaled_by_scalar: bool  # its only use is a multiply by a broadcast 0-d value of its dtype
    text: str

    @property
    def operands(self) -> tuple[str, str]:
        return self.lhs_type, self.rhs_type

    @property
    def contraction(self) -> int:
        """Length of the contraction (product of the contracted sizes)."""
        return math.prod(self.lhs_shape[d] for d in self.lhs_contracting)


def _functions(text: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            current = funcs.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return funcs


def _scaled_by_scalar(body: list[str], name: str, dtype: str) -> bool:
    use = re.compile(re.escape(name) + r"(?![\w#])")
    users = [line for line in body if use.search(line.split("=", 1)[-1])]
    if len(users) != 1:
        return False
    m = _MULTIPLY.match(users[0])
    if m is None or name not in (m.group(2), m.group(3)):
        return False
    other = m.group(3) if m.group(2) == name else m.group(2)
    define = re.compile(
        r"^\s*" + re.escape(other) + r" = stablehlo\.broadcast_in_dim %[\w#]+, dims = \[\] : "
        r"\(tensor<" + re.escape(dtype) + r">\)"
    )
    return any(define.match(line) for line in body)


def dots(text: str, entry: str = "main") -> list[Dot]:
    """Every dot executed by ``entry`` of the StableHLO module ``text`` (nested calls
    included, once per call)."""
    funcs = _functions(text)

    def walk(name: str, depth: int) -> Iterator[Dot]:
        if depth > 64:
            raise RecursionError(f"call chain through {name} is deeper than 64")
        body = funcs[name]
        for line in body:
            m = _DOT.match(line)
            if m:
                lhs_shape, lhs_type = _tensor(m.group(8))
                _, rhs_type = _tensor(m.group(9))
                _, out_type = _tensor(m.group(10))
                yield Dot(
                    function=name,
                    lhs_type=lhs_type,
                    rhs_type=rhs_type,
                    out_type=out_type,
                    lhs_shape=lhs_shape,
                    lhs_contracting=_dims(m.group(6)),
                    lhs_batch=_dims(m.group(4)),
                    scaled_by_scalar=_scaled_by_scalar(body, m.group(1), out_type),
                    text=line.strip(),
                )
            for callee in _CALL.findall(line):
                yield from walk(callee, depth + 1)

    return list(walk(entry, 0))
