"""TensorFlow plumbing: ``tf.custom_gradient`` whose backward writes the FP8 state directly.

The backward amaxes never travel as a gradient: the backward function of the layer's *first*
training call in a traced step (the chain head) calls :meth:`Fp8State.observe`, whose
``assign``s TensorFlow runs as stateful ops of the step (``tf.function`` keeps every stateful op,
XLA compiles them as resource updates). No optimizer, loss scale or gradient clipping sees them.

Reuse: later calls of the same layer in the same traced step (per ``tf.function`` graph and
replica) are chained to the head by a token, a ``(5g,)`` float32 tensor passed from call to
call. Each call's backward returns, as the token's gradient, the max of its own amaxes and
those of the calls after it, so the head's backward sees the max of every call and runs one
event; the data dependency orders the backward passes. In eager execution every training call
is its own head (one event per call).

Under ``tf.distribute`` (e.g. ``MirroredStrategy``) the head gathers the amaxes of every replica
(``all_gather``) and takes the max before the event, so every replica computes identical state;
the variables' ``only_first_replica`` aggregation then writes it once.
"""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf
from keras.backend import standardize_dtype
from tensorflow.python.eager import record  # no public "is a GradientTape recording?" exists

from fp8kit.keras import gemm
from fp8kit.keras.state import Fp8State
from fp8kit.matmul_args import SECOND_DERIVATIVE_ERROR
from fp8kit.recipe import DelayedScaling

__all__ = ["fp8_einsum", "replica_max", "tape_recording"]


class _Chain:
    """The calls of one layer chained to one head: the token of the latest call, the running
    max of their forward amaxes, and the state each call read (tensors of the traced step)."""

    __slots__ = ("fwd_max", "reads", "token")

    def __init__(self, token: tf.Tensor, fwd_max: tf.Tensor, reads: list[tf.Tensor]) -> None:
        self.token, self.fwd_max, self.reads = token, fwd_max, reads


# Per traced graph: {(id(state), id(replica context), taped): the chain later calls join}.
_CHAINS: weakref.WeakKeyDictionary[Any, dict[tuple[int, int, bool], _Chain]] = (
    weakref.WeakKeyDictionary()
)


def tape_recording() -> bool:
    """Whether a ``GradientTape`` could record an op made now."""
    return bool(record.could_possibly_record())


def replica_max(amaxes: tf.Tensor, recipe: Any) -> tf.Tensor:
    """Max of ``amaxes`` over the replicas of the current ``tf.distribute`` replica context."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return amaxes
    if isinstance(recipe, DelayedScaling) and not recipe.reduce_amax:
        raise ValueError(
            f"recipe.reduce_amax=False under a tf.distribute strategy with "
            f"{ctx.num_replicas_in_sync} replicas: fp8kit.keras keeps one mirrored FP8 state per "
            "layer, so the replicas' amaxes must be reduced; set reduce_amax=True"
        )
    return tf.reduce_max(ctx.all_gather(amaxes[None], axis=0), axis=0)


_TF_REFUSES_REPLICA_SYNC = "called while defining a new graph or a tf.function"


def _observe_in_replica(state: Fp8State, amaxes: tf.Tensor, recipe: Any) -> None:
    """``state.observe`` of the replicas' max. Both steps synchronise the replicas, which
    TensorFlow refuses inside a ``tf.function`` nested in the function given to
    ``strategy.run`` or in a control-flow body there: that refusal is re-raised naming the FP8
    layer's part in it."""
    try:
        state.observe(replica_max(amaxes, recipe))
    except RuntimeError as err:
        if _TF_REFUSES_REPLICA_SYNC not in str(err):
            raise
        raise RuntimeError(
            "fp8kit.keras: an FP8 layer's backward pass reduces its amaxes across replicas and "
            "writes the mirrored FP8 state, a synchronisation point TensorFlow does not allow in "
            "a tf.function nested inside the function given to strategy.run, nor inside a "
            "TensorFlow control-flow body there (tf.cond, tf.while_loop, an autograph loop over "
            "a tensor). Compute the gradients in the replica function itself, outside such "
            'bodies (or use model.fit); docs/keras.md, "Distribution and checkpoints"'
        ) from err


def _chain_slot(
    state: Fp8State, taped: bool
) -> tuple[dict[tuple[int, int, bool], Any], tuple[int, int, bool]] | None:
    """Where this graph keeps the token of ``state``'s latest call (None when eager). Calls
    traced under a tape and calls traced without one chain apart: an untaped call's backward
    runs only if a tape outside the function records it, which must not decide whether the
    taped calls' event runs."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    ctx = tf.distribute.get_replica_context()
    table = _CHAINS.setdefault(graph, {})
    return table, (id(state), id(ctx), taped)


def fp8_einsum(
    plan: gemm.GemmPlan,
    state: Fp8State,
    x: tf.Tensor,
    w: tf.Tensor,
    training: bool,
    out_dtype: str,
    kernel_trainable: bool = True,
) -> tf.Tensor:
    """``einsum(plan.equation, x, w)`` in FP8 (see :mod:`fp8kit.keras.gemm`).

    Args:
        plan: the GEMM plan; state: the layer's FP8 state.
        x: input; w: kernel (as the layer's compute dtype).
        training: observe amaxes and update ``state`` (True) or leave it untouched (False). A
            training call whose backward never runs (no tape records it) observes nothing.
        out_dtype: dtype of the result.
        kernel_trainable: the Keras flag. A tape watches every TensorFlow variable created
            trainable, a frozen layer's too, so the flag decides whether ``dw`` is needed.
    """
    reads = state.read()
    fwd_scale, fwd_count, bwd_scale, bwd_count = reads
    # read variables outside the custom gradient: it must see tensors, not variables
    x, w = tf.convert_to_tensor(x), tf.convert_to_tensor(w)
    x_dtype, w_dtype = standardize_dtype(x.dtype), standardize_dtype(w.dtype)

    taped = tape_recording()
    if not training or not (taped or tf.inside_function()):
        # Eager and no tape records this call: its backward can never run, so it observes
        # nothing. (Traced without a tape, a tape outside the tf.function may still record the
        # call later: that call is observed, on a chain of its own, see _chain_slot.)

        @tf.custom_gradient
        def frozen(x: tf.Tensor, w: tf.Tensor) -> Any:
            y, saved, _ = gemm.forward(plan, x, w, fwd_scale, fwd_count, out_dtype)

            def grad(dy: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
                dx, dw, _ = gemm.backward(plan, dy, saved, bwd_scale, bwd_count, x_dtype, w_dtype)
                return _first_derivatives_only(dx, dw, x, w, dy)

            return y, grad

        return frozen(x, w)

    slot = _chain_slot(state, taped)
    chain = None if slot is None else slot[0].get(slot[1])
    if chain is not None and taped and not record.should_record_backprop([chain.token]):
        # No active tape recorded the chain's last call (a tape closed before this one
        # opened): its token would carry this call's amaxes nowhere. Start a chain of its own.
        chain = None
    # Which gradients the backward owes: a tape records x / the kernel only where it watches
    # them (a frozen kernel comes behind a stop-gradient); traced without a tape, a tape
    # outside may record the call later (both, then).
    needs = (
        not taped or record.should_record_backprop([x]),
        kernel_trainable and (not taped or record.should_record_backprop([w])),
    )
    is_head = chain is None
    token_in = tf.zeros((state.num_observations,), tf.float32) if is_head else chain.token

    @tf.custom_gradient
    def observed(x: tf.Tensor, w: tf.Tensor, token: tf.Tensor) -> Any:
        y, saved, fwd_obs = gemm.forward(plan, x, w, fwd_scale, fwd_count, out_dtype, needs)

        def grad(dy: tf.Tensor, dtoken: tf.Tensor | None, *_: Any) -> tuple[Any, ...]:
            dx, dw, bwd_obs = gemm.backward(
                plan, dy, saved, bwd_scale, bwd_count, x_dtype, w_dtype, needs
            )
            dx, dw = _first_derivatives_only(dx, dw, x, w, dy)
            amaxes = tf.concat([fwd_obs, bwd_obs], axis=0)
            if dtoken is not None:  # the max over the calls chained after this one
                amaxes = tf.maximum(amaxes, tf.cast(dtoken, tf.float32))
            if not is_head:
                return dx, dw, amaxes
            if own is not None:  # the step's backward is traced: a later call starts anew
                if slot is not None and slot[0].get(slot[1]) is own:
                    del slot[0][slot[1]]
                # the forward amaxes of every call of the chain, also of a last call whose
                # backward never runs (its output under tf.stop_gradient; decision 0264)
                pad = tf.zeros_like(bwd_obs)
                amaxes = tf.maximum(amaxes, tf.concat([own.fwd_max, pad], axis=0))
            # The event's writes wait for every chained call's reads of the state. The traced
            # step orders them already, but Grappler's dependency optimizer (no XLA) drops
            # those edges for paths through tf.custom_gradient's IdentityN, then removes the
            # IdentityN: a forward could read the scales this event writes (decision 0268).
            # These edges reach reads made inside observe, which nothing else leads to.
            with tf.control_dependencies(list(reads) if own is None else own.reads):
                _observe_in_replica(state, amaxes, plan.recipe)
            return dx, dw, tf.zeros_like(token)

        return (y, tf.identity(token), tf.stop_gradient(fwd_obs)), grad

    own: _Chain | None = None  # the chain this call heads (read by its backward, traced later)
    y, token_out, fwd_obs = observed(x, w, token_in)
    if slot is not None:  # the token, and the running max of the chain's forward amaxes
        if chain is None:
            own = slot[0][slot[1]] = _Chain(token_out, fwd_obs, list(reads))
        else:
            chain.token, chain.fwd_max = token_out, tf.maximum(chain.fwd_max, fwd_obs)
            chain.reads.extend(reads)
    return y


def _first_derivatives_only(
    dx: tf.Tensor, dw: tf.Tensor, *inputs: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """``dx`` and ``dw`` unchanged; an outer tape that differentiates them (a gradient penalty)
    raises. The gradients come from FP8 copies made in the forward, which no tape records, so
    an outer tape would otherwise see ``dx`` independent of the kernel and silently drop that
    term. ``inputs`` (``x``, ``w``, ``dy``) make every outer tape that watches them record this
    op (docs/semantics.md section 4). The results also wait for the inputs: an optimizer step
    in the same ``tf.function`` then writes the kernel only after this call read it, which
    Grappler's dependency optimizer would otherwise stop ensuring (decision 0268)."""

    @tf.custom_gradient
    def guard(dx: tf.Tensor, dw: tf.Tensor, *inputs: tf.Tensor) -> Any:
        def grad(*_: Any) -> Any:
            raise TypeError(SECOND_DERIVATIVE_ERROR)

        with tf.control_dependencies(inputs):
            return (tf.identity(dx), tf.identity(dw)), grad

    return guard(dx, dw, *inputs)
