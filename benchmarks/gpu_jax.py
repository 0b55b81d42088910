"""JAX on a CUDA GPU: bf16 Flax vs Flax FP8 (``Fp8DirectDotGeneralOp``) vs fp8kit.jax.

Two jitted bf16 train steps (forward, backward including the input gradient, SGD update; FP8
state updated too), each with three kinds of dense layer:

* ``mlp``: 16384 tokens x 4096 -> 4096 -> 4096 (two layers, GELU between): 6 GEMMs.
* ``transformer``: 12 pre-LN transformer blocks, width 2048, 16 heads, MLP 8192, batch 8 x 1024
  tokens. Every projection (QKV, attention output, MLP in / out) is the dense layer under test:
  4 layers = 12 GEMMs per block, 144 in all. Attention itself (``jax.nn.dot_product_attention``,
  causal) runs in bf16 in every variant.

Layer kinds: ``flax-bf16`` (``flax.linen.Dense``), ``flax-fp8`` (``flax.linen.Dense`` with
``dot_general_cls=flax.linen.fp8_ops.Fp8DirectDotGeneralOp``, "n/a" if this Flax lacks it) and
``fp8kit`` (``fp8kit.jax.linen.Dense``, delayed scaling, default recipe). Parameters are
float32, computation bfloat16, in every variant.

First, the seconds XLA takes to compile a 256 x 256 matmul (:func:`compile_probe_s`): when that
alone takes many seconds, every compile on the machine is slow, not this benchmark's models. Each
variant prints its phases (init, compile, warm-up) as they end, so a run cut short by a time
limit still shows where its time went.

Reported per variant (a line as each ends, then a table per case): the median step time over
``repeats`` steps (each ``block_until_ready``, after warm-up), the seconds its step took to
compile, and, from the compiled HLO (``.lower(...).compile().as_text()``), the number of
cuBLASLt FP8 GEMMs (``__cublas$lt$matmul$f8``) beside all cuBLAS GEMM calls and Triton GEMM
fusions. On a machine without a CUDA GPU JAX backend it prints why and measures nothing.

Run: ``python -m benchmarks.gpu_jax [out.json]``.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

import fp8kit.jax as f8
from fp8kit.jax.linen import Dense as Fp8kitDense

try:  # Flax's own FP8 layer op (flax.linen.fp8_ops); absent from some Flax versions
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT, Fp8DirectDotGeneralOp
except ImportError:  # pragma: no cover - depends on the installed Flax
    Fp8DirectDotGeneralOp = None
    OVERWRITE_WITH_GRADIENT = None

F8_GEMM = "__cublas$lt$matmul$f8"
_CUBLAS_CALL = re.compile(r'custom_call_target="(__cublas\$[^"]+)"')
_TRITON_GEMM = re.compile(r'"kind":"__triton[a-z_]*gemm[a-z_]*"')
VARIANTS = ("flax-bf16", "flax-fp8", "fp8kit")
LEARNING_RATE = 1e-4


@dataclass(frozen=True)
class MlpShape:
    tokens: int = 16384
    width: int = 4096


@dataclass(frozen=True)
class TransformerShape:
    blocks: int = 12
    width: int = 2048
    heads: int = 16
    mlp: int = 8192
    batch: int = 8
    seq: int = 1024


def dense_factory(variant: str) -> Callable[..., nn.Module] | None:
    """A constructor ``(features, name=...) -> module`` of the variant's dense layer (float32
    parameters, bfloat16 computation), or None when this Flax has no FP8 op."""
    if variant == "flax-bf16":
        return lambda features, **kw: nn.Dense(features, dtype=jnp.bfloat16, **kw)
    if variant == "flax-fp8":
        if Fp8DirectDotGeneralOp is None:
            return None
        return lambda features, **kw: nn.Dense(
            features, dtype=jnp.bfloat16, dot_general_cls=Fp8DirectDotGeneralOp, **kw
        )
    if variant == "fp8kit":
        return lambda features, **kw: Fp8kitDense(features, dtype=jnp.bfloat16, **kw)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


class Mlp(nn.Module):
    """``dense(width)(gelu(dense(width)(x)))``."""

    dense: Callable[..., nn.Module]
    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(self.dense(self.width, name="fc1")(x))
        return self.dense(self.width, name="fc2")(h)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention then a GELU MLP, both residual."""

    dense: Callable[..., nn.Module]
    shape: TransformerShape

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.shape
        b, t, _ = x.shape
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        qkv = self.dense(3 * s.width, name="qkv")(h).reshape(b, t, 3, s.heads, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, s.width)
        x = x + self.dense(s.width, name="proj")(a)
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        h = self.dense(s.width, name="fc2")(nn.gelu(self.dense(s.mlp, name="fc1")(h)))
        return x + h


class Transformer(nn.Module):
    dense: Callable[..., nn.Module]
    shape: TransformerShape

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.shape.blocks):
            x = Block(self.dense, self.shape, name=f"block{i}")(x)
        return x


def make_step(model: nn.Module, variant: str) -> Callable[..., Any]:
    """The jitted train step ``(variables, x, target) -> (variables, loss, dx)``: MSE loss in
    float32, SGD on the parameters, each variant's FP8 state update (fp8kit: its observations
    through ``f8.update``; Flax: the overwrite-with-gradient collection), and the gradient of
    the input, as for layers inside a larger model (so every layer runs fprop, dgrad, wgrad)."""

    def loss_fn(variables: Any, x: jax.Array, target: jax.Array) -> jax.Array:
        y = model.apply(variables, x)
        return jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)

    def sgd(params: Any, grads: Any) -> Any:
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g.astype(p.dtype), params, grads)

    def step(variables: Any, x: jax.Array, target: jax.Array) -> tuple[Any, jax.Array, Any]:
        if variant == "fp8kit":
            grad_fn = f8.value_and_grad(loss_fn, argnums=(0, 1))
            loss, (grads, dx), (obs, _) = grad_fn(variables, x, target)
            new = {**variables, "params": sgd(variables["params"], grads["params"])}
            return f8.update(new, obs), loss, dx
        loss, (grads, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1))(variables, x, target)
        new = {**variables, "params": sgd(variables["params"], grads["params"])}
        if OVERWRITE_WITH_GRADIENT is not None and OVERWRITE_WITH_GRADIENT in variables:
            new[OVERWRITE_WITH_GRADIENT] = grads[OVERWRITE_WITH_GRADIENT]
        return new, loss, dx

    return jax.jit(step, donate_argnums=0)


def count_gemms(compiled_hlo: str) -> dict[str, int]:
    """GEMMs in compiled HLO text: ``"f8"`` cuBLASLt FP8 GEMMs, ``"cublas"`` all cuBLAS GEMM
    calls (FP8 included), ``"triton"`` Triton GEMM fusions, and the count of each cuBLAS
    target."""
    counts: dict[str, int] = {}
    for target in _CUBLAS_CALL.findall(compiled_hlo):
        counts[target] = counts.get(target, 0) + 1
    return {
        "f8": counts.get(F8_GEMM, 0),
        "cublas": sum(counts.values()),
        "triton": len(_TRITON_GEMM.findall(compiled_hlo)),
        **counts,
    }


def _phase(label: str, start: float) -> float:
    """Print how long the phase ``label`` took since ``start`` (a ``perf_counter`` value) as
    soon as it ends; return the time now."""
    now = time.perf_counter()
    print(f"    {label}: {now - start:.1f} s", flush=True)
    return now


def compile_probe_s() -> float:
    """Seconds JAX takes to lower and compile a jitted 256 x 256 bfloat16 matmul on the default
    backend: a baseline for the variants' compile times (tens of seconds here mean XLA itself
    compiles slowly on this machine, whatever the model)."""
    a = jnp.ones((256, 256), jnp.bfloat16)
    start = time.perf_counter()
    jax.jit(lambda m: m @ m).lower(a).compile()
    return time.perf_counter() - start


def run_variant(
    model_fn: Callable[[Callable[..., nn.Module]], nn.Module],
    variant: str,
    x: jax.Array,
    target: jax.Array,
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    """Build, compile, warm up and time one variant; ``{"status": "n/a"}`` if unavailable."""
    dense = dense_factory(variant)
    if dense is None:
        return {"status": "n/a", "reason": f"flax {flax.__version__} has no Fp8DirectDotGeneralOp"}
    model = model_fn(dense)
    start = time.perf_counter()
    with f8.autocast(enabled=variant == "fp8kit", recipe=f8.DelayedScaling()):
        variables = jax.block_until_ready(jax.jit(model.init)(jax.random.PRNGKey(0), x))
    compile_start = _phase(f"{variant} init", start)
    step = make_step(model, variant)
    compiled = step.lower(variables, x, target).compile()
    warmup_start = _phase(f"{variant} compile", compile_start)
    compile_s = warmup_start - compile_start
    gemms = count_gemms(compiled.as_text())
    for _ in range(warmup):
        variables, loss, dx = compiled(variables, x, target)
    jax.block_until_ready((variables, loss, dx))
    _phase(f"{variant} warm-up ({warmup} steps)", warmup_start)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        variables, loss, dx = compiled(variables, x, target)
        jax.block_until_ready((variables, loss, dx))
        times.append(time.perf_counter() - start)
    return {
        "status": "ok",
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "loss": float(loss),
        "gemms": gemms,
        "compile_s": compile_s,
    }


def run_case(
    name: str,
    shape: MlpShape | TransformerShape,
    warmup: int,
    repeats: int,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """The ``variants`` of one case (``"mlp"`` or ``"transformer"``) on inputs of ``shape``."""
    key = jax.random.PRNGKey(1)
    if isinstance(shape, MlpShape):
        dims = (shape.tokens, shape.width)

        def model_fn(dense: Callable[..., nn.Module]) -> nn.Module:
            return Mlp(dense, shape.width)

        gemms = 6
    else:
        dims = (shape.batch, shape.seq, shape.width)

        def model_fn(dense: Callable[..., nn.Module]) -> nn.Module:
            return Transformer(dense, shape)

        gemms = 12 * shape.blocks
    x = jax.random.normal(key, dims, jnp.bfloat16)
    target = jax.random.normal(jax.random.fold_in(key, 1), dims, jnp.bfloat16)
    results = {}
    for variant in variants:
        results[variant] = r = run_variant(model_fn, variant, x, target, warmup, repeats)
        # one line per variant as it ends: a time limit keeps what finished (compiles take long)
        summary = (
            f"{r['median_ms']:.2f} ms, compiled in {r['compile_s']:.1f} s, "
            f"{r['gemms']['f8']} FP8 GEMMs"
            if r["status"] == "ok"
            else r["status"]
        )
        print(f"  {name} {variant}: {summary}", flush=True)
    return {"case": name, "shape": shape.__dict__, "dense_gemms": gemms, "variants": results}


def cuda_backend_problem() -> str | None:
    """None when JAX runs on a CUDA GPU, else a sentence saying what it runs on."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return f"no GPU JAX backend here (JAX backend: {jax.default_backend()})"
    version = str(getattr(devices[0].client, "platform_version", ""))
    if "rocm" in version.lower():  # cuBLASLt FP8 GEMMs are CUDA's; ROCm has hipBLASLt ones
        return f"the JAX GPU backend is ROCm ({version}), not CUDA"
    return None


def _table(case: dict[str, Any]) -> str:
    rows = case["variants"]
    base = rows["flax-bf16"].get("median_ms")
    flax_fp8 = rows["flax-fp8"].get("median_ms")
    lines = [
        f"{case['case']} {case['shape']} ({case['dense_gemms']} dense-layer GEMMs)",
        "| variant | median ms | bf16 Flax / this | Flax FP8 / this | FP8 GEMMs | cuBLAS GEMMs "
        "| Triton GEMMs |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | n/a | | | | | |")
            continue
        ms = r["median_ms"]
        vs_flax = f"{flax_fp8 / ms:.2f}x" if flax_fp8 else "n/a"
        lines.append(
            f"| {name} | {ms:.2f} | {base / ms:.2f}x | {vs_flax} | {r['gemms']['f8']} | "
            f"{r['gemms']['cublas']} | {r['gemms']['triton']} |"
        )
    return "\n".join(lines)


def main(out_json_path: str | None = None, warmup: int = 3, repeats: int = 20) -> dict:
    """Run both cases on a CUDA GPU, print the tables, save JSON to ``out_json_path``.

    Returns the results; on a machine without a CUDA GPU JAX backend, prints why and returns
    ``{"status": "skipped", "reason": ...}`` (also saved) without measuring anything.
    """
    problem = cuda_backend_problem()
    if problem is not None:
        result: dict[str, Any] = {"status": "skipped", "reason": problem}
        print(f"benchmarks.gpu_jax: skipped: {problem}; this benchmark needs a CUDA GPU.")
    else:
        device = jax.devices("gpu")[0]
        result = {
            "status": "ok",
            "device": device.device_kind,
            "jax": jax.__version__,
            "flax": flax.__version__,
            "platform_version": str(getattr(device.client, "platform_version", "")),
            "warmup": warmup,
            "repeats": repeats,
            "cases": [],
        }
        print(f"JAX {jax.__version__}, Flax {flax.__version__} on {device.device_kind}", flush=True)
        result["compile_probe_s"] = compile_probe_s()
        print(f"  a 256 x 256 matmul compiles in {result['compile_probe_s']:.1f} s", flush=True)
        for name, shape in (("mlp", MlpShape()), ("transformer", TransformerShape())):
            result["cases"].append(run_case(name, shape, warmup, repeats))
            print("\n" + _table(result["cases"][-1]), flush=True)  # a time limit keeps these
            _save(result, out_json_path)  # and this file
    _save(result, out_json_path)
    return result


def _save(result: dict[str, Any], out_json_path: str | None) -> None:
    if out_json_path is not None:
        with open(out_json_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
