"""CPU gate for GPU FP8 GEMMs: in the HLO of a ``tf.function(jit_compile=True)`` training step,
every dot takes FP8 operands or exactly the dequantize pattern ``multiply(convert(f8[...]),
broadcast(scale_inv))`` (seed 001) that XLA's GEMM rewriter turns into an FP8 GEMM, possibly
through layout-only ops (transpose, reshape, bitcast, copy)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

import fp8kit.keras as f8
from tests.keras.helpers import random_fp8_friendly

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (\S+?) ([a-z][\w-]*)\((.*)$")
_LAYOUT_ONLY = {"transpose", "reshape", "bitcast", "copy"}


def parse_hlo(text: str) -> dict[str, tuple[str, str, list[str]]]:
    """``name -> (result type, opcode, operand names)`` of every instruction in ``text``."""
    table = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            name, rtype, opcode, rest = m.groups()
            args = rest.split("), ")[0]
            table[name] = (rtype, opcode, re.findall(r"%([\w.\-]+)", args))
    return table


def is_fp8(rtype: str) -> bool:
    return rtype.startswith(("f8e4m3fn[", "f8e5m2["))


def fp8_operand(table: dict, name: str) -> bool:
    """Whether ``name`` is an FP8 tensor or ``convert(fp8) * broadcast(scale)`` (layout aside)."""
    rtype, opcode, args = table[name]
    while opcode in _LAYOUT_ONLY:
        rtype, opcode, args = table[args[0]]
    if is_fp8(rtype):
        return True
    if opcode != "multiply" or len(args) != 2:
        return False
    kinds = sorted(table[a][1] for a in args)
    if kinds != ["broadcast", "convert"]:
        return False
    convert = next(a for a in args if table[a][1] == "convert")
    source = table[convert][2][0]
    scalar = next(a for a in args if table[a][1] == "broadcast")
    return is_fp8(table[source][0]) and table[table[scalar][2][0]][0].startswith("f32[]")


def dots_of_step(layer, x_shape, y_shape) -> tuple[dict, list[str]]:
    @tf.function(jit_compile=True)
    def step(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * g)
        return tape.gradient(loss, [x, layer.kernel])

    x = tf.constant(np.ones(x_shape, np.float32))
    g = tf.constant(np.ones(y_shape, np.float32))
    table = parse_hlo(step.experimental_get_compiler_ir(x, g)(stage="hlo"))
    return table, [n for n, (_, op, _) in table.items() if op == "dot"]


@pytest.mark.parametrize(
    "make,x_shape,y_shape",
    [
        (lambda: f8.Dense(16), (8, 32), (8, 16)),
        (lambda: f8.Dense(16, dtype="mixed_bfloat16"), (2, 4, 32), (2, 4, 16)),
        (lambda: f8.EinsumDense("abc,cd->abd", (None, 16), bias_axes="d"), (2, 4, 32), (2, 4, 16)),
    ],
    ids=["dense", "dense_bf16_3d", "einsum_dense"],
)
def test_every_dot_of_the_jitted_step_takes_fp8_operands(make, x_shape, y_shape) -> None:
    layer = make()
    layer.build(x_shape)
    table, dots = dots_of_step(layer, x_shape, y_shape)
    assert len(dots) == 3  # fprop, dgrad, wgrad
    for dot in dots:
        for operand in table[dot][2]:
            assert fp8_operand(table, operand), f"{dot}: operand {operand} is not FP8"


def test_gate_rejects_a_high_precision_dot(rng) -> None:
    """The checker itself fails on a plain float32 layer (it cannot pass vacuously)."""
    layer = f8.Dense(16, recipe=f8.DelayedScaling(override_linear_precision=(True, False, False)))
    layer.build((8, 32))
    layer(random_fp8_friendly(rng, (8, 32)))
    table, dots = dots_of_step(layer, (8, 32), (8, 16))
    verdicts = [all(fp8_operand(table, o) for o in table[d][2]) for d in dots]
    assert sorted(verdicts) == [False, True, True]  # fprop in high precision, dgrad/wgrad FP8
