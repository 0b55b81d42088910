"""Worker side of the distributed tests: scenarios that run inside gloo ranks.

Every scenario is ``scenario_x(rank, world_size, workdir) -> plain data`` (lists, dicts, numbers,
strings); ``tests/torch/test_distributed.py`` runs them in a few jobs (``job_*``) and checks the
per-rank results against independent references. Each scenario uses its own recipe (its own
``amax_history_len``), hence its own fp8kit registries, and frees its modules at the end.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling
from fp8kit.torch.checkpoint import (
    from_per_rank_fp8_state_dict,
    init_fp8_state,
    per_rank_fp8_state_dict,
)
from fp8kit.torch.ddp import ddp_ignore_fp8_state
from fp8kit.torch.distributed import AmaxReductionError
from fp8kit.torch.state import registry
from tests.torch.dist_helpers import run_scenarios
from tests.torch.module_kinds import FP8_MODULE_KINDS

# ---------------------------------------------------------------------------------------------
# Helpers


def _recipe(history_len: int, **kw: Any) -> DelayedScaling:
    # Each scenario uses its own amax_history_len, hence its own (recipe, group) registries.
    return DelayedScaling(amax_history_len=history_len, **kw)


def _state(s: f8.ScalingState) -> dict[str, list]:
    return {
        "history": s.amax_history.tolist(),
        "scale": s.scale.tolist(),
        "count": s.update_count.tolist(),
    }


def _meta(module: nn.Module) -> dict[str, dict[str, list]]:
    return {
        "forward": _state(module.fp8_meta.forward),
        "backward": _state(module.fp8_meta.backward),
    }


def _model_states(model: nn.Module) -> list[dict[str, dict[str, list]]]:
    return [_meta(m) for m in model.modules() if isinstance(m, f8.Linear)]


def _x(amax: float, rows: int = 2, features: int = 16) -> torch.Tensor:
    """An input whose amax is exactly ``amax``."""
    x = torch.linspace(-0.25, 0.25, rows * features).reshape(rows, features) * amax
    x[0, 1] = amax
    return x


@contextmanager
def _count_collectives() -> Iterator[dict[str, int]]:
    """Count calls of the torch.distributed collectives fp8kit may use."""
    counts = {"all_reduce": 0, "all_gather": 0, "all_gather_object": 0}
    originals = {name: getattr(dist, name) for name in counts}

    def wrap(name: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return counted

    for name in counts:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class _OpRecorder(TorchDispatchMode):
    """Records the aten and c10d ops run while active, by name."""

    def __init__(self, ops: Counter[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _event_ops() -> Iterator[list[dict[str, int]]]:
    """Per update event (``StateRegistry.run_event``) run while inside: its ops by name, and
    ``"host reads"``, the ``Tensor.tolist`` calls (invisible to a dispatch mode)."""
    events: list[dict[str, int]] = []
    real_event, real_tolist = registry.StateRegistry.run_event, torch.Tensor.tolist

    def recorded_event(self: Any, *args: Any, **kwargs: Any) -> Any:
        ops: Counter[str] = Counter()

        def counted_tolist(tensor: torch.Tensor) -> Any:
            ops["host reads"] += 1
            return real_tolist(tensor)

        torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
        try:
            with _OpRecorder(ops):
                return real_event(self, *args, **kwargs)
        finally:
            torch.Tensor.tolist = real_tolist  # type: ignore[method-assign]
            events.append(dict(ops))

    registry.StateRegistry.run_event = recorded_event  # type: ignore[method-assign]
    try:
        yield events
    finally:
        registry.StateRegistry.run_event = real_event  # type: ignore[method-assign]


def _cleanup() -> None:
    gc.collect()


# ---------------------------------------------------------------------------------------------
# Scenarios


def scenario_spec14(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """docs/semantics.md section 10 item 14: input amax 2 on rank 0 and 5 on rank 1."""
    out = {}
    for reduce in (True, False):
        torch.manual_seed(0)
        layer = f8.Linear(16, 16)
        with f8.autocast(recipe=_recipe(3, reduce_amax=reduce)):
            y = layer(_x(2.0 if rank == 0 else 5.0))
        y.sum().backward()
        out[str(reduce)] = _meta(layer)
    return out


def scenario_collective_count(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """Collectives per step for 1 and 6 modules: one all-reduce per direction per event; the
    ops of each update event in the steady state (third step)."""
    out: dict[str, Any] = {}
    for n in (1, 6):
        torch.manual_seed(0)
        model = nn.Sequential(*[f8.Linear(16, 16) for _ in range(n)])
        recipe = _recipe(4 + n)
        steps = []
        for step in range(3):
            with _count_collectives() as counts, _event_ops() as events:
                with f8.autocast(recipe=recipe):
                    y = model(_x(1.0 + rank))
                y.sum().backward()
            steps.append(dict(counts))
            if step == 2:
                out[f"{n} event ops"] = events
        out[str(n)] = steps
        del model
        _cleanup()
    return out


def _run_moe_steps(
    rank: int,
    pattern: list[list[list[bool]]],
    amax_of: Callable[[int, int, int], float],
    recipe: DelayedScaling | None = None,
) -> dict[str, Any]:
    """A gate that always runs plus experts that run where ``pattern[step][rank][expert]``."""
    torch.manual_seed(0)
    n_experts = len(pattern[0][0])
    gate = f8.Linear(16, 16)
    experts = nn.ModuleList(f8.Linear(16, 16) for _ in range(n_experts))
    recipe = recipe or _recipe(4)
    steps = []
    for step, ranks in enumerate(pattern):
        with f8.autocast(recipe=recipe):
            loss = gate(_x(1.0)).sum()
            for e, expert in enumerate(experts):
                if ranks[rank][e]:
                    loss = loss + expert(_x(amax_of(step, rank, e))).sum()
        loss.backward()
        steps.append([_meta(expert) for expert in experts])
    weight_amax = [float(expert.weight.detach().abs().max()) for expert in experts]
    del gate, experts
    _cleanup()
    return {"steps": steps, "weight_amax": weight_amax}


def moe_amax(step: int, rank: int, expert: int) -> float:
    return 1.0 + 0.75 * step + 2.5 * rank + 0.5 * expert


# Step 0: everything runs everywhere (registration). Then experts run on some ranks only.
MOE_PATTERN_2 = [
    [[True, True, True], [True, True, True]],
    [[True, False, True], [False, False, True]],  # e0 on rank 0 only, e1 nowhere
    [[False, False, False], [False, True, True]],  # e0 nowhere, e1/e2 on rank 1 only
    [[True, True, True], [True, True, True]],
]
MOE_PATTERN_4 = [
    [[True, True]] * 4,
    [[False, True], [False, False], [True, False], [False, True]],
    [[False, False], [False, False], [False, False], [True, False]],
    [[False, False], [False, True], [False, False], [False, False]],
]


def scenario_moe(rank: int, world: int, workdir: str) -> dict[str, Any]:
    pattern = MOE_PATTERN_2 if world == 2 else MOE_PATTERN_4
    return _run_moe_steps(rank, pattern, moe_amax)


def _column_max(history: torch.Tensor) -> torch.Tensor:
    return history.amax(0)


def scenario_moe_callable(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """scenario_moe with the "max" rule as a callable: the callable path (slots that ran on
    another rank only are found from the reduced row) must give the built-in's states."""
    return _run_moe_steps(rank, MOE_PATTERN_2, moe_amax, _recipe(4, amax_compute_algo=_column_max))


def scenario_mismatch_first_step(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """Rank 1 (and 3) run an extra module in the first step: every rank must raise."""
    torch.manual_seed(0)
    a, b = f8.Linear(16, 16), f8.Linear(16, 16)
    message = None
    try:
        with f8.autocast(recipe=_recipe(7)):
            y = a(_x(1.0))
            if rank % 2 == 1:
                y = b(y)
    except AmaxReductionError as exc:
        message = str(exc)
    del a, b
    _cleanup()
    return {"message": message}


def scenario_mismatch_later_step(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """A module first runs in step 2 on rank 1 only: the registry change is caught, no hang."""
    torch.manual_seed(0)
    a, b = f8.Linear(16, 16), f8.Linear(16, 16)
    recipe = _recipe(8)
    with f8.autocast(recipe=recipe):
        y = a(_x(1.0))
    y.sum().backward()
    message = None
    try:
        with f8.autocast(recipe=recipe):
            y = a(_x(1.0))
            if rank == 1:
                y = b(y)
    except AmaxReductionError as exc:
        message = str(exc)
    del a, b
    _cleanup()
    return {"message": message}


def scenario_skipped_backward(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """Rank 0 skips the backward pass of step 1 (a rank-local "skip on a NaN loss"): it reaches
    the next forward event while rank 1 is at the backward event. Both raise the layout error,
    where buffers of different sizes used to abort gloo."""
    torch.manual_seed(0)
    a = f8.Linear(16, 16)
    recipe = _recipe(19)
    message = None
    try:
        for step in range(3):
            with f8.autocast(recipe=recipe):
                y = a(_x(1.0))
            if not (step == 1 and rank == 0):
                y.sum().backward()
    except AmaxReductionError as exc:
        message = str(exc)
    del a
    _cleanup()
    return {"message": message}


def scenario_backward_passes_of_one_step(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """Every backward pass of a step runs the events the step's forwards armed, on every rank,
    with an expert under a second recipe that runs on rank 0 only after step 0: steps 0-2 run
    two backward passes after one forward (``retain_graph``), steps 3-5 two microbatch forwards
    and then their two backward passes. The second pass used to run the expert's event on rank 0
    only: a wrong "recipes differ" error, or a hang (decision 0248)."""
    torch.manual_seed(0)
    gate, expert = f8.Linear(16, 16), f8.Linear(16, 16)
    dense_recipe, expert_recipe = _recipe(23), _recipe(24)

    def forward(amax: float, expert_runs: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with f8.autocast(recipe=dense_recipe):
            h = gate(_x(amax))
            with f8.autocast(recipe=expert_recipe):
                e = expert(h) if expert_runs else torch.zeros_like(h)
        return h, e

    error = None
    try:
        for step in range(3):
            h, e = forward(1.0 + rank + step, step == 0 or rank == 0)
            (h + e).square().mean().backward(retain_graph=True)
            ((h * e).mean() + h.mean()).backward()
        for step in range(3, 6):
            microbatches = [forward(1.0 + rank + step, mb == 0 or rank == 0) for mb in range(2)]
            for h, e in microbatches:
                (h + e).square().mean().backward()
    except AmaxReductionError as exc:
        error = str(exc)
    out = {"reduction_error": error, "gate": _meta(gate), "expert": _meta(expert)}
    gate = expert = None  # the closure's cells hold them: free the modules before _cleanup
    _cleanup()
    return out


def scenario_registry_changes(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """A module added on all ranks in step 2 and deleted in step 4: re-checked, no error."""
    torch.manual_seed(0)
    a, b = f8.Linear(16, 16), f8.Linear(16, 16)
    recipe = _recipe(9)
    steps = []
    for step in range(5):
        with _count_collectives() as counts:
            with f8.autocast(recipe=recipe):
                y = a(_x(1.0))
                if 1 <= step <= 2:
                    y = b(_x(3.0 + step + 2 * rank)) + y
            y.sum().backward()
        b_state = _meta(b) if b is not None else None
        steps.append({"counts": dict(counts), "a": _meta(a), "b": b_state})
        if step == 2:
            b = None
            _cleanup()
    del a
    _cleanup()
    return {"steps": steps}


def scenario_no_grad_leftover(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """A no_grad forward on rank 0 leaves staging that never leaks into the reduction."""
    torch.manual_seed(0)
    a, b = f8.Linear(16, 16), f8.Linear(16, 16)
    recipe = _recipe(17)
    out = []
    for step in range(3):
        if step == 1 and rank == 0:
            with torch.no_grad(), f8.autocast(recipe=recipe):
                b(_x(9.0))
        with f8.autocast(recipe=recipe):
            y = a(_x(1.0))
            if step == 0 or (step == 2 and rank == 1):
                y = y + b(_x(3.0))
        y.sum().backward()
        out.append(_meta(b)["forward"])
    del a, b
    _cleanup()
    return {"b": out}


def scenario_kept_reduction_buffers(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """The registry keeps its reduction buffer from event to event: one made by a calibration
    pass under ``torch.inference_mode`` must take later training events, and one made under a
    float64 default dtype must stay float32 (as the states are)."""
    torch.manual_seed(0)
    layer = f8.Linear(16, 16)
    recipe = _recipe(19)
    with torch.inference_mode():
        for _ in range(2):
            with f8.autocast(enabled=False, calibrating=True, recipe=recipe):
                layer(_x(1.0 + rank))
    calibrated = _meta(layer)["forward"]
    for _ in range(2):
        with f8.autocast(recipe=recipe):
            y = layer(_x(2.0 + rank))
        y.sum().backward()
    trained = _meta(layer)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        other = f8.Linear(16, 16, dtype=torch.float32)
        for _ in range(2):
            with f8.autocast(recipe=_recipe(21)):
                y = other(_x(3.0 + rank).float())
            y.sum().backward()
    finally:
        torch.set_default_dtype(default)
    out = {"calibrated": calibrated, "trained": trained, "float64 default": _meta(other)}
    del layer, other
    _cleanup()
    return out


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=gen)
    x[4:] *= 4.0  # rank 1's rows are larger: local amaxes differ from the global ones
    return x, torch.randn(8, 16, generator=gen)


def _train(
    model: nn.Module,
    recipe: DelayedScaling,
    x: torch.Tensor,
    t: torch.Tensor,
    steps: int,
    grads: Callable[[nn.Module], list[torch.Tensor]],
) -> list[dict[str, Any]]:
    """SGD steps on ``(x, t)``; per step the gradients (full tensors) and the FP8 states."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for _ in range(steps):
        with f8.autocast(recipe=recipe):
            y = model(x)
        loss = F.mse_loss(y, t)
        opt.zero_grad()
        loss.backward()
        out.append({"grads": [g.tolist() for g in grads(model)], "states": _model_states(model)})
        opt.step()
    return out


def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def _full_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() for p in model.parameters()]  # FSDP2 DTensor gradients


def _reference_run(recipe: DelayedScaling, steps: int) -> list[dict[str, Any]]:
    """The same training on the global batch in this process alone (no reduction)."""
    torch.manual_seed(0)
    model = f8.convert_model(mlp())
    x, t = _global_batch()
    local = dataclasses.replace(recipe, reduce_amax=False)
    res = _train(model, local, x, t, steps, _local_grads)
    del model
    _cleanup()
    return res


def shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, t = _global_batch()
    rows = x.shape[0] // world
    return x[rank * rows : (rank + 1) * rows], t[rank * rows : (rank + 1) * rows]


def scenario_ddp(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """DDP with default arguments (broadcast_buffers=True) and reduce_amax=True."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    recipe = _recipe(10)
    torch.manual_seed(0)
    ddp = DDP(f8.convert_model(mlp()))
    x, t = shard(rank, world)
    run = _train(ddp, recipe, x, t, 3, _local_grads)
    del ddp
    _cleanup()
    return {"run": run, "reference": _reference_run(recipe, 3) if rank == 0 else None}


def scenario_ddp_compiled(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """DDP under torch.compile (aot_eager: eager's kernels), then the same training eagerly."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    recipe = _recipe(18)
    runs: dict[str, Any] = {}
    for name in ("compiled", "eager"):
        torch.manual_seed(0)
        ddp = DDP(f8.convert_model(mlp()))
        model = torch.compile(ddp, backend="aot_eager") if name == "compiled" else ddp
        x, t = shard(rank, world)
        runs[name] = _train(model, recipe, x, t, 3, _local_grads)  # type: ignore[arg-type]
        del ddp, model
        _cleanup()
    torch._dynamo.reset()
    return runs


def scenario_ddp_independent(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """reduce_amax=False under DDP: ddp_ignore_fp8_state keeps every rank's own states."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    recipe = _recipe(11, reduce_amax=False)
    torch.manual_seed(0)
    model = f8.convert_model(mlp())
    ignored = ddp_ignore_fp8_state(model)
    ddp = DDP(model)  # broadcast_buffers=True: would overwrite ranks' FP8 states otherwise
    on_wrapper = []
    for wrapper in (ddp, torch.compile(ddp)):  # too late: DDP read its list at construction
        try:
            ddp_ignore_fp8_state(wrapper)
            on_wrapper.append(None)
        except TypeError as exc:
            on_wrapper.append(str(exc))
    x, t = shard(rank, world)
    run = _train(ddp, recipe, x, t, 2, lambda m: [])
    del ddp, model
    _cleanup()
    return {"run": run, "ignored": ignored, "on_wrapper": on_wrapper}


def _cpu_mesh(world: int) -> Any:
    """A CPU device mesh: without one, ``fully_shard`` picks a CUDA mesh whenever CUDA is
    available and moves the model to cuda:0 while these scenarios' data stays on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def scenario_fsdp2(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """FSDP2 (fully_shard per Linear and at the root) with reduce_amax=True."""
    from torch.distributed.fsdp import fully_shard

    recipe = _recipe(12)
    torch.manual_seed(0)
    model = f8.convert_model(mlp())
    mesh = _cpu_mesh(world)
    for layer in model:
        if isinstance(layer, f8.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, t = shard(rank, world)
    run = _train(model, recipe, x, t, 3, _full_grads)
    del model
    _cleanup()
    return {"run": run, "reference": _reference_run(recipe, 3) if rank == 0 else None}


def _steps(model: nn.Module, recipe: DelayedScaling, rank: int, first: int, n: int) -> list:
    """n steps (inputs depend on rank and step); per step the output and the FP8 states."""
    out = []
    for step in range(first, first + n):
        with f8.autocast(recipe=recipe):
            y = model(_x(1.0 + step + 3.0 * rank, rows=4))
        y.sum().backward()
        out.append({"y": y.tolist(), "states": _model_states(model)})
    return out


def scenario_checkpoint_resume(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """torch.save/load: with reduction any rank's file resumes every rank; without, each its own."""
    out: dict[str, Any] = {}
    for reduce, length in ((True, 13), (False, 14)):
        recipe = _recipe(length, reduce_amax=reduce)
        torch.manual_seed(0)
        model = f8.convert_model(mlp())
        _steps(model, recipe, rank, 0, 2)
        path = Path(workdir) / f"ckpt_{reduce}_rank{rank}.pt"
        torch.save(model.state_dict(), path)
        dist.barrier()
        continued = _steps(model, recipe, rank, 2, 2)
        # With reduction every rank loads rank 1's file (any rank's state is every rank's).
        source = Path(workdir) / f"ckpt_{reduce}_rank{1 if reduce else rank}.pt"
        torch.manual_seed(123)  # different init: everything must come from the checkpoint
        fresh = f8.convert_model(mlp())
        fresh.load_state_dict(torch.load(source, weights_only=True))
        resumed = _steps(fresh, recipe, rank, 2, 2)
        out[str(reduce)] = {"continued": continued, "resumed": resumed}
        del model, fresh
        _cleanup()
    return out


def scenario_dcp_fsdp2(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """DCP save/load of an FSDP2 model (sharded weights, replicated FP8 state), reduce_amax."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    recipe = _recipe(15)

    mesh = _cpu_mesh(world)

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = init_fp8_state(f8.convert_model(mlp()), recipe)
        for layer in model:
            if isinstance(layer, f8.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = build(0)
    _steps(model, recipe, rank, 0, 2)
    ckpt = str(Path(workdir) / "dcp_fsdp2")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=ckpt)
    continued = _steps(model, recipe, rank, 2, 2)
    fresh = build(123)
    sd = {"model": get_model_state_dict(fresh)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(fresh, sd["model"])
    resumed = _steps(fresh, recipe, rank, 2, 2)
    # Without init_fp8_state the destination histories have the default 1024 rows.
    torch.manual_seed(0)
    unsized = f8.convert_model(mlp())
    error = None
    try:
        dcp.load({"model": unsized.state_dict()}, checkpoint_id=ckpt)
    except dcp.api.CheckpointException as exc:  # a BaseException
        error = f"{type(exc).__name__}: {exc}"
    del model, fresh, unsized
    _cleanup()
    return {"continued": continued, "resumed": resumed, "unsized_error": error}


def scenario_dcp_per_rank(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """reduce_amax=False with DCP: per-rank keys keep every rank's own state."""
    import torch.distributed.checkpoint as dcp

    recipe = _recipe(16, reduce_amax=False)
    torch.manual_seed(0)
    model = f8.convert_model(mlp())
    _steps(model, recipe, rank, 0, 2)
    ckpt = str(Path(workdir) / "dcp_per_rank")
    dcp.save({"model": per_rank_fp8_state_dict(model.state_dict(), model)}, checkpoint_id=ckpt)
    continued = _steps(model, recipe, rank, 2, 2)
    torch.manual_seed(123)
    fresh = init_fp8_state(f8.convert_model(mlp()), recipe)
    sd = {"model": per_rank_fp8_state_dict(fresh.state_dict(), fresh)}
    dcp.load(sd, checkpoint_id=ckpt)
    fresh.load_state_dict(from_per_rank_fp8_state_dict(sd["model"], fresh))
    resumed = _steps(fresh, recipe, rank, 2, 2)
    del model, fresh
    _cleanup()
    return {"continued": continued, "resumed": resumed}


def scenario_example(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """examples/distributed_train.py's training function, with DDP and with FSDP2."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "distributed_train.py"
    spec = importlib.util.spec_from_file_location("distributed_train_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = {wrap: example.train(wrap, steps=3) for wrap in ("ddp", "fsdp2")}
    _cleanup()
    return losses


def scenario_copy_with_group(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """deepcopy and torch.save of modules that ran under an explicit amax_reduction_group (a
    ProcessGroup, which does not pickle); the copies then step like the originals."""
    group = dist.new_group(list(range(world)))
    recipe = _recipe(3)
    out: dict[str, Any] = {}
    for kind, make in FP8_MODULE_KINDS.items():
        torch.manual_seed(0)
        module = make()

        def step(m: nn.Module, amax: float) -> list:
            x = _x(amax, rows=4).reshape(2, 2, 16)
            with f8.autocast(recipe=recipe, amax_reduction_group=group):
                y = m(x, x, x)[0] if isinstance(m, nn.MultiheadAttention) else m(x)
            y.sum().backward()
            return y.detach().tolist()

        step(module, 2.0 + rank)
        buf = io.BytesIO()
        torch.save(module, buf)
        buf.seek(0)
        copies = [copy.deepcopy(module), torch.load(buf, weights_only=False)]
        expected = (step(module, 3.0 + rank), _meta(module))
        out[kind] = [(step(c, 3.0 + rank), _meta(c)) == expected for c in copies]
    return out


SCENARIOS_2 = [
    scenario_copy_with_group,
    scenario_spec14,
    scenario_collective_count,
    scenario_moe,
    scenario_moe_callable,
    scenario_mismatch_first_step,
    scenario_mismatch_later_step,
    scenario_registry_changes,
    scenario_backward_passes_of_one_step,
    scenario_no_grad_leftover,
    scenario_kept_reduction_buffers,
    scenario_ddp,
    scenario_ddp_independent,
    scenario_ddp_compiled,
    scenario_fsdp2,
    scenario_checkpoint_resume,
    scenario_dcp_fsdp2,
    scenario_dcp_per_rank,
    scenario_example,
    # Last: rank 0 keeps the backward event its unfinished step armed (the ranks are out of
    # step for good after this error), which would run in a later scenario's backward pass.
    scenario_skipped_backward,
]
SCENARIOS_4 = [scenario_moe, scenario_mismatch_first_step]


def job_two_ranks(rank: int, world: int, workdir: str) -> dict[str, Any]:
    return run_scenarios(SCENARIOS_2, rank, world, workdir)


def job_four_ranks(rank: int, world: int, workdir: str) -> dict[str, Any]:
    return run_scenarios(SCENARIOS_4, rank, world, workdir)


def job_skipped_backward_with_a_frozen_teacher(
    rank: int, world: int, workdir: str
) -> dict[str, Any]:
    """:func:`scenario_skipped_backward` with a frozen teacher called under ``torch.no_grad()``
    inside the training autocast: it joins the forward events only (decision 0263), so the
    backward buffer must be padded to the forward buffer's length, not to 3 slots per GEMM of
    the backward's own modules, for the skipped pass to meet a buffer of its size (ADR 0265).
    A job of its own: the ranks are out of step for good after the error."""
    torch.manual_seed(0)
    teacher, student = f8.Linear(16, 16), f8.Linear(16, 16)
    recipe = _recipe(23)
    message = None
    try:
        for step in range(3):
            with f8.autocast(recipe=recipe):
                with torch.no_grad():
                    target = teacher(_x(2.0))
                y = student(_x(1.0))
            if not (step == 1 and rank == 0):
                (y - target).square().sum().backward()
    except AmaxReductionError as exc:
        message = str(exc)
    return {"message": message}


def job_rank_never_arrives(rank: int, world: int, workdir: str) -> dict[str, Any]:
    """Rank 1 never reaches the update event; rank 0 must fail within the group timeout."""
    release = Path(workdir) / "release"
    if rank == 1:
        deadline = time.monotonic() + 180  # run_job's limit in the test
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"message": None}
    torch.manual_seed(0)
    layer = f8.Linear(16, 16)
    message = None
    try:
        with f8.autocast(recipe=_recipe(5)):
            layer(_x(1.0))
    except AmaxReductionError as exc:
        message = str(exc)
    release.touch()
    return {"message": message}
