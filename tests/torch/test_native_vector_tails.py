"""The native library's vector loops never call SSE-encoded code (docs/decisions/0257).

A call from an AVX2 / AVX-512 loop into a function compiled for plain x86-64 runs SSE
instructions while the upper halves of the vector registers are in use; on an Intel Xeon that
cost ~0.2 us per call and made a bfloat16 cast + transpose of 1024 x 128 3.5x slower than the
float32 one. The scalar tails are therefore inlined into the vector loops. This checks the built
library's machine code (``objdump``), so the guard holds on any CPU, AMD included.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from fp8kit.torch import kernels

_FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
_CALL = re.compile(r"\b(call|jmp)\s+[0-9a-f]+ <(.*)>\s*$")
# Callees a vector loop may call: other vector code, and helpers without floating-point code
# (decode_table returns a pointer after an integer guard check).
_ALLOWED = ("avx", "decode_table", "__cxa_guard", "memcpy", "memset")


def _short(name: str) -> str:
    """A demangled symbol without namespaces' anonymous part and argument lists."""
    name = name.replace("(anonymous namespace)::", "")
    while True:
        shorter = re.sub(r"\([^()]*\)", "", name)
        if shorter == name:
            return name
        name = shorter


def calls_out_of_vector_code(disassembly: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The vector functions of ``objdump -d -C`` output, and each ``(function, callee)`` call or
    tail call from one of them into a function outside :data:`_ALLOWED`."""
    vector: list[str] = []
    offenders = []
    current = None
    for line in disassembly.splitlines():
        header = _FUNCTION.match(line)
        if header:
            name = _short(header.group(1))
            is_vector = re.search(r"_avx(2|512)\b", name) is not None and "cpu_has_" not in name
            current = name if is_vector else None
            if current:
                vector.append(current)
            continue
        call = _CALL.search(line) if current else None
        if call and "+0x" not in call.group(2):
            callee = _short(call.group(2))
            if not any(word in callee for word in _ALLOWED):
                offenders.append((current, callee))
    return vector, offenders


def test_the_parser_finds_a_call_into_scalar_code() -> None:
    text = (
        "0000000000001000 <float ns::(anonymous namespace)::encode_span_avx2<bf16_t>(bf16_t "
        "const*)>:\n"
        "    1000:\tvmovaps %ymm0,%ymm1\n"
        "    1004:\tjmp    2000 <float ns::(anonymous namespace)::encode_span_scalar<bf16_t>"
        "(bf16_t const*)>\n"
        "    1009:\tjmp    1000 <float ns::(anonymous namespace)::encode_span_avx2<bf16_t>"
        "(bf16_t const*)+0x10>\n"
        "0000000000002000 <float ns::(anonymous namespace)::encode_span_scalar<bf16_t>(bf16_t "
        "const*)>:\n"
        "    2000:\tcall   3000 <memcpy@plt>\n"
    )
    vector, offenders = calls_out_of_vector_code(text)
    assert vector == ["float ns::encode_span_avx2<bf16_t>"]
    assert offenders == [
        ("float ns::encode_span_avx2<bf16_t>", "float ns::encode_span_scalar<bf16_t>")
    ]


def test_no_vector_loop_calls_scalar_code() -> None:
    if not kernels.native_available():
        pytest.skip(f"native kernel unavailable: {kernels.native_build_error()}")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump is not installed")
    path = kernels.load_native().path  # type: ignore[union-attr]
    text = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", "-C", path],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    vector, offenders = calls_out_of_vector_code(text)
    assert len(vector) >= 10, vector  # the encoders, amax, column sums, dequantize, GEMM, ...
    assert offenders == []
