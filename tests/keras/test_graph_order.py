"""TensorFlow graphs without XLA: after Grappler, every read of a variable that a training step
writes stays ordered with that write (decision 0268).

Grappler's dependency optimizer removes control edges that a path through
``tf.custom_gradient``'s IdentityN makes look redundant, then removes the IdentityN: a
forward pass could then read the FP8 scales its own step's update event writes, or a kernel
the step's optimizer updates. The check runs the same optimizer on the traced step and looks at
the graph it returns, so it does not depend on thread timing; a numeric check of the same
steps follows.
"""

from __future__ import annotations

from collections import defaultdict

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.framework import meta_graph
from tensorflow.python.grappler import tf_optimizer

import fp8kit.keras as f8
from fp8kit.formats import E4M3
from tests.keras.helpers import random_fp8_friendly
from tests.keras.test_layers import qdq

WRITES = ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp")
RECIPE = f8.DelayedScaling(amax_history_len=2, fp8_format="E4M3")  # E4M3 alone: see module doc


def _train_step(layer: f8.Dense, update_kernel: bool) -> tf.types.experimental.GenericFunction:
    """A custom loop's step: forward, tape gradient, optionally an SGD step on the kernel."""

    @tf.function(jit_compile=False)
    def step(x: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.GradientTape() as tape:
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * g)
        dk = tape.gradient(loss, layer.kernel)
        if update_kernel:
            layer.kernel.assign_sub(0.5 * dk)
        return y, dk

    return step


def _grappler_dependency_pass(graph: tf.Graph) -> list:
    """The nodes of ``graph`` after Grappler's dependency optimizer, every write kept."""
    graph_def = graph.as_graph_def()
    meta = meta_graph.create_meta_graph_def(graph_def=graph_def, graph=graph)
    fetch = meta.collection_def["train_op"].node_list.value
    fetch.extend(n.name for n in graph_def.node if n.op in WRITES or n.op == "Identity")
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.optimizers.append("dependency")
    config.graph_options.rewrite_options.min_graph_nodes = -1
    return list(tf_optimizer.OptimizeGraph(config, meta).node)


def _unordered_pairs(nodes: list) -> list[tuple[str, str]]:
    """(read, write) pairs on one variable with no path between them, either way."""
    succ: dict[str, set[str]] = defaultdict(set)
    for n in nodes:
        for i in n.input:
            succ[i.lstrip("^").split(":")[0]].add(n.name)

    def reaches(a: str, b: str) -> bool:
        seen, todo = {a}, [a]
        while todo:
            for v in succ[todo.pop()]:
                if v == b:
                    return True
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        return False

    by_var: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for n in nodes:
        if n.op == "ReadVariableOp":
            by_var[n.input[0]]["reads"].append(n.name)
        elif n.op in WRITES:
            by_var[n.input[0]]["writes"].append(n.name)
    return [
        (r, w)
        for ops in by_var.values()
        for w in ops["writes"]
        for r in ops["reads"]
        if not reaches(r, w) and not reaches(w, r)
    ]


@pytest.mark.parametrize("update_kernel", [False, True], ids=["event", "event and SGD"])
def test_every_read_stays_ordered_with_the_steps_writes_after_grappler(update_kernel) -> None:
    layer = f8.Dense(1, use_bias=False, recipe=RECIPE)
    layer.build((None, 40))
    step = _train_step(layer, update_kernel)
    graph = step.get_concrete_function(tf.TensorSpec((2, 40)), tf.TensorSpec((2, 1))).graph
    nodes = _grappler_dependency_pass(graph)
    assert sum(n.op in WRITES for n in nodes) == 6 + update_kernel  # nothing pruned
    assert _unordered_pairs(nodes) == []


def test_first_steps_quantize_with_the_scales_and_kernel_they_started_with(rng) -> None:
    """SPEC section 3: step 1 quantizes with scale 1, and its forward sees the kernel before the
    step's own SGD update (float64 reference of the fake-quantized GEMM). Before the fix, about
    a third of fresh layers failed this on a 2-core CPU."""
    x = random_fp8_friendly(rng, (2, 40)) * 30
    w = random_fp8_friendly(rng, (40, 1)) * 0.1
    g = random_fp8_friendly(rng, (2, 1))
    want = qdq(x, 1.0, E4M3) @ qdq(w, 1.0, E4M3)
    for _ in range(6):
        layer = f8.Dense(1, use_bias=False, recipe=RECIPE)
        layer.build((None, 40))
        layer.kernel.assign(w)
        y, _ = _train_step(layer, update_kernel=True)(tf.constant(x), tf.constant(g))
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)


def _fit_weights(seed: int, jit_compile: bool) -> list[np.ndarray]:
    """Weights and FP8 state after ``fit`` of two FP8 Dense layers with three steps per
    execution (one TensorFlow while loop runs them), SGD with momentum."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((8,)), f8.Dense(8, recipe=RECIPE), f8.Dense(8, recipe=RECIPE)]
    )
    model.compile(
        keras.optimizers.SGD(0.5, momentum=0.9),
        loss=lambda g, y: tf.reduce_sum(y * g, axis=-1),
        jit_compile=jit_compile,
        steps_per_execution=3,
    )
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((12, 8)) * np.exp2(rng.integers(-4, 4, (12, 8))) * 10).astype("f4")
    g = rng.standard_normal((12, 8)).astype(np.float32)
    model.fit(x, g, batch_size=2, epochs=2, verbose=0, shuffle=False)
    return [v.numpy().astype(np.float64) for v in model.weights]


def test_fit_without_xla_trains_as_with_it() -> None:
    """Twelve steps in while loops of three: without XLA (Grappler's dependency optimizer on)
    the weights and FP8 state end as XLA's (which never reorders a read past a write), up to
    float32 accumulation order. The old code parted by a factor of hundreds on every seed."""
    for seed in range(2):
        for got, want in zip(_fit_weights(seed, False), _fit_weights(seed, True), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
