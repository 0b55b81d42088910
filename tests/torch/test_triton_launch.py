"""The kept Triton launchers (fp8kit.torch.kernels.triton_launch): which launches reuse one, with
stand-in kernels on the CPU; on a GPU, repeated casts through the kept launcher against the
reference, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fp8kit.formats import E4M3
from fp8kit.torch.kernels import (
    NativeKernelWarning,
    cast_fp8,
    delayed_update_,
    prepare_cast,
    prepare_delayed_update,
    triton_launch,
)
from fp8kit.torch.kernels._native import env_flag
from fp8kit.torch.kernels.reference import cast_to_fp8_reference


class _Compiled:
    """Stands in for Triton's CompiledKernel: ``[grid]`` gives a launcher that records calls."""

    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    def launch_metadata(self) -> None:  # what triton_launch tells a compiled kernel by
        raise AssertionError("not called")

    def __getitem__(self, grid: tuple[int, ...]):
        def launcher(*args: object) -> None:
            # Triton's launcher reads grid[0], grid[1] and grid[2] (triton 3.6 and 3.9)
            self.calls.append(("kept", (grid[0], grid[1], grid[2]), args))

        return launcher


class _Kernel:
    """Stands in for a ``triton.jit`` function: ``[grid](*args, **options)`` records the call and
    returns a compiled kernel (or None, as the interpreter does)."""

    def __init__(self, compiled: bool = True) -> None:
        self.calls: list[tuple] = []
        self.compiled = compiled

    def __getitem__(self, grid: tuple[int, ...]):
        def run(*args: object, **options: object) -> _Compiled | None:
            self.calls.append(("jit", grid, args, options))
            return _Compiled(self.calls) if self.compiled else None

        return run


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    triton_launch.clear()
    yield
    triton_launch.clear()


def _kinds(kernel: _Kernel) -> list[str]:
    return [call[0] for call in kernel.calls]


@pytest.mark.skipif(not triton_launch.fast_launch_enabled(), reason="FP8KIT_TRITON_FAST_LAUNCH=0")
def test_a_repeated_launch_reuses_the_compiled_kernels_launcher() -> None:
    kernel = _Kernel()
    x = torch.zeros(64)
    for _ in range(3):
        triton_launch.launch(kernel, (4,), (x, 64, True), num_warps=8)
    assert _kinds(kernel) == ["jit", "kept", "kept"]
    assert kernel.calls[1] == ("kept", (4, 1, 1), (x, 64, True))  # every argument, in order
    assert kernel.calls[0][3] == {"num_warps": 8}


@pytest.mark.skipif(not triton_launch.fast_launch_enabled(), reason="FP8KIT_TRITON_FAST_LAUNCH=0")
@pytest.mark.parametrize(
    "change",
    ["grid", "size", "flag", "dtype", "alignment", "options"],
)
def test_anything_triton_specialises_on_is_a_new_key(change: str) -> None:
    """A launch that differs in the grid, an int's value, a flag, a tensor's dtype, its address's
    16-byte alignment or an option goes through Triton again, never through a kept launcher."""
    kernel = _Kernel()
    buffer = torch.zeros(64)
    x = buffer[:32]
    triton_launch.launch(kernel, (4,), (x, 32, True), num_warps=8)
    grid, args, options = (4,), [x, 32, True], {"num_warps": 8}
    if change == "grid":
        grid = (5,)
    elif change == "size":
        args[1] = 48
    elif change == "flag":
        args[2] = False
    elif change == "dtype":
        args[0] = x.double()
    elif change == "alignment":
        args[0] = buffer[1:33]  # 4 bytes past a 16-byte boundary
        assert args[0].data_ptr() % 16 != 0 and x.data_ptr() % 16 == 0
    else:
        options = {"num_warps": 4}
    triton_launch.launch(kernel, grid, tuple(args), **options)
    assert _kinds(kernel) == ["jit", "jit"]
    triton_launch.launch(kernel, grid, tuple(args), **options)  # now that key is kept too
    assert _kinds(kernel) == ["jit", "jit", "kept"]


@pytest.mark.skipif(not triton_launch.fast_launch_enabled(), reason="FP8KIT_TRITON_FAST_LAUNCH=0")
def test_fresh_tensors_of_the_same_kind_reuse_the_launcher() -> None:
    """A step's outputs are new tensors at new addresses: same dtype and alignment, same key."""
    kernel = _Kernel()
    for _ in range(3):
        x, out = torch.zeros(64), torch.empty(64, dtype=torch.bfloat16)
        triton_launch.launch(kernel, (2,), (x, out, 64, 0.5, False))
    assert _kinds(kernel) == ["jit", "kept", "kept"]


@pytest.mark.skipif(not triton_launch.fast_launch_enabled(), reason="FP8KIT_TRITON_FAST_LAUNCH=0")
def test_arguments_other_than_tensors_and_scalars_key_by_their_value() -> None:
    """The general form of the key (any other object is its own part) gives the tensors' parts
    as the fast form does, and tells other objects' values apart."""
    x = torch.zeros(8)
    fast = triton_launch.launch_key("k", (1,), (x, 8, True), {})
    general = triton_launch.launch_key("k", (1,), (x, 8, True, None), {})
    assert general[:-1] == fast and general[-1] is None
    assert fast[4] == (torch.float32, x.data_ptr() % 16 == 0)
    kernel = _Kernel()
    for value in ("a", "a", "b"):
        triton_launch.launch(kernel, (1,), (x, value))
    assert _kinds(kernel) == ["jit", "kept", "jit"]


def test_a_kernel_that_returns_no_compiled_kernel_stays_on_the_plain_path() -> None:
    """The interpreter's launch returns None: every launch of that key goes through Triton."""
    kernel = _Kernel(compiled=False)
    x = torch.zeros(8)
    for _ in range(3):
        triton_launch.launch(kernel, (1,), (x, 8))
    assert _kinds(kernel) == ["jit", "jit", "jit"]


def test_the_cache_starts_over_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_launch, "MAX_ENTRIES", 3)
    kernel = _Kernel()
    x = torch.zeros(8)
    for size in range(5):
        triton_launch.launch(kernel, (1,), (x, size))
    triton_launch.launch(kernel, (1,), (x, 0))  # dropped when the cache started over
    triton_launch.launch(kernel, (1,), (x, 4))  # kept since
    assert _kinds(kernel) == ["jit"] * 6 + ["kept"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_on_the_gpu_kept_launchers_cast_like_the_reference() -> None:
    """Casts repeated with fresh inputs of one shape run through the kept launchers (at the
    same and at other 16-byte alignments) and match the reference bit for bit."""
    gen = torch.Generator("cuda").manual_seed(0)
    scale = torch.tensor(3.0, device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        for step in range(4):
            base = torch.randn(130 * 96 + 1, device="cuda", generator=gen).to(dtype) * 50
            x = base[step % 2 : step % 2 + 130 * 96].view(130, 96)  # aligned, then not
            for transpose in (False, True):
                r = cast_fp8(x, scale, torch.float8_e4m3fn, transpose=transpose)
                want, amax = cast_to_fp8_reference(x.cpu(), scale.cpu(), E4M3)
                assert torch.equal(r.data.cpu().view(torch.uint8), want.view(torch.uint8))
                assert torch.equal(r.amax.cpu(), amax)
                if transpose:
                    assert torch.equal(r.data_t.cpu(), r.data.cpu().t().contiguous())
    if triton_launch.fast_launch_enabled():
        assert any(v is not None for v in triton_launch._launchers.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_on_the_gpu_planned_casts_and_bound_events_match_the_reference() -> None:
    """ADR 0262 on a GPU: a delayed slot's planned cast, repeated with fresh inputs at aligned
    and unaligned addresses (so through kept launchers of two patterns), and a bound update
    event give the reference kernels' bytes, amaxes and states."""
    gen = torch.Generator("cuda").manual_seed(0)
    scale = torch.tensor([3.0], device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        for transpose, dbias in ((False, False), (True, False), (True, True)):
            staging = torch.zeros(1, device="cuda")
            cast = prepare_cast(scale, torch.float8_e4m3fn, amax_out=staging)
            want_amax = torch.zeros(1, device="cuda")
            for step in range(6):
                base = torch.randn(130 * 96 + 1, device="cuda", generator=gen).to(dtype) * 50
                x = base[step % 2 : step % 2 + 130 * 96].view(130, 96)
                got = cast(x, transpose, dbias)
                want = cast_fp8(x, scale, torch.float8_e4m3fn, transpose=transpose,
                                amax_out=want_amax, backend="reference")  # fmt: skip
                assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
                assert torch.equal(got.scale_inv, want.scale_inv)
                if transpose:
                    assert torch.equal(got.data_t.view(torch.uint8), want.data_t.view(torch.uint8))
                if dbias:  # its float32 sums run in the kernels' order: the unplanned launch's
                    plain = cast_fp8(x, scale, torch.float8_e4m3fn, dbias=True, backend="triton")
                    assert torch.equal(got.dbias, plain.dbias)
                assert torch.equal(staging, want_amax)
    history = torch.rand(16, 40, device="cuda", generator=gen) * 100
    state = [history, torch.ones(40, device="cuda"), torch.ones(40, device="cuda")]
    state.append(torch.zeros(40, dtype=torch.int64, device="cuda"))
    want_state = [t.clone() for t in state]
    event = prepare_delayed_update(*state, fmax=448.0)
    for _ in range(4):
        state[0][0].uniform_(0, 300, generator=gen)
        want_state[0][0].copy_(state[0][0])
        event()
        delayed_update_(*want_state, fmax=448.0, backend="reference")
        for got_t, want_t in zip(state, want_state, strict=True):
            assert torch.equal(got_t, want_t)


def test_a_launcher_that_raises_turns_the_cache_off_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Triton release whose launchers take other arguments: that launch and every later one go
    through Triton's JIT (nothing is skipped), and one warning says why."""
    monkeypatch.setattr(triton_launch, "_enabled", True)  # restored after the test
    kernel = _Kernel()
    monkeypatch.setattr(_Compiled, "__getitem__", lambda self, grid: _refuse)
    x = torch.zeros(8)
    triton_launch.launch(kernel, (1,), (x, 8))
    with pytest.warns(NativeKernelWarning, match="launcher directly failed.*TypeError: refused"):
        triton_launch.launch(kernel, (1,), (x, 8))
    triton_launch.launch(kernel, (1,), (x, 8))
    assert _kinds(kernel) == ["jit", "jit", "jit"]
    assert not triton_launch.fast_launch_enabled()


def _refuse(*args: object) -> None:
    raise TypeError("refused")


@pytest.mark.parametrize(
    ("value", "want"),
    [(None, True), ("", True), ("0", False), ("Off", False), ("1", True), (" yes ", True)],
)
def test_the_switch_reads_on_off_words(monkeypatch: pytest.MonkeyPatch, value, want) -> None:
    """FP8KIT_TRITON_FAST_LAUNCH (read once, at import) parses like FP8KIT_DISABLE_NATIVE."""
    if value is None:
        monkeypatch.delenv("FP8KIT_TRITON_FAST_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("FP8KIT_TRITON_FAST_LAUNCH", value)
    assert env_flag("FP8KIT_TRITON_FAST_LAUNCH", True) is want


def test_a_bad_switch_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP8KIT_TRITON_FAST_LAUNCH", "fast")
    with pytest.raises(ValueError, match=r"FP8KIT_TRITON_FAST_LAUNCH must be one of .*got 'fast'"):
        env_flag("FP8KIT_TRITON_FAST_LAUNCH", True)


# ---------------------------------------------------------------------------------------------
# Launch sites (ADR 0262): launches that differ only in tensor addresses skip the key


@pytest.mark.skipif(not triton_launch.fast_launch_enabled(), reason="FP8KIT_TRITON_FAST_LAUNCH=0")
def test_a_launch_site_builds_a_key_only_when_an_alignment_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = _Kernel()
    site = triton_launch.LaunchSite(kernel, (2,), num_warps=4)
    keys = []
    real_key = triton_launch.launch_key
    monkeypatch.setattr(triton_launch, "launch_key", lambda *a: keys.append(a) or real_key(*a))
    buffer = torch.zeros(64)
    aligned, shifted = buffer[:32], buffer[1:33]
    for x in (aligned, torch.zeros(32), shifted, shifted, torch.zeros(32)):
        site((x, 32), (x.data_ptr() % 16 == 0,))
    # the last launch changes the pattern back: launch() finds the launcher it kept at first
    assert _kinds(kernel) == ["jit", "kept", "jit", "kept", "kept"]
    # every launch passes all its arguments, in order
    assert kernel.calls[3] == ("kept", (2, 1, 1), (shifted, 32))
    assert kernel.calls[0][3] == {"num_warps": 4}
    # a key per launch that went through launch(), plus one per pattern change to find its entry
    assert len(keys) == 2 * 3


def test_a_launch_site_of_a_plain_key_stays_on_the_plain_path() -> None:
    """The interpreter returns no compiled kernel: every launch goes through Triton."""
    kernel = _Kernel(compiled=False)
    site = triton_launch.LaunchSite(kernel, (1,))
    x = torch.zeros(8)
    for _ in range(3):
        site((x, 8), (True,))
    assert _kinds(kernel) == ["jit", "jit", "jit"]


@pytest.mark.skipif(not triton_launch.fast_launch_enabled(), reason="FP8KIT_TRITON_FAST_LAUNCH=0")
def test_a_bound_launch_reuses_its_launcher_with_the_same_arguments() -> None:
    kernel = _Kernel()
    x = torch.zeros(8)
    event = triton_launch.bind(kernel, (3,), (x, 8, True), num_warps=8)
    for _ in range(3):
        event()
    assert _kinds(kernel) == ["jit", "kept", "kept"]
    assert kernel.calls[2] == ("kept", (3, 1, 1), (x, 8, True))


def test_a_launch_site_whose_launcher_raises_turns_the_cache_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(triton_launch, "_enabled", True)  # restored after the test
    kernel = _Kernel()
    monkeypatch.setattr(_Compiled, "__getitem__", lambda self, grid: _refuse)
    event = triton_launch.bind(kernel, (1,), (torch.zeros(8), 8))
    event()
    with pytest.warns(NativeKernelWarning, match="launcher directly failed.*TypeError: refused"):
        event()
    event()
    assert _kinds(kernel) == ["jit", "jit", "jit"]
    assert not triton_launch.fast_launch_enabled()


def _stand_in_cast_kernels(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, _Kernel]]:
    """``triton_cast`` with its three cast kernels replaced by stand-ins (skips without
    triton), and the stand-ins by name."""
    triton_cast = pytest.importorskip("fp8kit.torch.kernels.triton_cast")
    if not triton_cast.triton_available():
        pytest.skip("triton is not installed")
    kernels = {n: _Kernel() for n in ("_cast_1d_kernel", "_cast_2d_kernel", "_dbias_kernel")}
    for name, kernel in kernels.items():
        monkeypatch.setattr(triton_cast, name, kernel)
    return triton_cast, kernels


def _roles(args: tuple, named: dict[str, torch.Tensor], result: object) -> list[object]:
    """``args`` with each tensor replaced by its role: a name from ``named`` (the bound and input
    tensors), a field of ``result`` (the outputs), or an index of first appearance with its dtype
    and shape (internal buffers); other arguments as they are."""
    fields = {f: getattr(result, f) for f in ("data", "data_t", "amax", "scale_inv", "dbias")}
    seen: list[torch.Tensor] = []
    out: list[object] = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
            continue
        role = next((n for n, t in {**named, **fields}.items() if t is a), None)
        if role is None:
            if not any(a is s for s in seen):
                seen.append(a)
            role = f"buffer {next(i for i, s in enumerate(seen) if s is a)}"
        out.append((role, a.dtype, tuple(a.shape)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("transpose", "dbias"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_a_prepared_slot_cast_launches_what_cast_launches(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, transpose: bool, dbias: bool
) -> None:
    """With stand-in kernels: a delayed-scaling slot's planned cast passes every kernel the
    arguments ``triton_cast.cast`` passes (same scalars, same tensors in the same roles), then
    calls the kept launchers for fresh inputs and outputs."""
    triton_cast, kernels = _stand_in_cast_kernels(monkeypatch)
    spec = triton_cast.cast_spec(E4M3, torch.empty(0, dtype=dtype))
    scale, amax_out = torch.full((4,), 2.0)[1:2], torch.zeros(3)[2:3]
    x = torch.randn(96, 80).to(dtype)
    general = triton_cast.cast(x, scale, spec, transpose, amax_out, dbias, None)
    launched = [c for k in kernels.values() for c in k.calls]
    for k in kernels.values():
        k.calls.clear()
    prepared = triton_cast.PreparedSlotCast(scale, amax_out)
    inputs = [x.clone() for _ in range(3)]
    results = [prepared(fresh, spec, transpose, dbias) for fresh in inputs]
    named = {"x": x, "scale": scale, "amax_out": amax_out}
    for i, (fresh, result) in enumerate(zip(inputs, results, strict=True)):
        calls = [c for k in kernels.values() for c in k.calls[i :: len(results)]]
        assert len(calls) == len(launched)
        for want, got in zip(launched, calls, strict=True):
            # the first finds the launcher cast's launch kept (the same key); later ones call it
            assert got[0] == "kept" or not triton_launch.fast_launch_enabled()
            assert got[1][: len(want[1])] == want[1]  # the grid
            assert _roles(got[2], {**named, "x": fresh}, result) == _roles(want[2], named, general)
    assert results[0].amax is None and general.amax is None


@pytest.mark.skipif(not triton_launch.fast_launch_enabled(), reason="FP8KIT_TRITON_FAST_LAUNCH=0")
def test_clear_makes_launch_sites_forget_their_launchers() -> None:
    kernel = _Kernel()
    site = triton_launch.LaunchSite(kernel, (1,))
    x = torch.zeros(8)
    site((x, 8), (True,))
    site((x, 8), (True,))
    triton_launch.clear()
    site((x, 8), (True,))
    site((x, 8), (True,))
    assert _kinds(kernel) == ["jit", "kept", "jit", "kept"]


class _OnGpu1(torch.Tensor):
    """A CPU tensor that says it lives on CUDA device 1 (for the device guard's wiring)."""

    def get_device(self) -> int:  # type: ignore[override]
        return 1


@pytest.mark.skipif(not triton_launch.fast_launch_enabled(), reason="FP8KIT_TRITON_FAST_LAUNCH=0")
def test_a_launch_on_another_gpu_makes_that_device_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton launches on the current device: tensors on GPU 1 while GPU 0 is current are
    launched inside ``torch.cuda.device(1)``, through launch() and through a site's kept
    launcher; a launch on the current device enters no guard."""
    entered: list[int] = []

    class _Guard:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            entered.append(self.index)

        def __exit__(self, *exc: object) -> None:
            entered.append(-self.index)

    current = {"device": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(torch.cuda, "device", _Guard)
    kernel = _Kernel()
    x = torch.zeros(8).as_subclass(_OnGpu1)
    triton_launch.launch(kernel, (1,), (x, 8))
    site = triton_launch.LaunchSite(kernel, (2,))
    site((x, 8), (True,))
    site((x, 8), (True,))
    assert _kinds(kernel) == ["jit", "jit", "kept"]
    assert entered == [1, -1, 1, -1, 1, -1]
    current["device"] = 1
    site((x, 8), (True,))
    triton_launch.launch(kernel, (1,), (x, 8))
    assert entered == [1, -1, 1, -1, 1, -1] and _kinds(kernel)[-2:] == ["kept", "kept"]


def test_a_prepared_slot_cast_remakes_its_plans_when_the_conversion_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``set_hardware_conversion`` changes what ``cast`` passes the kernels (HW): planned
    casts follow it, as ``cast`` does."""
    triton_cast = pytest.importorskip("fp8kit.torch.kernels.triton_cast")
    if not triton_cast.triton_available():
        pytest.skip("triton is not installed")
    kernel = _Kernel()
    monkeypatch.setattr(triton_cast, "_cast_2d_kernel", kernel)
    spec = triton_cast.cast_spec(E4M3, torch.empty(0))
    prepared = triton_cast.PreparedSlotCast(torch.ones(1), torch.zeros(1))
    x = torch.randn(64, 64)
    cpu = torch.device("cpu")
    # HW: after nine tensors and m, n, tiles per program, partials, fmt, in_id, mode, pow2
    hw_position = 17
    before = triton_cast.set_hardware_conversion(cpu, False)
    try:
        prepared(x, spec, True, False)
        triton_cast.set_hardware_conversion(cpu, True)
        prepared(x, spec, True, False)
        triton_cast.cast(x, torch.ones(1), spec, True, torch.zeros(1), False, None)
    finally:
        triton_cast.set_hardware_conversion(cpu, before)
    flags = [call[2][hw_position] for call in kernel.calls]
    assert flags == [False, True, True]


def test_a_planned_cast_flags_every_tensor_that_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor argument of a planned launch but the slot's bound ``scale`` and
    ``amax_out`` is new at each call, so its alignment must be part of the pattern the kept
    launcher is chosen by; a misaligned input takes a new pattern (a launch through Triton)."""
    triton_cast, kernels = _stand_in_cast_kernels(monkeypatch)
    checked: list[torch.Tensor] = []
    real_aligned = triton_cast._aligned
    monkeypatch.setattr(
        triton_cast, "_aligned", lambda t: (t is None or checked.append(t)) or real_aligned(t)
    )
    scale, amax_out = torch.ones(1), torch.zeros(1)
    spec = triton_cast.cast_spec(E4M3, torch.empty(0))
    buffer = torch.randn(48 * 32 + 1)
    for transpose, dbias in ((False, False), (True, False), (False, True), (True, True)):
        prepared = triton_cast.PreparedSlotCast(scale, amax_out)
        for k in kernels.values():
            k.calls.clear()
        checked.clear()
        prepared(buffer[:-1].view(48, 32), spec, transpose, dbias)
        launched = [c[2] for k in kernels.values() for c in k.calls]
        changing = [a for args in launched for a in args if isinstance(a, torch.Tensor)]
        changing = [a for a in changing if a is not scale and a is not amax_out]
        assert changing and all(any(a is t for t in checked) for a in changing)
        misaligned = buffer[1:].view(48, 32)
        assert misaligned.data_ptr() % 16 != 0
        main = kernels["_cast_2d_kernel" if transpose or dbias else "_cast_1d_kernel"]
        prepared(buffer[:-1].view(48, 32).clone(), spec, transpose, dbias)
        prepared(misaligned, spec, transpose, dbias)
        kinds = _kinds(main)
        if triton_launch.fast_launch_enabled():
            assert kinds[1] == "kept" and kinds[2] == "jit", kinds
