"""Triton FP8 cast kernels for CUDA tensors (the GPU twin of ``fp8_cast.cpp``).

Same numerics as :func:`fp8kit.torch.kernels.reference.cast_to_fp8_reference` (docs/semantics.md
section 2): one float32 multiply ``x * scale``, then the float32 -> FP8 conversion (saturating,
round to nearest even, a NaN keeping its input's sign). Two variants of that conversion, one
constexpr ``HW`` (ADR 0253):

- sm_89 and newer GPUs: the hardware's ``cvt.rn.satfinite`` (Triton's float8 types), two values
  per instruction. The integer variant made the kernels ALU-bound at a third of copy bandwidth on
  an H200; the lowering test counts the main loop's SASS instructions per element.
- everywhere else, and Triton's interpreter (``TRITON_INTERPRET=1``, NumPy on the CPU, whose own
  float8 conversion does not round to nearest even): the C++ kernel's integer arithmetic on the
  float32 bits (saturation by an integer min, round to nearest even for normals by adding half an
  ulp minus one plus the lowest kept bit, subnormals by a float32 add of a magic power of two).
  That is how the tests check the kernels bit for bit on machines without a GPU; the GPU tests
  check both variants against the model.

Divisions are ``tl.math.div_rn`` (IEEE round to nearest: Triton's ``/`` on float32 is the
approximate ``div.full.f32``); kernels are compiled with ``enable_fp_fusion=False`` so no multiply
is fused into an FMA.

Kernels (``docs/decisions/0210-kernel-api-and-dispatch.md`` has the design and the counts):

- ``_cast_1d_kernel``: the plain cast. A grid of at most ``4 x SMs`` programs, each walking
  blocks of 4096 elements (16 per thread: 16-byte loads and stores) without masks, the last
  program also the masked tail; amax per thread in registers, reduced once per program and
  folded with ONE integer ``atomic_max`` (non-negative float32 values order as their int32 bits).
- ``_cast_2d_kernel``: 64 x 64 tiles of a row-major ``(M, N)`` input; writes the data tile, its
  transpose (``tl.trans`` then a store along M, so both outputs are written in 64-byte rows), the
  per-program column sums for dbias and the amax. Each program walks a run of row tiles of one
  column block (a grid of about ``8 x SMs`` programs), so the atomics and the dbias partial rows
  stay few.
- ``_dbias_kernel``: adds the dbias partial rows and rounds to the input dtype (the second kernel
  of a call with ``dbias=True``).
- ``_amax_kernel``: the amax-only pass: per-program partials (the first kernel of current
  scaling, read by the cast kernel, so no memset and no atomics), or one atomic per program
  into an amax tensor.

Scale modes of the cast kernels: 0 = the given scale tensor; 1 = current scaling (the scale is
computed on the device from the amax partials of ``_amax_kernel``); 2 = first-step current
scaling (the current scale when the slot's update count is 0, else the given scale, decided on
the device). ``scale_inv = div_rn(1, scale)`` is written by program 0.

``triton`` is optional: :func:`triton_available` is False when it cannot be imported, and
fp8kit then casts CUDA tensors with the pure-torch path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fp8kit.formats import FP8Format
from fp8kit.torch.kernels._common import CastResult, CastSpec, cast_spec, dense, empty
from fp8kit.torch.kernels._native import env_flag
from fp8kit.torch.kernels.triton_launch import LaunchSite, launch

try:  # optional dependency
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:  # Triton 3.2's form of the compile hints (gone in later releases)
        from triton.backends.compiler import AttrsDescriptor
    except ImportError:
        AttrsDescriptor = None
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = [
    "PreparedSlotCast",
    "amax",
    "cast",
    "cast_current",
    "compile_for_target",
    "converts_in_one_rounding",
    "set_hardware_conversion",
    "triton_available",
    "triton_cast",
    "triton_cast_transpose",
]

_BLOCK_1D = 4096  # elements per block of the plain cast (16 per thread with 8 warps)
_BLOCK_AMAX = 8192  # elements per block of the amax pass
_TILE = 64  # rows and columns of a 2-D tile
_WARPS_1D = 8
_DBIAS_COLS = 256  # columns per program of the dbias reduction
_DBIAS_ROWS = 32  # partial rows per load of the dbias reduction
_MODE_GIVEN, _MODE_CURRENT, _MODE_FIRST_STEP = 0, 1, 2
_F32 = torch.float32
_IN_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_INTERPRETER_SMS = 1  # "SM count" for CPU tensors under TRITON_INTERPRET=1 (small grids)
_HW_CVT_CAPABILITY = (8, 9)  # cvt.rn.satfinite.{e4m3,e5m2}x2.f32: sm_89 (Ada) and newer
# The one instruction per format that converts float32 to FP8 in one rounding; some Triton
# releases convert through float16 on some GPUs instead (two roundings), e.g. 3.2 and 3.6 on
# sm_89 (ADR 0253), so the hardware conversion is used only where the compiled PTX has these.
_DIRECT_CVT = {0: "cvt.rn.satfinite.e4m3x2.f32", 1: "cvt.rn.satfinite.e5m2x2.f32"}
_HW_CVT_ENABLED = env_flag("FP8KIT_TRITON_HW_CVT", True)  # README, "Environment variables"
_device_facts_cache: dict[int, tuple[int, bool]] = {}
# Bumped when set_hardware_conversion changes a device's facts: PreparedSlotCast's plans, which
# hold the facts they were made with, are made again.
_facts_generation = 0


def triton_available() -> bool:
    """True when ``triton`` imports (a GPU is still needed unless ``TRITON_INTERPRET=1``)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _encode(p, FMT: tl.constexpr):
        """float32 products -> uint8 FP8 codes (saturating, round to nearest even, NaN kept).

        FMT 0 = E4M3fn (3 mantissa bits, bias 7, fmax 448), 1 = E5M2 (2, 15, 57344)."""
        MANT: tl.constexpr = 3 if FMT == 0 else 2
        BIAS: tl.constexpr = 7 if FMT == 0 else 15
        FMAX_BITS: tl.constexpr = 0x43E00000 if FMT == 0 else 0x47600000
        SHIFT: tl.constexpr = 23 - MANT
        MIN_NORMAL_BITS: tl.constexpr = (127 + 1 - BIAS) << 23
        # a + (half ulp - 1) - rebias, as one unsigned 32-bit constant (wraps like the C++ code)
        ADD_BITS: tl.constexpr = ((1 << (SHIFT - 1)) - 1 - ((127 - BIAS) << 23)) % (1 << 32)
        MAGIC_EXP: tl.constexpr = 127 + 23 + 1 - BIAS - MANT  # ulp of 2^(MAGIC_EXP-127): quantum
        MAGIC: tl.constexpr = 2.0 ** (MAGIC_EXP - 127)
        MAGIC_BITS: tl.constexpr = MAGIC_EXP << 23
        b = p.to(tl.uint32, bitcast=True)
        sign = (b >> 24) & 0x80
        a = b & 0x7FFFFFFF
        is_nan = a > 0x7F800000
        a = tl.minimum(a, FMAX_BITS)  # saturate, +-inf included (NaN handled by is_nan)
        normal = (a + ADD_BITS + ((a >> SHIFT) & 1)) >> SHIFT
        sub = (a.to(tl.float32, bitcast=True) + MAGIC).to(tl.uint32, bitcast=True) - MAGIC_BITS
        code = tl.where(a < MIN_NORMAL_BITS, sub, normal)
        code = tl.where(is_nan, 0x7F, code)
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _in_ptr(x_ptr, IN: tl.constexpr):
        """bfloat16 (IN 1) is read as its int16 bits and widened by a shift: exact on GPUs, and
        the interpreter's own bfloat16 conversion flushes subnormals."""
        if IN == 1:
            return x_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        else:
            return x_ptr

    @triton.jit
    def _widen(raw, IN: tl.constexpr):
        if IN == 1:
            return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True
            )
        else:
            return raw.to(tl.float32)

    @triton.jit
    def _quantize(raw, x, scale, FMT: tl.constexpr, IN: tl.constexpr, HW: tl.constexpr):
        """FP8 codes of ``x * scale`` (``x``: ``raw`` widened to float32).

        HW: the conversion is the GPU's ``cvt.rn.satfinite`` to E4M3 / E5M2 (sm_89 and newer):
        round to nearest even, finite values and +-inf beyond the format's maximum saturate to
        +-fmax, as :func:`_encode` does with integer arithmetic (ADR 0253). A NaN input keeps its
        sign in either case: its code is the high byte of its own bits (sign, then exponent bits
        that are all ones), because a GPU multiply and ``cvt`` both return the canonical NaN
        (docs/semantics.md section 2)."""
        p = x * scale
        if HW:
            if FMT == 0:
                code = p.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                code = p.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            code = _encode(p, FMT)
        if IN == 0:
            nan_code = (raw.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)
        elif IN == 1:  # bfloat16 read as int16 bits: sign and 7 exponent bits
            nan_code = (raw.to(tl.uint16, bitcast=True) >> 8).to(tl.uint8)
        else:  # float16: sign, 5 exponent bits, 2 mantissa bits
            nan_code = ((raw.to(tl.uint16, bitcast=True) >> 8) | 0x7F).to(tl.uint8)
        return tl.where(x != x, nan_code, code)

    @triton.jit
    def _fold_amax(acc, x):
        """``max(acc, |x|)`` elementwise, a NaN in x ignored (NaN never enters an amax): the
        IEEE maxNum that ``PropagateNan.NONE`` lowers to (PTX ``max.f32``, one ``FMNMX`` with
        an ``|x|`` operand; ``np.fmax`` under the interpreter), checked in the PTX by
        ``test_triton_kernels_lower_for_hopper``. acc starts at 0 and so never holds a NaN."""
        return tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.NONE)

    @triton.jit
    def scale_from_amax(amax, old, numerator, fmax_exp, fmax_mant, margin, POW2: tl.constexpr):
        """The delayed-scaling scale rule (docs/semantics.md section 3), bit for bit the torch
        reference.

        ``old`` where amax is 0, inf or NaN; else ``div_rn(numerator, amax)`` (an infinite
        quotient -> FLT_MAX), or with POW2 ``2**(e - margin)``, e the largest integer with
        ``2**e * amax <= fmax`` (from the exponents and 23-bit mantissas, exact), capped at
        2**127 and rounded like float64 -> float32 below 2**-126. amax >= 0 (or NaN) here, so
        its int32 bits order like its values."""
        bits = amax.to(tl.int32, bitcast=True)
        usable = (bits > 0) & (bits < 0x7F800000)
        safe = tl.where(usable, amax, 1.0)
        if POW2:
            a = safe.to(tl.int32, bitcast=True)
            is_sub = a < 0x800000
            a = tl.where(is_sub, (safe * 16777216.0).to(tl.int32, bitcast=True), a)
            ea = (a >> 23) - tl.where(is_sub, 127 + 24, 127)
            e = fmax_exp - ea - ((a & 0x7FFFFF) > fmax_mant).to(tl.int32) - margin
            e = tl.minimum(e, 127)
            normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
            one = tl.zeros_like(e) + 1
            tiny = (one << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
            s = tl.where(e >= -126, normal, tl.where(e >= -149, tiny, 0.0))
        else:
            s = tl.math.div_rn(tl.zeros_like(safe) + numerator, safe)
            s = tl.where(s.to(tl.int32, bitcast=True) == 0x7F800000, 3.4028234663852886e38, s)
        return tl.where(usable, s, old)

    @triton.jit
    def _scale_for(
        scale_ptr,
        count_ptr,
        partial_ptr,
        n_partials,
        FMT: tl.constexpr,
        MODE: tl.constexpr,
        POW2: tl.constexpr,
        P_BLOCK: tl.constexpr,
    ):
        """``(scale, amax of x)`` of a cast program; the amax is only known (from the amax
        pass's partials) in modes 1 and 2, and 0.0 in mode 0."""
        FMAX: tl.constexpr = 448.0 if FMT == 0 else 57344.0
        FMAX_EXP: tl.constexpr = 8 if FMT == 0 else 15
        FMAX_MANT: tl.constexpr = 0x600000  # both maxima are 1.75 * 2**e
        if MODE == 0:
            return tl.load(scale_ptr), 0.0
        else:
            offs = tl.arange(0, P_BLOCK)
            parts = tl.load(partial_ptr + offs, mask=offs < n_partials, other=0.0)
            amax = tl.max(parts, axis=0)
            current = scale_from_amax(amax, 1.0, FMAX, FMAX_EXP, FMAX_MANT, 0, POW2)
            if MODE == 1:
                return current, amax
            else:
                return tl.where(tl.load(count_ptr) == 0, current, tl.load(scale_ptr)), amax

    @triton.jit
    def _finish(acc_max, amax_all, scale, amax_ptr, scale_inv_ptr, MODE: tl.constexpr):
        """Program 0 writes scale_inv (and in mode 1 the amax); in modes 0 and 2 every program
        folds its amax into amax_ptr with one integer atomic max."""
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        if MODE == 1:
            if first:
                tl.store(amax_ptr, amax_all)
        else:
            ptr = amax_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            tl.atomic_max(ptr, acc_max.to(tl.int32, bitcast=True))
        if first:
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))

    @triton.jit
    def _cast_1d_kernel(
        x_ptr,
        scale_ptr,
        count_ptr,
        partial_ptr,
        out_ptr,
        amax_ptr,
        scale_inv_ptr,
        n,
        n_partials,
        FMT: tl.constexpr,
        IN: tl.constexpr,
        MODE: tl.constexpr,
        POW2: tl.constexpr,
        HW: tl.constexpr,
        BLOCK: tl.constexpr,
        P_BLOCK: tl.constexpr,
    ):
        scale, amax_all = _scale_for(
            scale_ptr, count_ptr, partial_ptr, n_partials, FMT, MODE, POW2, P_BLOCK
        )
        src = _in_ptr(x_ptr, IN)
        dst = out_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        n_main = (n // BLOCK) * BLOCK
        first = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(first, n_main, step):  # whole blocks: no masks, 16-byte accesses
            offs = start + tl.arange(0, BLOCK)
            raw = tl.load(src + offs)
            x = _widen(raw, IN)
            if MODE != 1:
                acc = _fold_amax(acc, x)
            tl.store(dst + offs, _quantize(raw, x, scale, FMT, IN, HW))
        if tl.program_id(0) == tl.num_programs(0) - 1:  # the tail (maybe empty)
            offs = n_main + tl.arange(0, BLOCK)
            mask = offs < n
            raw = tl.load(src + offs, mask=mask, other=0)
            x = _widen(raw, IN)
            if MODE != 1:
                acc = _fold_amax(acc, x)
            tl.store(dst + offs, _quantize(raw, x, scale, FMT, IN, HW), mask=mask)
        _finish(tl.max(acc, axis=0), amax_all, scale, amax_ptr, scale_inv_ptr, MODE)

    @triton.jit
    def _cast_2d_kernel(
        x_ptr,
        scale_ptr,
        count_ptr,
        partial_ptr,
        out_ptr,
        out_t_ptr,
        amax_ptr,
        scale_inv_ptr,
        dbias_ptr,
        m,
        n,
        tiles_per_program,
        n_partials,
        FMT: tl.constexpr,
        IN: tl.constexpr,
        MODE: tl.constexpr,
        POW2: tl.constexpr,
        HW: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        DBIAS: tl.constexpr,
        EVEN: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        P_BLOCK: tl.constexpr,
    ):
        scale, amax_all = _scale_for(
            scale_ptr, count_ptr, partial_ptr, n_partials, FMT, MODE, POW2, P_BLOCK
        )
        src = _in_ptr(x_ptr, IN)
        dst = out_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        dst_t = out_t_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        cols = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)  # elementwise: reduced once, after the loop
        col_acc = tl.zeros([BM, BN], dtype=tl.float32)
        tile_begin = pid_m * tiles_per_program
        tile_end = tl.minimum(tile_begin + tiles_per_program, tl.cdiv(m, BM))
        for tile in range(tile_begin, tile_end):
            rows = tile * BM + tl.arange(0, BM)
            offs = rows.to(tl.int64)[:, None] * n + cols[None, :]
            if EVEN:  # M % BM == 0 and N % BN == 0: every tile is whole
                raw = tl.load(src + offs)
            else:
                mask = (rows[:, None] < m) & (cols[None, :] < n)
                raw = tl.load(src + offs, mask=mask, other=0)
            x = _widen(raw, IN)
            if MODE != 1:
                acc = _fold_amax(acc, x)
            if DBIAS:
                col_acc += x
            code = _quantize(raw, x, scale, FMT, IN, HW)
            if EVEN:
                tl.store(dst + offs, code)
            else:
                tl.store(dst + offs, code, mask=mask)
            if TRANSPOSE:
                offs_t = cols.to(tl.int64)[:, None] * m + rows[None, :]
                if EVEN:
                    tl.store(dst_t + offs_t, tl.trans(code))
                else:
                    mask_t = (cols[:, None] < n) & (rows[None, :] < m)
                    tl.store(dst_t + offs_t, tl.trans(code), mask=mask_t)
        if DBIAS:
            col_sum = tl.sum(col_acc, axis=0)
            tl.store(dbias_ptr + pid_m.to(tl.int64) * n + cols, col_sum, mask=cols < n)
        _finish(tl.max(tl.max(acc, axis=1), axis=0), amax_all, scale, amax_ptr, scale_inv_ptr, MODE)

    @triton.jit
    def _dbias_kernel(
        partial_ptr,
        out_ptr,
        rows,
        n,
        IN: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """dbias[j] = sum over the partial rows, rounded to nearest even into the input dtype."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < n
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            ptrs = partial_ptr + r.to(tl.int64)[:, None] * n + cols[None, :]
            acc += tl.sum(tl.load(ptrs, mask=(r[:, None] < rows) & cmask[None, :], other=0.0), 0)
        if IN == 0:
            tl.store(out_ptr + cols, acc, mask=cmask)
        elif IN == 1:  # bfloat16 by integer rounding (the interpreter's own cast truncates)
            b = acc.to(tl.uint32, bitcast=True)
            rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            bits = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x40, rounded)
            dst = out_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
            tl.store(dst + cols, bits.to(tl.uint16), mask=cmask)
        else:
            tl.store(out_ptr + cols, acc.to(tl.float16), mask=cmask)

    @triton.jit
    def _amax_kernel(
        x_ptr,
        count_ptr,
        out_ptr,
        n,
        IN: tl.constexpr,
        FIRST_STEP: tl.constexpr,
        ATOMIC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """max|x| (NaN ignored) of the blocks this program walks: stored to out_ptr[pid]
        (partials), or with ATOMIC folded into out_ptr[0]. FIRST_STEP: skip the work (store 0)
        unless the update count is 0 (the cast kernel then uses the given scale)."""
        src = _in_ptr(x_ptr, IN)
        active = True
        if FIRST_STEP:
            active = tl.load(count_ptr) == 0
        n_main = tl.where(active, (n // BLOCK) * BLOCK, 0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        first = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(first, n_main, step):
            x = _widen(tl.load(src + start + tl.arange(0, BLOCK)), IN)
            acc = _fold_amax(acc, x)
        if (tl.program_id(0) == tl.num_programs(0) - 1) & active:
            offs = (n // BLOCK) * BLOCK + tl.arange(0, BLOCK)
            x = _widen(tl.load(src + offs, mask=offs < n, other=0), IN)
            acc = _fold_amax(acc, x)
        result = tl.max(acc, axis=0)
        if ATOMIC:
            ptr = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            tl.atomic_max(ptr, result.to(tl.int32, bitcast=True))
        else:
            tl.store(out_ptr + tl.program_id(0), result)


# ---------------------------------------------------------------------------------------------
# Launchers (arguments checked by dispatch.py; x is CUDA, or CPU under TRITON_INTERPRET=1)


def compile_for_target(
    fn: Any,
    capability: tuple[int, int],
    signature: dict[str, str],
    consts: dict[str, object],
    aligned: tuple[str, ...] = (),
    warps: int = _WARPS_1D,
) -> dict[str, Any]:
    """Triton's ``asm`` dict (``ptx``, ``cubin``...) of kernel ``fn`` compiled for a CUDA GPU of
    ``capability`` (``(9, 0)``: sm_90) without launching it (no GPU needed): ``signature`` maps
    every parameter to its Triton type (``"*bf16"``, ``"i32"``), ``consts`` the constexpr ones
    to their values, and the parameters in ``aligned`` are specialised as multiples of 16, as a
    launch with aligned tensors is. Works with the Triton releases fp8kit supports (3.2 took
    ``constants=``)."""
    names = list(fn.arg_names)
    full = {k: ("constexpr" if k in consts else v) for k, v in signature.items()}
    try:
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        source = ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs)
    except TypeError:  # Triton 3.2: constants=, and the hints as an AttrsDescriptor
        hints = AttrsDescriptor.from_hints({names.index(a): 16 for a in aligned})
        source = ASTSource(fn=fn, signature=full, constants=consts, attrs=hints)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    options = {"num_warps": warps, "enable_fp_fusion": False}
    return triton.compile(source, target=target, options=options).asm


def converts_in_one_rounding(ptx: str, fmt_id: int) -> bool:
    """Whether a cast kernel's PTX converts float32 to format ``fmt_id`` (0 E4M3, 1 E5M2) with
    the direct ``cvt.rn.satfinite`` and no FP8 conversion through float16."""
    return _DIRECT_CVT[fmt_id] in ptx and ".f16x2" not in ptx


@functools.cache
def _hardware_conversion_lowers(capability: tuple[int, int]) -> bool:
    """Whether this Triton compiles the casts' hardware conversion for a GPU of ``capability``
    to the direct instruction, for both formats (compiled once per capability; a compile error
    counts as no)."""
    signature = dict(
        x_ptr="*fp32", scale_ptr="*fp32", count_ptr="*i64", partial_ptr="*fp32",
        out_ptr="*fp8e4nv", amax_ptr="*fp32", scale_inv_ptr="*fp32", n="i32", n_partials="i32",
    )  # fmt: skip
    for fmt_id in _DIRECT_CVT:
        consts = dict(FMT=fmt_id, IN=0, MODE=0, POW2=False, HW=True, BLOCK=_BLOCK_1D, P_BLOCK=16)
        try:
            asm = compile_for_target(_cast_1d_kernel, capability, {**signature, **consts}, consts)
        except Exception:
            return False
        if not converts_in_one_rounding(asm["ptx"], fmt_id):
            return False
    return True


def _hardware_conversion_possible(props: Any) -> bool:
    """Whether the GPU of ``props`` (``torch.cuda.get_device_properties``) can take the casts'
    hardware conversion: NVIDIA, sm_89 or newer, and this Triton converts in one rounding."""
    capability = (props.major, props.minor)
    return (
        torch.version.hip is None
        and capability >= _HW_CVT_CAPABILITY
        and _hardware_conversion_lowers(capability)
    )


def _device_facts(x: torch.Tensor) -> tuple[int, bool]:
    """``(SMs, hardware FP8 conversion)`` of x's GPU, cached per device.

    Hardware conversion (``cvt.rn.satfinite`` to E4M3 / E5M2) needs CUDA sm_89 or newer and a
    Triton that compiles it to the direct float32 instruction for that GPU; CPU tensors (the
    interpreter, whose own float8 conversion does not round to nearest even) and other GPUs use
    :func:`_encode`; ``FP8KIT_TRITON_HW_CVT=0`` forces it everywhere (ADR 0253)."""
    index = x.get_device()
    facts = _device_facts_cache.get(index)
    if facts is None:
        if index < 0:
            facts = (_INTERPRETER_SMS, False)
        else:
            props = torch.cuda.get_device_properties(index)
            hw = _HW_CVT_ENABLED and _hardware_conversion_possible(props)
            facts = (props.multi_processor_count, hw)
        _device_facts_cache[index] = facts
    return facts


def set_hardware_conversion(device: torch.device, enabled: bool) -> bool:
    """Make the casts on ``device`` convert with the GPU's ``cvt.rn.satfinite`` (``enabled``) or
    with integer arithmetic; returns the previous choice. For the benchmarks and tests that
    compare the two (ADR 0253); a CPU device (Triton's interpreter) takes ``enabled`` only for
    wiring tests, its float8 conversion being exact just for values on the FP8 grid.

    Raises:
        ValueError: ``enabled`` on a CUDA device without FP8 conversion instructions (below
            sm_89, or not an NVIDIA GPU), or for which this Triton converts through float16.
    """
    probe = torch.empty(0, device=device)
    sms, previous = _device_facts(probe)
    if enabled and probe.is_cuda:
        props = torch.cuda.get_device_properties(probe.get_device())
        if not _hardware_conversion_possible(props):
            raise ValueError(
                f"enabled=True needs an NVIDIA GPU with sm_89 or newer for which Triton "
                f"{triton.__version__} converts float32 to FP8 in one instruction; {device} is "
                f"{props.name} (sm_{props.major}{props.minor})"
            )
    global _facts_generation
    _device_facts_cache[probe.get_device()] = (sms, enabled)
    _facts_generation += 1
    return previous


def warps_2d(in_id: int) -> int:
    """Warps of a 2-D cast program for input ``in_id`` (float32 8, 16-bit inputs 4)."""
    return 8 if in_id == 0 else 4


def _sms(x: torch.Tensor) -> int:
    """Streaming multiprocessors of x's GPU (small under the interpreter)."""
    return _device_facts(x)[0]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _partials_block(sms: int) -> int:
    """P_BLOCK: the partial-amax slots every cast program reads (one constant per device, so the
    kernels compile once whatever the input size)."""
    return 1 << (4 * sms - 1).bit_length()


def _amax_partials(
    x: torch.Tensor, spec: CastSpec, count: torch.Tensor | None, sms: int
) -> tuple[torch.Tensor, int]:
    """Kernel 1 of current / first-step scaling: at most ``4 x SMs`` partial amaxes (not
    zero-filled: every program writes its slot)."""
    n = x.numel()
    programs = max(1, min(_cdiv(n, _BLOCK_AMAX), 4 * sms))
    partials = torch.empty((programs,), dtype=_F32, device=x.device)
    first_step = count is not None
    launch(
        _amax_kernel,
        (programs,),
        (
            x,
            count if first_step else partials,
            partials,
            n,
            spec.in_id,
            first_step,
            False,
            _BLOCK_AMAX,
        ),
        num_warps=8,
        enable_fp_fusion=False,
    )
    return partials, programs


def _grid_2d(m: int, n: int, sms: int) -> tuple[int, int, int]:
    """``(column blocks, row groups, row tiles per program)`` of a 2-D cast of ``(m, n)``."""
    col_blocks = _cdiv(n, _TILE)
    row_tiles = _cdiv(m, _TILE)
    groups = max(1, min(row_tiles, _cdiv(8 * sms, col_blocks)))
    tiles_per_program = _cdiv(row_tiles, groups)
    return col_blocks, _cdiv(row_tiles, tiles_per_program), tiles_per_program


def _launch(
    x: torch.Tensor,
    spec: CastSpec,
    mode: int,
    power_2_scale: bool,
    scale: torch.Tensor | None,
    count: torch.Tensor | None,
    transpose: bool,
    amax_out: torch.Tensor | None,
    dbias: bool,
    out: torch.Tensor | None = None,
) -> CastResult:
    x = dense(x)
    sms, hw = _device_facts(x)
    device = x.device
    partials, n_partials = (None, 0)
    if mode != _MODE_GIVEN:
        partials, n_partials = _amax_partials(x, spec, count, sms)
    data = empty(x.shape, spec.fp8_dtype, device) if out is None else out
    scale_inv = torch.empty(size=(), dtype=_F32, device=device)
    if mode == _MODE_CURRENT:
        amax = amax_t = torch.empty(size=(), dtype=_F32, device=device)
    elif amax_out is None:
        amax = amax_t = torch.zeros((), dtype=_F32, device=device)  # the atomics' start
    else:
        amax, amax_t = None, amax_out
    scale_arg = scale if scale is not None else scale_inv  # unused in mode 1
    count_arg = count if count is not None else scale_inv  # read in mode 2 only
    partial_arg = partials if partials is not None else scale_inv  # read in modes 1, 2
    p_block = _partials_block(sms)
    head = (x, scale_arg, count_arg, partial_arg, data)
    if not (transpose or dbias):
        n = x.numel()
        programs = max(1, min(_cdiv(n, _BLOCK_1D), 4 * sms))
        tail = (n, n_partials, spec.fmt_id, spec.in_id, mode, power_2_scale, hw, _BLOCK_1D, p_block)
        launch(
            _cast_1d_kernel,
            (programs,),
            (*head, amax_t, scale_inv, *tail),
            num_warps=_WARPS_1D,
            enable_fp_fusion=False,
        )
        return CastResult(data, None, amax, scale_inv, None)
    m, n = x.shape
    col_blocks, groups, tiles_per_program = _grid_2d(m, n, sms)
    data_t = torch.empty(n, m, dtype=spec.fp8_dtype, device=device) if transpose else None
    partial_sums = torch.empty(groups, n, dtype=_F32, device=device) if dbias else None
    tail = _tail_2d(m, n, tiles_per_program, n_partials, spec, mode, power_2_scale, hw, p_block,
                    transpose, dbias)  # fmt: skip
    launch(
        _cast_2d_kernel,
        (col_blocks, groups),
        (
            *head,
            data_t if data_t is not None else data,
            amax_t,
            scale_inv,
            partial_sums if partial_sums is not None else scale_inv,
            *tail,
        ),
        num_warps=warps_2d(spec.in_id),
        enable_fp_fusion=False,
    )
    bias = None
    if partial_sums is not None:
        bias = torch.empty(n, dtype=x.dtype, device=device)
        launch(
            _dbias_kernel,
            (_cdiv(n, _DBIAS_COLS),),
            (partial_sums, bias, groups, n, spec.in_id, _DBIAS_ROWS, _DBIAS_COLS),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return CastResult(data, data_t, amax, scale_inv, bias)


def _tail_2d(
    m: int,
    n: int,
    tiles_per_program: int,
    n_partials: int,
    spec: CastSpec,
    mode: int,
    power_2_scale: bool,
    hw: bool,
    p_block: int,
    transpose: bool,
    dbias: bool,
) -> tuple:
    """The 2-D cast kernel's arguments after its tensors, in its parameter order."""
    return (m, n, tiles_per_program, n_partials, spec.fmt_id, spec.in_id, mode, power_2_scale, hw,
            transpose, dbias, m % _TILE == 0 and n % _TILE == 0, _TILE, _TILE, p_block)  # fmt: skip


class PreparedSlotCast:
    """:func:`cast` for one slot under delayed scaling (``scale`` and ``amax_out`` bound, no
    first-step scaling), with the launches of each input kind planned once.

    A plan per ``(spec, shape, transpose, dbias)`` of a contiguous input holds the grids, the
    kernel's scalar arguments and a :class:`~fp8kit.torch.kernels.triton_launch.LaunchSite`
    per kernel, so a call allocates its outputs and calls the kept launcher: no launch key,
    no grid arithmetic (docs/decisions/0262-bound-triton-launches.md). The arguments are those
    :func:`cast` passes, so the bytes are the same. At most :data:`MAX_PLANS` plans are kept
    (a new shape past that starts over); :func:`set_hardware_conversion` makes them again."""

    MAX_PLANS = 64

    __slots__ = ("_amax_out", "_generation", "_plans", "_scale")

    def __init__(self, scale: torch.Tensor, amax_out: torch.Tensor) -> None:
        self._scale, self._amax_out = scale, amax_out
        self._plans: dict[tuple, _CastPlan] = {}
        self._generation = _facts_generation  # of the device facts the plans were made with

    def __call__(self, x: torch.Tensor, spec: CastSpec, transpose: bool, dbias: bool) -> CastResult:
        x = dense(x)
        key = (spec, x.shape, transpose, dbias)
        if self._generation != _facts_generation:  # set_hardware_conversion since
            self._plans.clear()
            self._generation = _facts_generation
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = _CastPlan(x, spec, transpose, dbias)
        return plan.run(x, self._scale, self._amax_out)


class _CastPlan:
    """:func:`_launch`'s work for one kind of input in mode "given" with a bound ``amax_out``,
    minus what does not change from call to call."""

    __slots__ = ("_bias_dtype", "_dbias_site", "_dbias_tail", "_device", "_fp8_dtype", "_groups",
                 "_shape", "_site", "_tail", "_transpose", "_two_d")  # fmt: skip

    def __init__(self, x: torch.Tensor, spec: CastSpec, transpose: bool, dbias: bool) -> None:
        sms, hw = _device_facts(x)
        p_block = _partials_block(sms)
        self._device, self._shape, self._fp8_dtype = x.device, x.shape, spec.fp8_dtype
        self._transpose, self._bias_dtype = transpose, x.dtype if dbias else None
        self._two_d = transpose or dbias
        self._dbias_site = None
        self._groups = 0
        if not self._two_d:
            n = x.numel()
            programs = max(1, min(_cdiv(n, _BLOCK_1D), 4 * sms))
            self._tail = (n, 0, spec.fmt_id, spec.in_id, _MODE_GIVEN, False, hw, _BLOCK_1D,
                          p_block)  # fmt: skip
            self._site = LaunchSite(
                _cast_1d_kernel, (programs,), num_warps=_WARPS_1D, enable_fp_fusion=False
            )
            return
        m, n = x.shape
        col_blocks, self._groups, tiles_per_program = _grid_2d(m, n, sms)
        self._tail = _tail_2d(m, n, tiles_per_program, 0, spec, _MODE_GIVEN, False, hw, p_block,
                              transpose, dbias)  # fmt: skip
        self._site = LaunchSite(
            _cast_2d_kernel,
            (col_blocks, self._groups),
            num_warps=warps_2d(spec.in_id),
            enable_fp_fusion=False,
        )
        if dbias:
            self._dbias_tail = (self._groups, n, spec.in_id, _DBIAS_ROWS, _DBIAS_COLS)
            self._dbias_site = LaunchSite(
                _dbias_kernel, (_cdiv(n, _DBIAS_COLS),), num_warps=4, enable_fp_fusion=False
            )

    def run(self, x: torch.Tensor, scale: torch.Tensor, amax_out: torch.Tensor) -> CastResult:
        """The cast of ``x`` (contiguous, of the planned kind)."""
        device = self._device
        data = empty(self._shape, self._fp8_dtype, device)
        scale_inv = torch.empty(size=(), dtype=_F32, device=device)
        head = (x, scale, scale_inv, scale_inv, data)
        if not self._two_d:
            self._site(
                (*head, amax_out, scale_inv, *self._tail),
                (_aligned(x), _aligned(data), _aligned(scale_inv)),
            )
            return CastResult(data, None, None, scale_inv, None)
        m, n = self._shape
        data_t = (
            torch.empty(n, m, dtype=self._fp8_dtype, device=device) if self._transpose else None
        )
        dbias = self._dbias_site is not None
        partial_sums = torch.empty(self._groups, n, dtype=_F32, device=device) if dbias else None
        self._site(
            (
                *head,
                data_t if data_t is not None else data,
                amax_out,
                scale_inv,
                partial_sums if partial_sums is not None else scale_inv,
                *self._tail,
            ),
            (
                _aligned(x),
                _aligned(data),
                _aligned(data_t),
                _aligned(scale_inv),
                _aligned(partial_sums),
            ),
        )
        bias = None
        if partial_sums is not None:
            bias = torch.empty(n, dtype=self._bias_dtype, device=device)
            self._dbias_site(  # type: ignore[misc]
                (partial_sums, bias, *self._dbias_tail), (_aligned(partial_sums), _aligned(bias))
            )
        return CastResult(data, data_t, None, scale_inv, bias)


def _aligned(t: torch.Tensor | None) -> bool:
    """Whether ``t``'s address is a multiple of 16 (what Triton specialises a pointer on; None,
    an argument absent from this kind of launch, counts as aligned)."""
    return t is None or t.data_ptr() % 16 == 0


def cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    spec: CastSpec,
    transpose: bool,
    amax_out: torch.Tensor | None,
    dbias: bool,
    first_step_count: torch.Tensor | None,
) -> CastResult:
    """:func:`fp8kit.torch.kernels.cast_fp8` with Triton (1 kernel; 2 with ``first_step_count``;
    +1 with ``dbias``; +1 fill when ``amax_out`` is None)."""
    mode = _MODE_GIVEN if first_step_count is None else _MODE_FIRST_STEP
    return _launch(x, spec, mode, False, scale, first_step_count, transpose, amax_out, dbias)


def cast_current(
    x: torch.Tensor, spec: CastSpec, power_2_scale: bool, transpose: bool, dbias: bool
) -> CastResult:
    """:func:`fp8kit.torch.kernels.cast_fp8_current` with Triton (2 kernels; +1 with dbias)."""
    return _launch(x, spec, _MODE_CURRENT, power_2_scale, None, None, transpose, None, dbias)


def amax(x: torch.Tensor, amax_out: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`fp8kit.torch.kernels.compute_amax` with Triton (1 kernel, +1 fill without
    ``amax_out``)."""
    x = dense(x)
    out = torch.zeros((), dtype=_F32, device=x.device) if amax_out is None else None
    target = amax_out if out is None else out
    n = x.numel()
    programs = max(1, min(_cdiv(n, _BLOCK_AMAX), 4 * _sms(x)))
    launch(
        _amax_kernel,
        (programs,),
        (
            x,
            target,
            target,
            n,
            _IN_IDS[x.dtype],
            False,
            True,
            _BLOCK_AMAX,
        ),
        num_warps=8,
        enable_fp_fusion=False,
    )
    return out


# ---------------------------------------------------------------------------------------------
# The older entry points (fp8kit.torch.quantization.cast_to_fp8 and cast_to_fp8_transpose)


def triton_cast(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-pass FP8 cast: ``(data, amax)`` exactly as ``cast_to_fp8_reference``, with data laid
    out like ``torch.empty_like(x)`` (a transposed input gives a transposed output).

    Args:
        x: float32 / bfloat16 / float16 tensor (CUDA; CPU under ``TRITON_INTERPRET=1``).
        scale: float32 one-element tensor on ``x``'s device.
        fmt: target format.
    """
    spec = cast_spec(fmt, x)
    out = torch.empty_like(x, dtype=spec.fp8_dtype)
    src = x.resolve_neg()  # its memory holds the values before a lazy negation
    if src.stride() != out.stride():  # not dense in empty_like's layout: densify in that layout
        src = torch.empty_like(x)
        src.copy_(x)
    if x.numel() == 0:
        return out, torch.zeros((), dtype=_F32, device=x.device)
    # the memory of src and out is dense and in the same order: cast it as a flat buffer
    flat_src = src.as_strided((src.numel(),), (1,))
    flat_out = out.as_strided((out.numel(),), (1,))
    result = _launch(flat_src, spec, _MODE_GIVEN, False, scale, None, False, None, False, flat_out)
    return out, result.amax  # type: ignore[return-value]


def triton_cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-pass FP8 cast of a 2-D tensor also writing the transposed copy.

    Returns:
        ``(data, data_t, amax)``: row-major FP8 ``(M, N)`` and ``(N, M)``, float32 0-d amax.
    """
    spec = cast_spec(fmt, x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        m, n = x.shape
        data = torch.empty((m, n), dtype=spec.fp8_dtype, device=x.device)
        data_t = torch.empty((n, m), dtype=spec.fp8_dtype, device=x.device)
        return data, data_t, torch.zeros((), dtype=_F32, device=x.device)
    r = _launch(x, spec, _MODE_GIVEN, False, scale, None, True, None, False)
    return r.data, r.data_t, r.amax  # type: ignore[return-value]
