"""Checkpoint helpers for FP8 state (docs/semantics.md section 6): torch.save and DCP.

FP8 state is ordinary fixed-shape tensors in ``state_dict`` (``fp8_meta.forward.amax_history``
``(L, n)``, ``.scale`` ``(n,)``, ``.update_count`` ``(n,)``) plus the recipe as JSON data, so any
checkpointer can save it. Loading with a planner that writes into existing tensors, as
``torch.distributed.checkpoint`` (DCP) does, needs destination tensors of the saved shape, while a
module is built with ``L = 1024`` and only resized at its first training forward (or update
event) under a recipe:
:func:`init_fp8_state` sizes every FP8 state for a recipe up front.

DCP saves one copy of every (non-DTensor) tensor, as if all ranks held the same: right with
``reduce_amax=True``; with ``reduce_amax=False`` use :func:`per_rank_fp8_state_dict` so that
every rank saves and loads its own FP8 state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fp8kit.recipe import DelayedScaling
from fp8kit.torch.state import FP8Meta, bind_recipe
from fp8kit.torch.state.buffers import (
    FP8_STATE_KEY,
    finish_fresh_state_summary,
    start_fresh_state_summary,
)

__all__ = [
    "fp8_metas",
    "from_per_rank_fp8_state_dict",
    "init_fp8_state",
    "per_rank_fp8_state_dict",
    "plain_state_dict",
    "summarize_fresh_fp8_state",
]

logger = logging.getLogger("fp8kit")


def fp8_metas(model: nn.Module) -> list[tuple[str, FP8Meta]]:
    """Every :class:`FP8Meta` in ``model`` with its fully qualified name, in module order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Meta)]


def plain_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` without FP8 state: the weights as the unconverted model has them.

    Loads with ``strict=True`` into the model before :func:`~fp8kit.torch.convert_model`, for
    tools that know only ``torch.nn.Linear``. (The other way round needs nothing: a converted
    model loads a plain state_dict and starts with fresh FP8 state.)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return {k: v for k, v in model.state_dict().items() if not FP8_STATE_KEY.search(k)}


def _start_summary(
    module: nn.Module,
    state_dict: Any,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load-state-dict pre hook: collect this load's absent FP8 states (outermost module)."""
    if start_fresh_state_summary(missing_keys):
        module.__dict__["_fp8kit_summary_keys"] = missing_keys


def _finish_summary(module: nn.Module, incompatible: Any) -> None:
    """Load-state-dict post hook: one INFO line for the absent FP8 states collected."""
    keys = module.__dict__.pop("_fp8kit_summary_keys", None)
    if keys is None or keys is not incompatible.missing_keys:
        return
    names = finish_fresh_state_summary(keys)
    if names:
        logger.info(
            "fp8kit: the loaded state_dict has no FP8 state for %d FP8 module(s) (%s%s): they "
            "start fresh (amax history 0, scale 1)",
            len(names),
            ", ".join(names[:3]),
            ", ..." if len(names) > 3 else "",
        )


def summarize_fresh_fp8_state(module: nn.Module) -> nn.Module:
    """Make every ``module.load_state_dict`` that lacks FP8 state log one line for all of it.

    Without it, each FP8 module whose state a checkpoint lacks logs its own line (INFO,
    ``fp8kit`` logger); :func:`~fp8kit.torch.convert_model` and ``TransformerLayer`` call this on
    the module they return / on themselves. Calling it twice on a module does nothing more.

    Returns:
        ``module`` itself.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not module.__dict__.get("_fp8kit_summarized", False):
        module.__dict__["_fp8kit_summarized"] = True
        module.register_load_state_dict_pre_hook(_start_summary)
        module.register_load_state_dict_post_hook(_finish_summary)
    return module


def init_fp8_state(model: nn.Module, recipe: DelayedScaling | None = None) -> nn.Module:
    """Size every FP8 scaling state of ``model`` for ``recipe`` (default ``DelayedScaling()``).

    Call it on a freshly built model before loading a checkpoint saved under ``recipe`` with
    ``torch.distributed.checkpoint.load`` (which needs destination tensors of the saved shapes),
    or to fix the state shapes before the first step. Histories get ``recipe.amax_history_len``
    rows (a state that already holds values is resized with a warning, as at a training forward
    under a new recipe) and the recipe is recorded in each state's extra state.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: if ``recipe`` is not None or a DelayedScaling.
        ValueError: if ``model`` has no FP8 modules (called before ``convert_model``).
    """
    if recipe is None:
        recipe = DelayedScaling()
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            "recipe must be None or a fp8kit.recipe.DelayedScaling (the only recipe with "
            f"state), got {type(recipe).__name__}"
        )
    metas = [meta for _, meta in fp8_metas(model)]
    if not metas:
        raise ValueError(
            f"model (a {type(model).__name__}) has no FP8 modules, so there is no state to size: "
            "call fp8kit.torch.convert_model(model) first, or build it from fp8kit.torch modules"
        )
    why = f"init_fp8_state with amax_history_len={recipe.amax_history_len}"
    for meta in metas:
        bind_recipe(meta, recipe, why)
    return model


# Module attributes that wrap the real module and that torch's state-dict helpers
# (torch.distributed.checkpoint.state_dict.get_model_state_dict) leave out of its keys:
# torch.compile's OptimizedModule, FSDP1 and activation-checkpoint wrappers. (DDP / DataParallel
# hold theirs as ``module``, left out only under those classes.)
_WRAPPER_ATTRS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_DATA_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def _unwrapped_name(model: nn.Module, name: str) -> str:
    """``name`` (a submodule path of ``model``) without the wrapper attributes on its way, as
    ``get_model_state_dict`` spells keys (DDP's ``module.0.fp8_meta`` -> ``0.fp8_meta``)."""
    parts, module = [], model
    for part in name.split(".") if name else ():
        in_data_parallel = part == "module" and isinstance(module, _DATA_PARALLEL)
        if not (part in _WRAPPER_ATTRS or in_data_parallel):
            parts.append(part)
        module = module._modules[part]  # type: ignore[assignment]
    return ".".join(parts)


def _fp8_tensor_keys(model: nn.Module) -> list[tuple[str, ...]]:
    """The state-dict keys of every FP8 state tensor of ``model`` (histories, scales, counts),
    each as its spellings: ``model.state_dict()``'s key, then ``get_model_state_dict``'s where
    a wrapper (DDP, torch.compile, FSDP1) makes them differ."""
    keys = []
    for prefix, meta in fp8_metas(model):
        spellings = dict.fromkeys((prefix, _unwrapped_name(model, prefix)))
        for name, value in meta.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor):  # persistent buffers (derived ones are not saved)
                keys.append(tuple(f"{p}.{name}" if p else name for p in spellings))
    return keys


def _rank(rank: int | None) -> int:
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be None (this process's rank) or an int >= 0, got {rank!r}")
        if rank < 0:
            raise ValueError(f"rank must be None (this process's rank) or an int >= 0, got {rank}")
        return rank
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_state_dict_and_model(state_dict: Any, model: Any) -> None:
    """A TypeError naming the argument unless ``state_dict`` is a mapping and ``model`` a module
    (the two are easily swapped)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping (model.state_dict() or get_model_state_dict(model)), "
            f"got {type(state_dict).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def per_rank_fp8_state_dict(
    state_dict: dict[str, Any], model: nn.Module, rank: int | None = None
) -> dict[str, Any]:
    """Key ``model``'s FP8 state tensors in ``state_dict`` by rank, for DCP with per-rank state.

    ``torch.distributed.checkpoint`` treats ordinary tensors as replicated and saves one copy
    per key. That is right with ``reduce_amax=True`` (every rank holds the same state) but keeps
    only one rank's state with ``reduce_amax=False``. This returns a shallow copy of
    ``state_dict`` in which every FP8 history, scale and count ``k`` is renamed ``k.rank{r}``, so
    every rank saves its own; :func:`from_per_rank_fp8_state_dict` undoes it after a load. Use it
    on both sides (save and load template) with the same world size.

    Args:
        state_dict: ``model.state_dict()`` or ``get_model_state_dict(model)`` (or a DCP template
            built from either).
        model: the module it came from (names FP8 state keys).
        rank: the suffix to use; default this process's rank (0 without torch.distributed).

    Raises:
        ValueError: if ``state_dict`` has none of ``model``'s FP8 state keys (a state dict of
            another model: nothing would be keyed by rank), or ``model`` has no FP8 state.
        TypeError: if ``state_dict`` is not a mapping or ``model`` not a module.
    """
    _check_state_dict_and_model(state_dict, model)
    r = _rank(rank)
    out = dict(state_dict)
    spellings = _fp8_tensor_keys(model)
    if not spellings:
        raise ValueError(
            f"model (a {type(model).__name__}) has no FP8 state: there is nothing to key by rank "
            "(pass the model the state dict came from)"
        )
    renamed = 0
    for key in (k for keys in spellings for k in keys if k in out):
        out[f"{key}.rank{r}"] = out.pop(key)
        renamed += 1
    if spellings and not renamed:
        raise ValueError(
            f"state_dict holds none of model's FP8 state keys (such as {spellings[0][-1]!r}): "
            "pass the state dict of this model (model.state_dict() or get_model_state_dict(model))"
        )
    return out


def from_per_rank_fp8_state_dict(
    state_dict: dict[str, Any], model: nn.Module, rank: int | None = None
) -> dict[str, Any]:
    """Inverse of :func:`per_rank_fp8_state_dict`: back to ``model.state_dict()`` keys.

    Raises:
        KeyError: if ``state_dict`` lacks this rank's entries (saved with another world size or
            without :func:`per_rank_fp8_state_dict`).
        TypeError: if ``state_dict`` is not a mapping or ``model`` not a module.
    """
    _check_state_dict_and_model(state_dict, model)
    r = _rank(rank)
    out = dict(state_dict)
    for keys in _fp8_tensor_keys(model):
        key = next((k for k in keys if f"{k}.rank{r}" in out), None)
        if key is None:
            raise KeyError(
                f"{keys[-1] + f'.rank{r}'!r} is missing: the state dict has no FP8 state for "
                f"rank {r} (was it saved with per_rank_fp8_state_dict and the same world size?)"
            )
        out[key] = out.pop(f"{key}.rank{r}")
    return out
