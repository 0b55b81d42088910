"""DistributedDataParallel integration: keep DDP's buffer broadcast away from FP8 state.

fp8kit keeps FP8 states consistent across ranks itself (docs/distributed.md), so DDP must not
broadcast them.
"""

from __future__ import annotations

from torch import nn

from fp8kit.torch.state import ScalingState

__all__ = ["ddp_ignore_fp8_state"]


def ddp_ignore_fp8_state(model: nn.Module) -> list[str]:
    """Keep ``DistributedDataParallel`` from broadcasting FP8 scaling state; call before wrapping.

    DDP broadcasts rank 0's buffers at construction and, with ``broadcast_buffers=True`` (its
    default), before every forward. fp8kit keeps the states consistent itself (identical on all
    ranks with ``reduce_amax=True``; deliberately per rank with ``False``), so the broadcast is at
    best wasted bandwidth and at worst overwrites other ranks' independent states. This adds
    every FP8 state buffer of ``model`` to DDP's ignore list (other buffers, e.g. BatchNorm
    statistics, are still broadcast).

    Returns:
        The fully qualified buffer names now ignored by DDP.

    Raises:
        TypeError: if ``model`` is not a module, or is already wrapped in
            ``DistributedDataParallel``.
        ValueError: if ``model`` has no FP8 state (called before ``convert_model``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    wrapped = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        # DDP reads the ignore list once, at construction: a later call would change nothing.
        raise TypeError(
            "model is already wrapped in DistributedDataParallel, which read its list of buffers "
            "to ignore at construction: call ddp_ignore_fp8_state(model) before wrapping"
        )
    names = [
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, ScalingState)
        for name, _ in module.named_buffers(recurse=False)
    ]
    if not names:
        raise ValueError(
            f"model (a {type(model).__name__}) has no FP8 state: call "
            "fp8kit.torch.convert_model(model) first (or build it from fp8kit.torch modules), "
            "then ddp_ignore_fp8_state(model), then wrap it in DistributedDataParallel"
        )
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    merged = existing + [n for n in names if n not in existing]
    # Public-by-convention hook read by DistributedDataParallel at construction.
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, merged)
    return names
