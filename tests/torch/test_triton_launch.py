"""The kept Triton launchers (fp8kit.torch.kernels.triton_launch): which launches reuse one, with
stand-in kernels on the CPU; on a GPU, repeated casts through the kept launcher against the
reference, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fp8kit.formats import E4M3
from fp8kit.torch.kernels import NativeKernelWarning, cast_fp8, triton_launch
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
@pytest.mark.parametrize(("transpose", "dbias"), [(False, False), (True, False), (True, True)])
def test_a_prepared_slot_cast_launches_what_cast_launches(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, transpose: bool, dbias: bool
) -> None:
    """With stand-in kernels: a delayed-scaling slot's planned cast passes every kernel the
    arguments ``triton_cast.cast`` passes (same scalars, same tensors in the same roles), then
    calls the kept launchers for fresh inputs and outputs."""
    triton_cast = pytest.importorskip("fp8kit.torch.kernels.triton_cast")
    if not triton_cast.triton_available():
        pytest.skip("triton is not installed")
    kernels = {n: _Kernel() for n in ("_cast_1d_kernel", "_cast_2d_kernel", "_dbias_kernel")}
    for name, kernel in kernels.items():
        monkeypatch.setattr(triton_cast, name, kernel)
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
