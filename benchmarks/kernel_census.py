"""Static census of the Triton cast kernels as a Hopper GPU would run them, made on any machine.

Run: ``python -m benchmarks.kernel_census``. Compiles the cast kernels for sm_90 with Triton's
own compiler and ``ptxas`` (no GPU needed), disassembles them with the ``nvdisasm`` Triton ships,
and counts the SASS instructions of each kernel's main loop per element it converts, for the
hardware FP8 conversion (``cvt.rn.satfinite``, what sm_89+ runs) and the integer one (older GPUs).

Why it is worth counting: on an H200 the casts ran at a third of the copy bandwidth for bfloat16
input, at the same elements per second for float32 (``docs/runs/2026-11-28-h200.md``): they were
bound by instruction issue, not memory. A cast that moves 3-4 bytes per element keeps up with
HBM3's ~4 TB/s only at roughly 10 or fewer such instructions per element (ADR 0253). The count is
a proxy that a CPU machine can check; the bandwidth itself is ``benchmarks.gpu_kernels``' on a
GPU. ``tests/torch/test_kernels.py::test_triton_kernels_lower_for_hopper`` gates the counts.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from fp8kit.torch.kernels import triton_cast

try:  # optional dependency, as in fp8kit.torch.kernels.triton_cast
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
_PTX_OP = re.compile(r"^\s*(?:@%p\d+\s+)?([a-z]+\.[\w.]+)", re.M)
_LABEL = re.compile(r"^(\.L_x_\d+):$")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4}\*/")
_F32 = "*fp32"
_INPUTS = {"bfloat16": (1, "*bf16"), "float32": (0, "*fp32")}  # the kernels' IN id, pointer


def compile_sm90(
    fn: Any,
    signature: dict[str, str],
    consts: dict[str, object],
    aligned: tuple[str, ...],
    warps: int,
) -> dict[str, Any]:
    """Triton's ``asm`` dict of ``fn`` for sm_90 (:func:`triton_cast.compile_for_target`)."""
    return triton_cast.compile_for_target(fn, (9, 0), signature, consts, aligned, warps)


def ptx_ops(ptx: str) -> list[str]:
    """The PTX instruction names of a module, in order (``ld.global.v4.b32``...)."""
    return _PTX_OP.findall(ptx)


def main_loop_instructions(cubin: bytes) -> int:
    """SASS instructions in the body of the cubin's longest backward branch: its main loop."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {run.stderr[-300:]}")
    lines = run.stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line.strip()))}
    longest = 0
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)] : i + 1]
            longest = max(longest, sum(1 for b in body if _INSTRUCTION.match(b)))
    return longest


def _kernels(dtype: str, hardware: bool) -> dict[str, tuple[dict[str, Any], int]]:
    """name -> (asm, elements per thread per loop trip) of the E4M3 cast kernels."""
    in_id, pointer = _INPUTS[dtype]
    block, tile = triton_cast._BLOCK_1D, triton_cast._TILE
    warps_1d, warps_2d = triton_cast._WARPS_1D, triton_cast.warps_2d(in_id)
    sig = dict(
        x_ptr=pointer, scale_ptr=_F32, count_ptr="*i64", partial_ptr=_F32,
        out_ptr="*fp8e4nv", amax_ptr=_F32, scale_inv_ptr=_F32, n="i32", n_partials="i32",
    )  # fmt: skip
    consts = dict(FMT=0, IN=in_id, MODE=0, POW2=False, HW=hardware, BLOCK=block, P_BLOCK=1024)
    one_d = compile_sm90(
        triton_cast._cast_1d_kernel, {**sig, **consts}, consts, ("x_ptr", "out_ptr", "n"), warps_1d
    )
    sig2 = dict(
        x_ptr=pointer, scale_ptr=_F32, count_ptr="*i64", partial_ptr=_F32, out_ptr="*fp8e4nv",
        out_t_ptr="*fp8e4nv", amax_ptr=_F32, scale_inv_ptr=_F32, dbias_ptr=_F32, m="i32",
        n="i32", tiles_per_program="i32", n_partials="i32",
    )  # fmt: skip
    result = {"cast+amax": (one_d, block // (warps_1d * 32))}
    for name, dbias in (("cast+transpose+amax", False), ("cast+transpose+dbias+amax", True)):
        consts2 = dict(
            FMT=0, IN=in_id, MODE=0, POW2=False, HW=hardware, TRANSPOSE=True, DBIAS=dbias,
            EVEN=True, BM=tile, BN=tile, P_BLOCK=1024,
        )  # fmt: skip
        aligned = ("x_ptr", "out_ptr", "out_t_ptr", "dbias_ptr", "m", "n")
        asm = compile_sm90(
            triton_cast._cast_2d_kernel, {**sig2, **consts2}, consts2, aligned, warps_2d
        )
        result[name] = (asm, tile * tile // (warps_2d * 32))
    return result


def census() -> list[dict[str, Any]]:
    """One row per (input dtype, conversion, kernel variant): SASS main-loop instructions per
    element and the PTX facts the lowering test checks."""
    rows = []
    for dtype in _INPUTS:
        for hardware in (True, False):
            for name, (asm, per_thread) in _kernels(dtype, hardware).items():
                ops = ptx_ops(asm["ptx"])
                rows.append(
                    {
                        "input": dtype,
                        "conversion": "hardware" if hardware else "integer",
                        "variant": name,
                        "sass per element": main_loop_instructions(asm["cubin"]) / per_thread,
                        "v4 loads": sum(o == "ld.global.v4.b32" for o in ops),
                        "v4 stores": sum(o == "st.global.v4.b32" for o in ops),
                        "atomics": sum(o.startswith(("atom.", "red.")) for o in ops),
                        "div.rn": sum(o == "div.rn.f32" for o in ops),
                        "one-rounding cvt": triton_cast.converts_in_one_rounding(asm["ptx"], 0),
                        "nan max": sum(o.startswith(("max.NaN", "min.NaN")) for o in ops),
                        "bad": [
                            o
                            for o in ops
                            if o.startswith(("div.full", "div.approx", "fma")) or ".ftz" in o
                        ],
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="accepted for run_all (same work)")
    args = parser.parse_args(argv)
    if triton is None:
        print("kernel_census: triton is not installed, nothing to compile")
        return []
    rows = census()
    if args.json:
        print(json.dumps(rows))
        return rows
    print(f"# Triton cast kernels for sm_90 (Triton {triton.__version__}), E4M3 output")
    print("\n| input | variant | SASS per element, hardware cvt | integer cvt |\n|---|---|---|---|")
    by_key = {(r["input"], r["variant"], r["conversion"]): r for r in rows}
    for dtype in _INPUTS:
        for name in ("cast+amax", "cast+transpose+amax", "cast+transpose+dbias+amax"):
            hw = by_key[(dtype, name, "hardware")]["sass per element"]
            sw = by_key[(dtype, name, "integer")]["sass per element"]
            print(f"| {dtype} | {name} | {hw:.1f} | {sw:.1f} |")
    return rows


if __name__ == "__main__":
    main()
