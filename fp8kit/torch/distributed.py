"""Amax reduction over ``torch.distributed`` (docs/semantics.md section 5): collectives and the
layout check.

The registry in :mod:`fp8kit.torch.state.registry` decides *which* states are reduced and in which
order; this module owns everything that talks to other ranks:

* :func:`reduction_active`: whether a (recipe, group) reduces at all.
* :class:`Layout`: what one rank is about to reduce (direction, recipe, history length, slots per
  state), with a 24-bit fingerprint that travels in every reduction buffer.
* :func:`check_layout`: the handshake, one small ``all_gather`` that raises
  :class:`AmaxReductionError` on every rank, naming the ranks and their layouts, when they differ.
* :func:`all_reduce_max`: the in-place MAX all-reduce, with failures (timeouts, a rank that never
  arrives) re-raised as :class:`AmaxReductionError` saying what fp8kit was doing.
* :func:`ddp_ignore_fp8_state`: keep ``DistributedDataParallel`` from broadcasting FP8 state.

Waiting is bounded by the process group's own timeout (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp8kit.recipe import DelayedScaling

__all__ = [
    "AmaxReductionError",
    "Layout",
    "all_reduce_max",
    "check_layout",
    "check_reduction_group",
    "group_size",
    "reduction_active",
    "resolve_group",
]

_DIRECTIONS = ("forward", "backward")
_FINGERPRINT_BITS = 24  # exactly representable in float32, so it survives a MAX all-reduce


class AmaxReductionError(RuntimeError):
    """Ranks disagree about, or did not all reach, an fp8kit amax reduction."""


def _dist() -> Any:
    return torch.distributed


def _initialized() -> bool:
    dist = _dist()
    return bool(dist.is_available() and dist.is_initialized())


def group_size(group: Any) -> int:
    """Number of ranks in ``group`` (None = WORLD); 1 when torch.distributed is not initialised.

    A rank outside ``group`` gets a value below 1 from ``torch.distributed`` and thus never
    reduces over it.
    """
    if not _initialized():
        return 1
    return int(_dist().get_world_size(group))


def check_reduction_group(name: str, group: Any) -> None:
    """Raise a TypeError naming the parameter ``name`` unless ``group`` is an amax reduction
    group: None (WORLD), a ``torch.distributed.ProcessGroup``, or the value ``new_group`` hands
    a rank outside the new group (``GroupMember.NON_GROUP_MEMBER``; such a rank never reduces,
    as :func:`group_size` says)."""
    if group is None:
        return
    dist = _dist()
    if dist.is_available() and (isinstance(group, dist.ProcessGroup) or _is_non_member(group)):
        return
    raise TypeError(
        f"{name} must be None (the WORLD group) or a torch.distributed.ProcessGroup (what "
        f"torch.distributed.new_group returns, on member and non-member ranks), got "
        f"{type(group).__name__} {group!r}"
    )


def _is_non_member(group: Any) -> bool:
    """Whether ``group`` is ``new_group``'s answer on a rank outside the group (an int)."""
    sentinel = _dist().GroupMember.NON_GROUP_MEMBER
    return type(group) is type(sentinel) and group == sentinel


def reduction_active(recipe: DelayedScaling, group: Any) -> bool:
    """Whether update events under ``(recipe, group)`` all-reduce their amaxes.

    True when ``recipe.reduce_amax`` is set, ``torch.distributed`` is initialised and ``group``
    (None = WORLD) has more than one rank.
    """
    if not recipe.reduce_amax:
        return False
    dist = _dist()  # group_size's test, spelled out: this runs at every update event
    return bool(dist.is_available() and dist.is_initialized()) and dist.get_world_size(group) > 1


def resolve_group(group: Any) -> Any:
    """The process group object behind ``group`` (None = the current WORLD group)."""
    return _dist().group.WORLD if group is None else group


def _group_ranks(group: Any) -> list[int]:
    """Global rank of each group rank, in group-rank order."""
    return list(_dist().get_process_group_ranks(resolve_group(group)))


def _group_name(group: Any) -> str:
    if group is None or group is _dist().group.WORLD:
        return "WORLD"
    return f"the group of ranks {_group_ranks(group)}"


def collective_device(group: Any, fallback: torch.device) -> torch.device:
    """Device for small bookkeeping tensors: the current CUDA device under NCCL, else CPU."""
    if str(_dist().get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback.type == "cpu" else torch.device("cpu")


@dataclass(frozen=True)
class Layout:
    """What one rank reduces at an update event of one (recipe, group, direction).

    Attributes:
        direction: ``"forward"`` or ``"backward"``.
        recipe: the recipe as canonical JSON (callables by ``module:qualname``).
        history_len: ``L`` of every state.
        slot_counts: slots per registered state, in registration order (one entry per module).
        forward_slots: for a backward layout, the staging-row length of the verified forward
            layout of the same (recipe, group) where there is one (else 0): the length a
            backward buffer is padded to (:attr:`padding`).
    """

    direction: str
    recipe: str
    history_len: int
    slot_counts: tuple[int, ...]
    forward_slots: int = 0

    def __post_init__(self) -> None:
        if self.direction not in _DIRECTIONS:
            raise ValueError(f"direction must be one of {_DIRECTIONS}, got {self.direction!r}")

    @classmethod
    def of(
        cls,
        direction: str,
        recipe: DelayedScaling,
        slot_counts: Sequence[int],
        forward_slots: int = 0,
    ) -> Layout:
        """The layout of states with ``slot_counts`` under ``recipe`` (``forward_slots``: see
        the class doc)."""
        text = json.dumps(recipe.to_dict(), sort_keys=True)
        counts = tuple(int(n) for n in slot_counts)
        return cls(direction, text, recipe.amax_history_len, counts, int(forward_slots))

    @property
    def num_states(self) -> int:
        return len(self.slot_counts)

    @property
    def num_slots(self) -> int:
        """Length of the concatenated staging row."""
        return sum(self.slot_counts)

    @property
    def padding(self) -> int:
        """Zeros a reduction buffer carries after the staging row: a backward row (2 slots per
        GEMM) is padded to the forward row's length, so ranks at a forward and a backward event
        (one skipped a backward pass) all-reduce buffers of one size and the fingerprint names
        the mismatch. Buffers of different sizes would abort gloo or hang NCCL instead
        (docs/distributed.md, "What breaking a rule does"). The forward row is the verified
        forward layout's (``forward_slots``), which also counts modules that run forward only
        (a frozen teacher, decision 0265); without one, 3 slots per GEMM of the same modules."""
        if self.direction != "backward":
            return 0
        return max(self.num_slots // 2, self.forward_slots - self.num_slots)

    @functools.cached_property
    def fingerprint(self) -> int:
        """24-bit checksum of the whole layout (exact in float32)."""
        text = json.dumps([self.direction, self.recipe, self.history_len, list(self.slot_counts)])
        return zlib.crc32(text.encode()) & ((1 << _FINGERPRINT_BITS) - 1)

    def summary(self) -> list[int]:
        """Fixed-size integer summary compared across ranks by :func:`check_layout`."""
        return [
            _DIRECTIONS.index(self.direction),
            self.num_states,
            self.num_slots,
            self.history_len,
            zlib.crc32(self.recipe.encode()),
            self.fingerprint,
            self.forward_slots,
        ]

    def describe(self) -> dict[str, Any]:
        """Plain data for error messages (sent to every rank when layouts differ)."""
        return {
            "direction": self.direction,
            "recipe": json.loads(self.recipe),
            "history_len": self.history_len,
            "slot_counts": list(self.slot_counts),
        }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def describe_mismatch(described: Sequence[dict[str, Any]], ranks: Sequence[int]) -> str:
    """Human-readable account of how the per-rank layouts ``described`` differ.

    Args:
        described: :meth:`Layout.describe` of each group rank, in group-rank order.
        ranks: the global rank of each entry.
    """
    groups: dict[str, list[int]] = {}
    by_key: dict[str, dict[str, Any]] = {}
    for rank, desc in zip(ranks, described, strict=True):
        key = json.dumps(desc, sort_keys=True)
        groups.setdefault(key, []).append(rank)
        by_key[key] = desc
    # Largest agreeing set first, then by lowest rank.
    order = sorted(groups, key=lambda k: (-len(groups[k]), groups[k][0]))
    parts = []
    for key in order:
        d = by_key[key]
        parts.append(
            f"{_ranks_text(groups[key])} registered "
            f"{_plural(len(d['slot_counts']), 'FP8 module')} for the {d['direction']} reduction "
            f"(slots per module {d['slot_counts']}, amax_history_len {d['history_len']})"
        )
    descs = [by_key[k] for k in order]
    hints = []
    if len({d["direction"] for d in descs}) > 1:
        hints.append(
            "the ranks are at different update events (forward vs backward): every rank must "
            "exit each f8.autocast and run a backward pass through FP8 modules in the same steps"
        )
    if len({json.dumps(d["recipe"], sort_keys=True) for d in descs}) > 1:
        recipes = "; ".join(
            f"{_ranks_text(groups[k])}: {json.dumps(by_key[k]['recipe'], sort_keys=True)}"
            for k in order
        )
        hints.append(f"the recipes differ ({recipes}): every rank must use the same recipe")
    if len({tuple(d["slot_counts"]) for d in descs}) > 1:
        hints.append(
            "every FP8 module must run on every rank in the first step (and in the same order); "
            "a module that first runs in a later step must do so on all ranks at once. Modules "
            "may be skipped on some ranks afterwards. A deleted module must be freed on every "
            "rank before the next event: one in a reference cycle (a torch.compile'd module) "
            "waits for Python's cyclic collector, so call gc.collect() on every rank after "
            "deleting it (docs/distributed.md, rule 6)"
        )
    return "; ".join(parts) + (": " + "; ".join(hints) if hints else "")


def _raise_mismatch(layout: Layout, group: Any, what: str) -> None:
    """Gather every rank's detailed layout (all ranks call this together) and raise."""
    dist = _dist()
    described: list[Any] = [None] * group_size(group)
    _collective(
        lambda: dist.all_gather_object(described, layout.describe(), group=group),
        group,
        f"gathering the {layout.direction} FP8 state layouts",
    )
    raise AmaxReductionError(
        f"fp8kit: {what} over {_group_name(group)}: "
        + describe_mismatch(described, _group_ranks(group))
    )


def _collective(fn: Any, group: Any, what: str) -> Any:
    try:
        return fn()
    except AmaxReductionError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError ...)
        raise AmaxReductionError(
            f"fp8kit: {what} over {_group_name(group)} failed: {exc}. Every rank of the group "
            "must reach the same update events: exit each f8.autocast and run backward through "
            "FP8 modules of every (recipe, group) on every rank in the same steps. A rank that "
            "never arrives makes the others fail after the process group's timeout "
            "(init_process_group(timeout=...))."
        ) from exc


def check_layout(layout: Layout, group: Any, device: torch.device) -> None:
    """Compare ``layout`` across the ranks of ``group`` with one small ``all_gather``.

    Every rank must call it at the same point. If the layouts differ, every rank raises
    :class:`AmaxReductionError` naming the ranks and how they differ (a second gather collects
    the details). Waiting is bounded by the group's timeout.
    """
    dist = _dist()
    mine = torch.tensor(layout.summary(), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(group_size(group))]
    _collective(
        lambda: dist.all_gather(gathered, mine, group=group),
        group,
        f"the {layout.direction} FP8 state layout check",
    )
    if any(not torch.equal(g, mine) for g in gathered):
        _raise_mismatch(layout, group, "ranks registered different FP8 states")


def raise_event_mismatch(layout: Layout, group: Any) -> None:
    """Raise on every rank after a reduction showed that ranks reduced different layouts."""
    _raise_mismatch(layout, group, "ranks reached different amax reductions")


def all_reduce_max(buffer: torch.Tensor, group: Any, direction: str) -> None:
    """All-reduce the contiguous float32 ``buffer`` with MAX over ``group``, in place."""
    dist = _dist()
    _collective(
        lambda: dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group),
        group,
        f"the {direction} amax all-reduce",
    )
