"""``fp8kit.torch.kernels.delayed_update_`` (docs/semantics.md section 3) on every backend.

One deterministic list of cases (sequences of update events on random states with zero-skips,
inf, NaN, subnormal and huge amaxes, ``ran`` masks, given staging vectors, non-finite counters) runs
through the native library and the torch reference in this process and through the Triton
kernel under ``TRITON_INTERPRET=1`` in a subprocess; every state after every event must equal,
bit for bit, the numpy model: ``tests/reference.py``'s ``update_reference`` (the per-slot rule
of docs/semantics.md section 3 in float32) wrapped with the kernel's extra inputs.
docs/semantics.md's worked numbers run through the same path.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from fp8kit.formats import E4M3, E5M2
from fp8kit.recipe import DelayedScaling
from fp8kit.torch import kernels
from tests.reference import update_reference
from tests.torch import test_kernels
from tests.torch.test_kernels import triton_results

STATE = ("history", "scale", "scale_inv", "count", "nonfinite")


@dataclass(frozen=True)
class UpdateCase:
    """A state ``(L, n)`` and the update events run on it.

    ``events``: per event ``(values, ran, staging)``: ``values`` (n,) are recorded into the
    staging row (``H[0] = max(H[0], v)``) unless ``staging`` is True, in which case they are
    passed as the ``staging`` vector; ``ran`` is None or a bool mask."""

    name: str
    length: int
    n: int
    algo: str = "max"
    margin: float = 0
    interval: int = 1
    power_2: bool = False
    fmax: float = E4M3.max
    nonfinite: bool = False
    events: tuple[tuple[tuple[float, ...], tuple[bool, ...] | None, bool], ...] = field(
        default_factory=tuple
    )
    seed: int = 0


def _random_events(
    n: int, count: int, seed: int, ran: bool, staging: bool
) -> tuple[tuple[tuple[float, ...], tuple[bool, ...] | None, bool], ...]:
    rng = np.random.default_rng(seed)
    events = []
    for _ in range(count):
        v = np.exp(rng.uniform(-12, 12, n)).astype(np.float32)
        v[rng.random(n) < 0.3] = 0.0  # skipped slots
        v[rng.random(n) < 0.06] = np.inf
        v[rng.random(n) < 0.05] = 1e-40  # subnormal: the default rule overflows to FLT_MAX
        v[rng.random(n) < 0.05] = 3e38
        v[rng.random(n) < 0.04] = np.nan  # a NaN staging value: ignored by the window's max
        mask = tuple(bool(b) for b in rng.random(n) > 0.3) if ran else None
        events.append((tuple(float(a) for a in v), mask, staging))
    return tuple(events)


def _spec_events(amaxes: list[float | None]) -> tuple[tuple[tuple[float, ...], None, bool], ...]:
    return tuple(((0.0 if a is None else a,), None, False) for a in amaxes)


# docs/semantics.md section 10: (case, scales after each event)
SPEC_SEQUENCES = [
    (UpdateCase("10.1", 4, 1, events=_spec_events([1, 2, 8, 3, 0.5, 0.5, 0.5, 0.5])),
     [448, 224, 56, 56, 56, 56, 149.33333, 896]),
    (UpdateCase("10.2", 4, 1, "most_recent", events=_spec_events([1, 2, 8, 3, 0.5, 0.5, 0.5, 0.5])),
     [448, 224, 56, 149.33333, 896, 896, 896, 896]),
    (UpdateCase("10.3", 2, 1, margin=1, events=_spec_events([1, 3])), [224, 74.666664]),
    (UpdateCase("10.3-", 2, 1, margin=-1, events=_spec_events([1, 3])), [896, 298.66666]),
    (UpdateCase("10.4", 2, 1, fmax=E5M2.max, events=_spec_events([1, 3, 0.001])),
     [57344, 19114.666, 19114.666]),
    (UpdateCase("10.5", 3, 1, events=_spec_events([None, None, 5])), [1, 1, 89.6]),
    (UpdateCase("10.6", 2, 1, events=_spec_events([8, 1, None])), [56, 56, 56]),
    (UpdateCase("10.7", 3, 1, events=_spec_events([1, math.inf, 2, 2, 2])),
     [448, 448, 448, 448, 224]),
    (UpdateCase("10.7mr", 3, 1, "most_recent", events=_spec_events([1, math.inf, 2, 2, 2])),
     [448, 448, 224, 224, 224]),
    (UpdateCase("10.8", 1, 1, events=_spec_events([1e-37, 1e-30, 3e38, 4, 2, None, 16])),
     [3.4028234663852886e38, 4.48e32, 1.4933333e-36, 112, 224, 224, 28]),
    (UpdateCase("10.9", 1, 1, power_2=True, events=_spec_events([3, 0.001])), [128, 262144]),
    (UpdateCase("10.9m", 2, 1, margin=1, power_2=True, events=_spec_events([3])), [64]),
    (UpdateCase("10.10", 4, 1, interval=2, events=_spec_events([1, 2, 8, 3])), [448, 448, 56, 56]),
]  # fmt: skip


@functools.cache
def update_cases() -> tuple[UpdateCase, ...]:
    cases = [case for case, _ in SPEC_SEQUENCES]
    grid = [
        # name, L, n, algo, margin, interval, power_2, fmax, ran, staging, nonfinite
        ("L=1 max", 1, 40, "max", 0, 1, False, E4M3.max, False, False, True),
        ("L=2 most_recent ran", 2, 40, "most_recent", 0, 1, False, E4M3.max, True, False, True),
        ("L=5 margin 1 interval 2", 5, 100, "max", 1, 2, False, E4M3.max, True, False, False),
        ("L=5 margin -1 E5M2", 5, 3, "max", -1, 1, False, E5M2.max, False, False, True),
        ("L=17 margin 2.5", 17, 40, "max", 2.5, 1, False, E4M3.max, False, True, True),
        ("L=17 power_2 ran staging", 17, 100, "max", 0, 3, True, E4M3.max, True, True, True),
        ("L=70 power_2 margin 3", 70, 40, "max", 3, 1, True, E5M2.max, True, False, False),
        ("L=70 p2 margin -2 mr", 70, 33, "most_recent", -2, 2, True, E4M3.max, False, False, True),
        ("L=3 power_2 margin 200", 3, 40, "max", 200, 1, True, E4M3.max, False, False, False),
        ("L=3 margin 300", 3, 40, "max", 300, 1, False, E4M3.max, False, True, False),
    ]  # fmt: skip
    for i, (name, length, n, algo, margin, interval, p2, fmax, ran, stg, nf) in enumerate(grid):
        events = _random_events(n, 4, seed=i, ran=ran, staging=stg)
        cases.append(
            UpdateCase(name, length, n, algo, margin, interval, p2, fmax, nf, events, seed=i)
        )
    return tuple(cases)


def initial_state(case: UpdateCase) -> dict[str, torch.Tensor | None]:
    """History with random completed rows (some 0, some inf), staging 0, random scales and
    counts (so interval phases differ per slot); worked-number cases start fresh (0, scale 1, count
    0)."""
    n, length = case.n, case.length
    if case.name.startswith("10."):
        history = np.zeros((length, n), np.float32)
        scale = np.ones(n, np.float32)
        count = np.zeros(n, np.int64)
    else:
        rng = np.random.default_rng(100 + case.seed)
        history = np.exp(rng.uniform(-8, 8, (length, n))).astype(np.float32)
        history[rng.random((length, n)) < 0.2] = 0.0
        history[rng.random((length, n)) < 0.02] = np.inf
        history[rng.random((length, n)) < 0.02] = np.nan  # e.g. from a loaded checkpoint
        history[0] = 0.0
        scale = np.exp(rng.uniform(-3, 5, n)).astype(np.float32)
        count = rng.integers(0, 6, n).astype(np.int64)
    return {
        "history": torch.from_numpy(history),
        "scale": torch.from_numpy(scale),
        "scale_inv": torch.from_numpy(np.float32(1) / scale),
        "count": torch.from_numpy(count),
        "nonfinite": torch.zeros(n, dtype=torch.int64) if case.nonfinite else None,
    }


def run_case(
    case: UpdateCase, backend: str, device: str = "cpu"
) -> list[dict[str, torch.Tensor | None]]:
    """Every event of ``case`` through ``delayed_update_`` with the state on ``device``; the
    state after each one, on the CPU."""
    state = {k: (None if t is None else t.to(device)) for k, t in initial_state(case).items()}
    out = []
    for values, ran, staging in case.events:
        v = torch.tensor(values, dtype=torch.float32, device=device)
        if not staging:
            state["history"][0] = torch.maximum(state["history"][0], v)
        kernels.delayed_update_(
            state["history"],
            state["scale"],
            state["scale_inv"],
            state["count"],
            fmax=case.fmax,
            margin=case.margin,
            interval=case.interval,
            algo=case.algo,
            power_2_scale=case.power_2,
            ran=None if ran is None else torch.tensor(ran, device=device),
            staging=v if staging else None,
            nonfinite_count=state["nonfinite"],
            backend=backend,
        )
        out.append({k: (None if t is None else t.cpu().clone()) for k, t in state.items()})
    return out


def run_case_prepared(case: UpdateCase, backend: str) -> list[dict[str, torch.Tensor | None]]:
    """Every event of ``case`` (no ``ran`` mask) through one function of
    ``prepare_delayed_update``; the state after each one. A case of staging vectors binds one
    row and writes each event's values into it (as a multi-rank event's reduction buffer)."""
    state = initial_state(case)
    staged = case.events[0][2]
    row = torch.zeros(state["scale"].shape) if staged else None  # type: ignore[union-attr]
    update = kernels.prepare_delayed_update(
        state["history"],  # type: ignore[arg-type]
        state["scale"],  # type: ignore[arg-type]
        state["scale_inv"],  # type: ignore[arg-type]
        state["count"],  # type: ignore[arg-type]
        fmax=case.fmax,
        margin=case.margin,
        interval=case.interval,
        algo=case.algo,
        power_2_scale=case.power_2,
        staging=row,
        nonfinite_count=state["nonfinite"],
        backend=backend,
    )
    out = []
    for values, ran, staging in case.events:
        assert ran is None and staging == staged
        if row is not None:
            row.copy_(torch.tensor(values))
        else:
            history = state["history"]
            history[0] = torch.maximum(history[0], torch.tensor(values))  # type: ignore[index]
        update()
        out.append({k: (None if t is None else t.clone()) for k, t in state.items()})
    return out


def run_all_cases(backend: str, path: str | None = None, device: str = "cpu") -> list[list[dict]]:
    results = [run_case(case, backend, device) for case in update_cases()]
    if path is not None:
        torch.save(results, path)
    return results


def numpy_events(case: UpdateCase) -> list[dict[str, np.ndarray | None]]:
    """The model: tests/reference.py's update_reference, with the event value taken from the
    staging vector or row, 0 where not ran, a skipped slot's staging left in place, the +inf
    counter, and scale_inv = float32(1) / scale."""
    recipe = DelayedScaling(
        amax_history_len=case.length,
        amax_compute_algo=case.algo,
        margin=case.margin,
        interval=case.interval,
        power_2_scale=case.power_2,
    )
    state = {k: (None if t is None else t.numpy().copy()) for k, t in initial_state(case).items()}
    out = []
    for values, ran, staging in case.events:
        v = np.array(values, np.float32)
        h = state["history"]
        if not staging:
            h[0] = np.maximum(h[0], v)
        kept = h[0].copy()
        r = v.copy() if staging else h[0].copy()
        if ran is not None:
            r[~np.array(ran)] = 0.0
        h = h.copy()
        h[0] = r
        with np.errstate(all="ignore"):
            h, s, c = update_reference(h, state["scale"], state["count"], recipe, case.fmax)
            inv = np.float32(1) / s
        skipped = r == 0
        h[0, skipped] = kept[skipped]
        nf = state["nonfinite"]
        if nf is not None:
            nf = nf + (r == np.inf).astype(np.int64)
        state = {"history": h, "scale": s, "scale_inv": inv, "count": c, "nonfinite": nf}
        out.append({k: (None if a is None else a.copy()) for k, a in state.items()})
    return out


def _unmasked(case: UpdateCase) -> bool:
    """No ``ran`` mask, and staging vectors in every event or in none."""
    staged = {staging for _, _, staging in case.events}
    return all(ran is None for _, ran, _ in case.events) and len(staged) == 1


def check_results(
    results: list[list[dict]], backend: str, cases: tuple[UpdateCase, ...] | None = None
) -> None:
    cases = update_cases() if cases is None else cases
    assert len(results) == len(cases)
    for case, got_events in zip(cases, results, strict=True):
        want_events = numpy_events(case)
        assert len(got_events) == len(want_events)
        for k, (got, want) in enumerate(zip(got_events, want_events, strict=True)):
            for name in STATE:
                what = f"{backend}: {case.name}, event {k + 1}, {name}"
                if want[name] is None:
                    assert got[name] is None, what
                    continue
                g = got[name].numpy()
                w = want[name]
                assert g.dtype == w.dtype and g.shape == w.shape, what
                bits = np.int32 if g.dtype == np.float32 else np.int64
                both_nan = np.isnan(g) & np.isnan(w)  # all False for integer counts
                bad = np.argwhere((g.view(bits) != w.view(bits)) & ~both_nan)  # NaN payloads vary
                assert bad.size == 0, (
                    f"{what}: at {bad[0]}: got {g[tuple(bad[0])]}, want {w[tuple(bad[0])]}"
                )


def test_update_native() -> None:
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    check_results(run_all_cases("native"), "native")


def test_update_reference() -> None:
    check_results(run_all_cases("reference"), "reference")


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_prepared_update_matches_the_model(backend: str) -> None:
    """The prepared event (arguments checked and bound once, the registry's steady state) gives
    the model's bits event after event, on the worked numbers and the random unmasked cases."""
    if backend == "native" and not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    cases = tuple(case for case in update_cases() if _unmasked(case))
    assert len(cases) >= 15  # the worked numbers and several random grids
    assert any(case.events[0][2] for case in cases)  # staging vectors among them
    check_results([run_case_prepared(case, backend) for case in cases], backend, cases)


def test_prepared_update_checks_its_arguments_once() -> None:
    history, ones = torch.zeros(4, 3), torch.ones(3)
    count = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"count must be a contiguous torch\.int64 tensor"):
        kernels.prepare_delayed_update(history, ones, ones, count.float(), fmax=448.0)
    with pytest.raises(ValueError, match="algo must be one of"):
        kernels.prepare_delayed_update(history, ones, ones, count, fmax=448.0, algo="mean")
    with pytest.raises(ValueError, match="backend must be None or one of"):
        kernels.prepare_delayed_update(history, ones, ones, count, fmax=448.0, backend="gpu")


def test_update_triton_under_interpreter() -> None:
    """Run in test_kernels.py's Triton subprocess (one interpreter start for both files)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional: pip install -c constraints.txt triton)")
    check_results(triton_results()[1], "triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("conversion", ["hardware", "software"])
def test_triton_on_the_gpu_matches_the_model(
    conversion: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every cast, amax (test_kernels.py) and update case through the compiled Triton kernels on
    CUDA tensors, bit for bit against the numpy model, with the GPU's FP8 conversion (sm_89+)
    and with the integer one. The interpreter tests check the kernels' logic; this checks the
    GPU build: a failed compile or launch would fall back to the torch path with one warning,
    and the benchmarks would time that."""
    test_kernels.use_triton_conversion(conversion, monkeypatch)
    assert kernels.backend_for(torch.empty(1, device="cuda")) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning fails the test
        test_kernels._check_all(test_kernels.run_all_cases("triton", device="cuda"), "triton GPU")
        check_results(run_all_cases("triton", device="cuda"), "triton GPU")


@pytest.mark.parametrize("backend", [None, "reference"])
def test_update_spec_worked_numbers(backend: str | None) -> None:
    """docs/semantics.md section 10's sequences through delayed_update_ (the automatic backend:
    native here)."""
    for case, scales in SPEC_SEQUENCES:
        got = [event["scale"].item() for event in run_case(case, backend)]  # type: ignore[arg-type]
        assert got == pytest.approx(scales, rel=1e-6), case.name
    _, (h10_1, *_) = None, [run_case(SPEC_SEQUENCES[0][0], backend)]  # type: ignore[arg-type]
    assert h10_1[3]["history"][:, 0].tolist() == [0, 2, 8, 3]
    assert h10_1[7]["history"][:, 0].tolist() == [0, 0.5, 0.5, 0.5]


def test_update_event_is_one_native_call_without_aten_ops() -> None:
    """The CPU update event runs no aten operator (the lead's gate counts them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    h = torch.rand(16, 9)
    scale, inv = torch.ones(9), torch.ones(9)
    count, nf = torch.zeros(9, dtype=torch.int64), torch.zeros(9, dtype=torch.int64)
    ran, staging = torch.ones(9, dtype=torch.bool), torch.rand(9)
    with Ops() as ops:
        kernels.delayed_update_(
            h,
            scale,
            inv,
            count,
            fmax=448.0,
            margin=1,
            interval=2,
            algo="most_recent",
            power_2_scale=True,
            ran=ran,
            staging=staging,
            nonfinite_count=nf,
        )
    assert ops.names == []
    assert count.tolist() == [1] * 9


def test_update_errors_name_the_parameter() -> None:
    h = torch.zeros(4, 3)
    s, si, c = torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.int64)

    def call(**kw: object) -> None:
        args = {"history": h, "scale": s, "scale_inv": si, "count": c, "fmax": 448.0, **kw}
        kernels.delayed_update_(
            args.pop("history"),
            args.pop("scale"),
            args.pop("scale_inv"),
            args.pop("count"),
            **args,  # type: ignore[arg-type]
        )

    with pytest.raises(TypeError, match="history must be a contiguous float32"):
        call(history=h.double())
    with pytest.raises(TypeError, match="history must be"):
        call(history=h.t())
    with pytest.raises(
        TypeError, match=r"scale must be a contiguous torch\.float32 tensor of shape \(3,\)"
    ):
        call(scale=torch.ones(4))
    with pytest.raises(TypeError, match=r"count must be a contiguous torch\.int64"):
        call(count=torch.zeros(3))
    with pytest.raises(TypeError, match=r"ran must be a contiguous torch\.bool"):
        call(ran=torch.ones(3))
    with pytest.raises(TypeError, match="staging must be"):
        call(staging=torch.ones(2))
    with pytest.raises(TypeError, match="nonfinite_count must be"):
        call(nonfinite_count=torch.zeros(3))
    # Valid twins seen first (cached by value): True == 1 and 0 == False must still raise.
    call(margin=1, interval=1, power_2_scale=False)
    with pytest.raises(TypeError, match="margin must be a finite int or float, got True"):
        call(margin=True)
    with pytest.raises(ValueError, match="interval must be an int >= 1, got True"):
        call(interval=True)
    with pytest.raises(TypeError, match="power_2_scale must be a bool, got 0"):
        call(power_2_scale=0)
    with pytest.raises(TypeError, match=r"nonfinite_count must be .* on history's device"):
        call(nonfinite_count=torch.zeros(3, dtype=torch.int64, device="meta"))  # was ignored
    with pytest.raises(ValueError, match="algo must be one of"):
        call(algo=lambda h: h[0])
    with pytest.raises(ValueError, match="interval must be an int >= 1"):
        call(interval=0)
    with pytest.raises(ValueError, match="power_2_scale=True needs an integer margin"):
        call(margin=0.5, power_2_scale=True)
    with pytest.raises(ValueError, match="fmax must be a positive finite float32 value"):
        call(fmax=-1.0)
    with pytest.raises(TypeError, match="margin must be a finite int or float"):
        call(margin="1")
