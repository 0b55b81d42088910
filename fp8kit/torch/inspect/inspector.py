"""``Inspector``: opt-in per-step numerics statistics of every FP8 slot of a model.

The inspector installs itself as the observer of :func:`fp8kit.torch.slot_cast.quantize_slot`,
the single place where module slots are cast to FP8. Each observed cast queues a small float64
statistics vector on the tensor's device (no host sync); :meth:`Inspector.step` stacks the queue,
copies it to the host once and turns it into one :class:`SlotStats` per slot. When no inspector
is attached, or on steps it does not sample, the observer is not installed at all.

One inspector is attached at a time (docs/decisions/0402). The installed observer holds the
inspector only weakly, so an attached inspector that is garbage-collected detaches itself
(docs/decisions/0243); :func:`attached_inspector` returns the attached one.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from fp8kit.formats import FP8Format
from fp8kit.recipe import Float8CurrentScaling, Recipe, require_int
from fp8kit.torch import slot_cast
from fp8kit.torch.inspect.stats import cast_statistics, combine
from fp8kit.torch.quantization import Float8Tensor, current_scale
from fp8kit.torch.state import BwdSlot, FP8Meta, FwdSlot, ScalingState

__all__ = ["Inspector", "SlotName", "SlotStats", "attached_inspector"]

# The attached inspector, held weakly (docs/decisions/0243): None, or a reference that may be
# dead once the inspector was garbage-collected (its finalizer has then uninstalled it).
_attached: weakref.ref[Inspector] | None = None
# Held while an inspector attaches or detaches: two threads attaching at once must not both
# succeed. Reentrant: the garbage collection in attach() may run a dropped inspector's finalizer.
_attach_lock = threading.RLock()


@dataclass(frozen=True)
class SlotName:
    """Where a slot lives: owning module, GEMM within it, direction and slot kind.

    ``name`` joins the non-empty parts with dots, e.g. ``"blocks.0.mlp.fc1.INPUT"`` or
    ``"blocks.0.attn.proj.GRAD_OUTPUT"``.
    """

    module: str
    gemm: str
    direction: str  # "forward" or "backward"
    slot: str  # FwdSlot / BwdSlot member name

    @property
    def name(self) -> str:
        return ".".join(p for p in (self.module, self.gemm, self.slot) if p)

    @property
    def layer(self) -> str:
        """Module and GEMM without the slot kind (``"blocks.0.mlp.fc1"``)."""
        return ".".join(p for p in (self.module, self.gemm) if p) or "<root>"


@dataclass(frozen=True)
class SlotStats:
    """Statistics of one FP8 slot over one step (definitions in :mod:`.stats`).

    ``saturated`` and ``flushed`` are fractions of ``numel`` (0..1), ``snr_db`` in decibels,
    ``amax`` and ``scale`` in the units of the tensor (``scale`` is dimensionless: FP8 per unit).
    """

    step: int
    name: str
    module: str
    gemm: str
    direction: str
    slot: str
    fp8_format: str
    casts: int
    numel: int
    amax: float
    scale: float
    saturated: float
    flushed: float
    snr_db: float
    nonfinite_events: int  # update events so far whose amax was infinite (scale frozen then)

    @property
    def layer(self) -> str:
        return ".".join(p for p in (self.module, self.gemm) if p) or "<root>"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _slot_scale(
    q: Float8Tensor, recipe: Recipe, state: ScalingState, slot: int, fmt: FP8Format
) -> torch.Tensor:
    """The scale ``quantize_slot`` just used (same branches, same arithmetic), chosen on the
    device: a slot without history under ``first_step_scaling="current"`` used the current
    scale (no host read to ask which, docs/decisions/0402-numerics-inspector.md)."""
    if isinstance(recipe, Float8CurrentScaling):
        return current_scale(q.amax, fmt, recipe.power_2_scale)  # type: ignore[arg-type]
    if recipe.first_step_scaling == "current":
        first = current_scale(q.amax, fmt)  # type: ignore[arg-type]
        return torch.where(state.update_count[slot] > 0, state.scale[slot], first)
    return state.scale[slot]


def _to_host(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Copy tensors of any shapes to the host as flat lists of floats, order kept.

    The tensors of one device are flattened, converted to float64 and concatenated on that
    device, then copied in one transfer: one host sync per device (ADR 0402). float64 holds
    every statistic and every count below 2**53 exactly.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    rows: list[list[float]] = [[] for _ in tensors]
    for indices in by_device.values():
        flat = torch.cat([tensors[i].reshape(-1).to(torch.float64) for i in indices])
        host = flat.cpu().tolist()
        start = 0
        for i in indices:
            end = start + tensors[i].numel()
            rows[i] = host[start:end]
            start = end
    return rows


def attached_inspector() -> Inspector | None:
    """The inspector attached now, or None (a handle to detach one whose name was lost)."""
    return _attached() if _attached is not None else None


def _other_attached() -> Inspector | None:
    """The attached inspector, after one garbage collection if one seems attached.

    An unreachable inspector caught in a reference cycle (say, stored on its own model) is only
    freed by the cycle collector; collecting runs its finalizer, which detaches it.
    """
    if attached_inspector() is None:
        return None
    gc.collect()
    return attached_inspector()


class _WeakObserver:
    """The callable installed as ``slot_cast._observer``: forwards to the inspector while it
    lives, holding it only weakly so the hook never keeps a dropped inspector alive."""

    __slots__ = ("_inspector",)

    def __init__(self, inspector: Inspector) -> None:
        self._inspector = weakref.ref(inspector)

    def __call__(self, *args: Any) -> None:
        inspector = self._inspector()
        if inspector is not None:
            inspector._observe(*args)


def _release(observer: _WeakObserver) -> None:
    """Finalizer of an attached inspector: uninstall its observer (if still installed)."""
    if slot_cast._observer is observer:
        slot_cast._observer = None


class _Names:
    """Maps scaling states to the module that owns them (rescanning the model when needed)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._owners: dict[int, tuple[ScalingState, str, str, tuple[str, ...]]] = {}
        self._unknown: dict[int, int] = {}
        self._alive: dict[int, ScalingState] = {}
        self._cache: dict[tuple[int, int], SlotName] = {}

    def _scan(self) -> None:
        for fqn, module in self._model.named_modules():
            meta = getattr(module, "fp8_meta", None)
            if not isinstance(meta, FP8Meta):
                continue
            names = tuple(getattr(module, "fp8_gemm_names", ()))
            if len(names) != meta.num_gemms:
                names = (
                    ("",)
                    if meta.num_gemms == 1
                    else tuple(f"gemm{g}" for g in range(meta.num_gemms))
                )
            for direction, state in (("forward", meta.forward), ("backward", meta.backward)):
                self._owners[id(state)] = (state, fqn, direction, names)

    def _owner(self, state: ScalingState) -> tuple[str, str, tuple[str, ...]] | None:
        entry = self._owners.get(id(state))
        if entry is None or entry[0] is not state:
            self._scan()
            entry = self._owners.get(id(state))
        if entry is None or entry[0] is not state:
            return None
        return entry[1], entry[2], entry[3]

    def __call__(self, state: ScalingState, slot: int) -> SlotName:
        key = (id(state), slot)
        cached = self._cache.get(key)
        if cached is not None and self._alive.get(id(state)) is state:
            return cached
        owner = self._owner(state)
        if owner is None:
            # Not a state of a module of the model: numbered by order of appearance.
            index = self._unknown.setdefault(id(state), len(self._unknown))
            name = SlotName(f"<unknown{index}>", "", "unknown", f"slot{slot}")
        else:
            fqn, direction, gemm_names = owner
            per_gemm = 3 if direction == "forward" else 2
            gemm, kind = divmod(slot, per_gemm)
            kind_name = FwdSlot(kind).name if direction == "forward" else BwdSlot(kind).name
            gemm_name = gemm_names[gemm] if gemm < len(gemm_names) else f"gemm{gemm}"
            name = SlotName(fqn, gemm_name, direction, kind_name)
        self._alive[id(state)] = state
        self._cache[key] = name
        return name


class Inspector:
    """Collect per-step FP8 statistics of every slot of ``model`` (amax, scale, saturation,
    flush-to-zero, SNR).

    Args:
        model: the model whose FP8 modules are named in the results by their ``named_modules``
            paths; casts of modules outside it are recorded as ``<unknownN>.slotI``.
        every: record the steps whose number is a multiple of ``every`` (``0, every,
            2*every, ...`` of the inspector's own count, or of the numbers passed to
            :meth:`step`). Casts are observed on a step when its number is predicted to be
            sampled: the previous :meth:`step` number plus one. Before the first :meth:`step`
            call the number is unknown, so the first step is observed and its records are
            dropped unless its number is a multiple of ``every``; other unsampled steps cost
            nothing. Pass consecutive numbers: after a jump the prediction is off for one step
            (docs/decisions/0243).

    Usage::

        inspector = Inspector(model)
        with inspector:                       # installs the observer
            for step in range(n):
                with f8.autocast(recipe=recipe):
                    loss = model(x).sum()
                loss.backward()
                inspector.step()              # one host sync: closes the step
        inspector.to_csv("fp8_stats.csv")

    Only one inspector can be attached at a time: a second :meth:`attach` raises until the first
    is detached (:func:`attached_inspector` returns it). An attached inspector that is
    garbage-collected detaches itself.
    """

    def __init__(self, model: nn.Module, *, every: int = 1) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        require_int("every", every, 1)
        self.every = every
        self.records: list[SlotStats] = []
        self._model_type = type(model).__name__
        self._names = _Names(model)
        self._pending: list[tuple[SlotName, str, int, torch.Tensor]] = []
        self._counted: dict[SlotName, tuple[ScalingState, int]] = {}  # slots cast this step
        self._observer = _WeakObserver(self)
        self._finalizer: weakref.finalize | None = None
        self._attached = False
        self._paused = 0
        self._with_attached: list[bool] = []  # per open `with` block: whether it attached
        self._next_step: int | None = None  # None: the first step's number is not known yet

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return (
            f"Inspector({self._model_type}, every={self.every}, {state}, "
            f"{len(self.records)} records)"
        )

    # -- attaching -----------------------------------------------------------------------------

    def attach(self) -> Inspector:
        """Start observing casts (from the current step on).

        Raises:
            RuntimeError: another inspector is attached (detach it first), or something other
                than an inspector installed ``slot_cast._observer``.
        """
        global _attached
        with _attach_lock:  # the check and the install, one step for every thread
            if self._attached:
                return self
            other = _other_attached()
            if other is not None:
                raise RuntimeError(
                    f"another fp8kit Inspector is already attached ({other!r}): call its .detach() "
                    "(or leave its `with` block) first; fp8kit.torch.inspect.attached_inspector() "
                    "returns it. One inspector at a time."
                )
            if slot_cast._observer is not None:
                raise RuntimeError(
                    "fp8kit.torch.slot_cast._observer is set by something other than an Inspector "
                    f"({slot_cast._observer!r}): set it back to None before attaching"
                )
            _attached = weakref.ref(self)
            # Dropping the attached inspector uninstalls its observer (docs/decisions/0243).
            self._finalizer = weakref.finalize(self, _release, self._observer)
            self._attached = True
            self._arm()
            return self

    def detach(self) -> None:
        """Stop observing; casts queued for an unfinished step are dropped."""
        global _attached
        with _attach_lock:
            if self._attached:
                _release(self._observer)
                if attached_inspector() is self:
                    _attached = None
                if self._finalizer is not None:
                    self._finalizer.detach()
                    self._finalizer = None
            self._attached = False
        self._pending.clear()
        self._counted.clear()

    def __enter__(self) -> Inspector:
        """Attach for the block; a block entered while already attached (nested, or after
        :meth:`attach`) leaves it attached at its end."""
        attaching = not self._attached
        self.attach()  # raises before the block opens when another inspector is attached
        self._with_attached.append(attaching)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._with_attached.pop():
            self.detach()

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def sampling(self) -> bool:
        """Whether casts made now are observed (attached, not paused, and the coming step
        predicted to be sampled); they are recorded if :meth:`step`'s number is sampled."""
        return self._attached and slot_cast._observer is self._observer

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Casts inside this block are not observed (e.g. evaluation between training steps)."""
        self._paused += 1
        self._arm()
        try:
            yield
        finally:
            self._paused -= 1
            self._arm()

    def _sampled(self, number: int) -> bool:
        """Whether step ``number`` is recorded: a multiple of ``every``."""
        return number % self.every == 0

    def _arm(self) -> None:
        """Install the observer iff attached, not paused and the coming step may be sampled."""
        coming = self._next_step
        want = self._attached and not self._paused and (coming is None or self._sampled(coming))
        if want:
            slot_cast._observer = self._observer
        elif slot_cast._observer is self._observer:
            slot_cast._observer = None

    # -- observing -----------------------------------------------------------------------------

    def _observe(
        self,
        x: torch.Tensor,
        q: Float8Tensor,
        recipe: Recipe,
        state: ScalingState,
        slot: int,
        fmt: FP8Format,
    ) -> None:
        scale = _slot_scale(q, recipe, state, slot, fmt)
        values = cast_statistics(x, q, scale, fmt.max)
        name = self._names(state, slot)
        self._pending.append((name, fmt.name, x.numel(), values))
        self._counted[name] = (state, slot)

    def step(self, step: int | None = None) -> list[SlotStats]:
        """Close the current step: one host sync, then one :class:`SlotStats` per slot.

        Args:
            step: the number to record (default: the inspector's own count, starting at 0).
                The next step is numbered ``step + 1``. Only steps whose number is a multiple
                of ``every`` are recorded.

        Returns:
            The new records (also appended to :attr:`records`); empty on unsampled steps.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int or None, got {step!r}")
        coming = 0 if self._next_step is None else self._next_step
        number = coming if step is None else step
        new = self._close(number) if self._sampled(number) else []
        self._pending.clear()
        self._counted.clear()
        self.records.extend(new)
        self._next_step = number + 1
        self._arm()
        return new

    def _close(self, number: int) -> list[SlotStats]:
        """Records of step ``number`` from the queued casts: one copy to the host per device."""
        if not self._pending:
            return []
        counted = list(self._counted.items())
        # Read after the step's update events: counts include this step's non-finite amaxes.
        host = _to_host(
            [values for *_, values in self._pending]
            + [state.nonfinite_count[i] for _, (state, i) in counted]
        )
        rows, counts = host[: len(self._pending)], host[len(self._pending) :]
        nonfinite = {name: int(c[0]) for (name, _), c in zip(counted, counts, strict=True)}
        grouped: dict[SlotName, tuple[str, list[tuple[int, list[float]]]]] = {}
        for (name, fmt_name, numel, _), values in zip(self._pending, rows, strict=True):
            grouped.setdefault(name, (fmt_name, []))[1].append((numel, values))
        new: list[SlotStats] = []
        for name, (fmt_name, entries) in grouped.items():
            t = combine(entries)
            new.append(
                SlotStats(
                    step=number,
                    name=name.name,
                    module=name.module,
                    gemm=name.gemm,
                    direction=name.direction,
                    slot=name.slot,
                    fp8_format=fmt_name,
                    casts=t.casts,
                    numel=t.numel,
                    amax=t.amax,
                    scale=t.scale,
                    saturated=t.saturated,
                    flushed=t.flushed,
                    snr_db=t.snr_db,
                    nonfinite_events=nonfinite[name],
                )
            )
        return new

    # -- results -------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Slot names seen so far, in order of first appearance."""
        return list(dict.fromkeys(r.name for r in self.records))

    def series(self, name: str, metric: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of ``metric`` (a :class:`SlotStats` field) for slot ``name``."""
        if metric not in SlotStats.__dataclass_fields__:
            raise ValueError(
                f"metric must be one of {list(SlotStats.__dataclass_fields__)}, got {metric!r}"
            )
        picked = [r for r in self.records if r.name == name]
        if self.records and not picked:  # a typo would otherwise read as "no data yet"
            raise ValueError(f"name must be one of the recorded slots {self.names()}, got {name!r}")
        return [r.step for r in picked], [getattr(r, metric) for r in picked]

    def clear(self) -> None:
        """Forget all records (and queued casts)."""
        self.records.clear()
        self._pending.clear()
        self._counted.clear()

    def to_csv(self, path: Any) -> None:
        from fp8kit.torch.inspect.export import write_csv

        write_csv(self.records, path)

    def to_json(self, path: Any) -> None:
        from fp8kit.torch.inspect.export import write_json

        write_json(self.records, path)

    def to_tensorboard(self, log_dir: Any = None, *, writer: Any = None) -> None:
        from fp8kit.torch.inspect.export import write_tensorboard

        write_tensorboard(self.records, log_dir, writer=writer)

    def plot(self, path: Any, **kwargs: Any) -> None:
        from fp8kit.torch.inspect.plot import plot_stats

        plot_stats(self.records, path, **kwargs)
