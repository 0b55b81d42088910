"""``convert_model``: swap every plain ``torch.nn.Linear`` / ``nn.MultiheadAttention`` of a model
for its FP8 counterpart.

What it converted and what it left (and why) goes to the ``fp8kit`` logger at INFO level (WARNING
when it converted nothing, and for a ``keep_high_precision`` pattern that matched no module).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from fp8kit.torch.attention import MultiheadAttention, to_fp8_attention
from fp8kit.torch.checkpoint import fp8_metas, summarize_fresh_fp8_state
from fp8kit.torch.linear import Linear
from fp8kit.torch.quantization import HIGH_PRECISION_DTYPES
from fp8kit.torch.state import FP8Meta

__all__ = ["convert_model", "label_fp8_modules"]

ModuleFilter = Callable[[nn.Module, str], bool]
logger = logging.getLogger("fp8kit")


def label_fp8_modules(model: nn.Module) -> nn.Module:
    """Name every FP8 module of ``model`` by its qualified name in ``model`` (``blocks.3.fc1``)
    in fp8kit's messages: the ``NonfiniteAmaxWarning``, layout and pool errors. A module built
    directly is otherwise named by its type and sizes (``Linear(64, 32)``), which does not tell
    same-shaped layers apart. :func:`convert_model` calls it. Returns ``model``."""
    for name, meta in fp8_metas(model):
        owner = name.rpartition(".")[0]  # the module holding ``fp8_meta``
        meta.set_label(owner or type(model).__name__)
    return model


def _to_fp8_linear(old: nn.Linear) -> Linear:
    new = Linear(
        old.in_features,
        old.out_features,
        bias=old.bias is not None,
        device="meta",
        dtype=old.weight.dtype,
    )
    # Keep the very same Parameter objects: optimizers and tied weights stay valid.
    new.weight = old.weight
    new.bias = old.bias
    new.fp8_meta = FP8Meta(num_gemms=1, device=old.weight.device)  # labelled by convert_model
    new.train(old.training)
    return new


# nn.Module's hook registries (torch 2.6 - 2.13), carried from a replaced module to its FP8 one.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _carry_over(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the hooks, the extra parameters, buffers and submodules and the extra
    attributes ``old`` carries, so conversion loses nothing a user attached.

    The handles returned at registration delete from the registry object they were made for,
    so ``new`` takes over each of ``old``'s hook registries (its own hooks, from its
    construction, go in first, as in a module built as FP8), and ``old`` keeps a copy: a hook
    registered later on one of the two does not fire on the other."""
    for registry in ("_parameters", "_buffers", "_modules"):
        mine = new.__dict__[registry]
        for key, value in old.__dict__[registry].items():
            mine.setdefault(key, value)
    new._non_persistent_buffers_set |= old._non_persistent_buffers_set
    for name in _HOOK_DICTS:
        hooks = old.__dict__.get(name)
        if not hooks:
            continue
        old.__dict__[name] = type(hooks)(hooks)
        users = list(hooks.items())
        hooks.clear()
        hooks.update(new.__dict__.get(name) or {})
        hooks.update(users)
        new.__dict__[name] = hooks
    if old.__dict__.get("_is_full_backward_hook") is not None:
        new.__dict__["_is_full_backward_hook"] = old.__dict__["_is_full_backward_hook"]
    for key, value in old.__dict__.items():
        if key not in new.__dict__:
            new.__dict__[key] = value


def _to_fp8(old: nn.Module) -> nn.Module:
    if isinstance(old, nn.MultiheadAttention):
        new: nn.Module = to_fp8_attention(old)
    else:
        new = _to_fp8_linear(old)  # type: ignore[arg-type]
    _carry_over(old, new)
    return new


def _check_patterns(keep_high_precision: object) -> tuple[str, ...]:
    if keep_high_precision is None:
        return ()
    if isinstance(keep_high_precision, str):
        return (keep_high_precision,)
    if isinstance(keep_high_precision, Iterable) and not isinstance(
        keep_high_precision, (bytes, bytearray)
    ):
        patterns = tuple(keep_high_precision)
        if all(isinstance(p, str) for p in patterns):
            return patterns
    raise TypeError(
        "keep_high_precision must be None, a module-name pattern (str, fnmatch style, e.g. "
        f"'lm_head' or '*.classifier') or a list/tuple/set of them, got {keep_high_precision!r}"
    )


def _weight_dtype(module: nn.Module) -> torch.dtype:
    weight = module.out_proj.weight if isinstance(module, nn.MultiheadAttention) else module.weight
    return weight.dtype  # type: ignore[union-attr, return-value]


def _parameter_names(module: nn.Module) -> tuple[str, ...]:
    """The weight and bias attributes the FP8 module takes over (dotted below ``module``)."""
    if isinstance(module, nn.MultiheadAttention):
        return (
            "in_proj_weight",
            "q_proj_weight",
            "k_proj_weight",
            "v_proj_weight",
            "in_proj_bias",
            "bias_k",
            "bias_v",
            "out_proj.weight",
            "out_proj.bias",
        )
    return ("weight", "bias")


def _computed_by_a_hook(module: nn.Module, dotted: str) -> bool:
    """Whether ``module``'s attribute ``dotted`` holds a tensor that is not a registered
    Parameter (a pruning or weight-norm hook writes a plain tensor there before each call)."""
    owner_name, _, name = dotted.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    value = getattr(owner, name, None)
    return isinstance(value, torch.Tensor) and owner._parameters.get(name) is not value


def _skip_reason(
    module: nn.Module, fqn: str, patterns: tuple[str, ...], module_filter: ModuleFilter | None
) -> str | None:
    """Why a Linear-like or attention ``module`` stays in high precision, or None to convert it."""
    if isinstance(module, (Linear, MultiheadAttention)):
        return f"already an f8.{type(module).__name__}"
    if type(module) not in (nn.Linear, nn.MultiheadAttention):
        base = "Linear" if isinstance(module, nn.Linear) else "MultiheadAttention"
        return f"a {type(module).__name__}, not exactly torch.nn.{base} (its forward may differ)"
    if "forward" in module.__dict__:
        return (
            "its forward is replaced on the instance (accelerate's hooks do that): the FP8 "
            "module would run that forward, not FP8 GEMMs"
        )
    computed = [name for name in _parameter_names(module) if _computed_by_a_hook(module, name)]
    if computed:
        return (
            f"{computed[0]} is computed by a hook, not a Parameter (pruning, weight_norm, "
            "spectral_norm): FP8 GEMMs would bypass it"
        )
    matched = [p for p in patterns if fnmatch.fnmatchcase(fqn, p)]
    if matched:
        return f"keep_high_precision pattern {matched[0]!r}"
    if isinstance(module, nn.Linear) and min(module.in_features, module.out_features) < 1:
        return "a Linear without features (in_features or out_features is 0)"
    dtype = _weight_dtype(module)
    if dtype not in HIGH_PRECISION_DTYPES:
        return f"weight dtype {dtype}: FP8 GEMMs take float32, bfloat16 or float16 operands"
    if module_filter is not None:
        keep = module_filter(module, fqn)
        if not isinstance(keep, bool):
            raise TypeError(f"module_filter must return a bool, got {keep!r} for {fqn!r}")
        if not keep:
            return "module_filter returned False"
    return None


# ---------------------------------------------------------------------------------------------


def convert_model(
    model: nn.Module,
    *,
    module_filter: ModuleFilter | None = None,
    keep_high_precision: str | Iterable[str] | None = None,
) -> nn.Module:
    """Replace every ``torch.nn.Linear`` (``torch.nn.MultiheadAttention``) in ``model``, in place,
    with :class:`f8.Linear` (:class:`f8.MultiheadAttention`).

    Args:
        model: any module. Only modules whose type is exactly ``torch.nn.Linear`` or
            ``torch.nn.MultiheadAttention`` are replaced: subclasses may rely on their own forward
            and are left (an attention's ``out_proj`` runs in FP8 inside the FP8 attention).
            Modules whose weights are not float32, bfloat16 or float16 are left too.
        module_filter: ``(module, fully_qualified_name) -> bool``; a module is converted only if
            it returns True (torchao's convention). Unlike torchao's ``module_filter_fn``, which
            sees ``nn.Linear`` only, it is also called with each ``nn.MultiheadAttention``, so a
            filter that reads ``in_features`` checks the type first.
        keep_high_precision: qualified module names to leave in high precision, as ``fnmatch``
            patterns (``"lm_head"``, ``"*.classifier"``, ``"blocks.0.*"``), one string or a
            list/tuple/set of them: the usual choice for the output layer, whose logits feed the
            loss directly.

    Returns:
        ``model`` itself, or a new FP8 module when ``model`` is a bare ``nn.Linear`` or
        ``nn.MultiheadAttention``. Parameters are the same objects as before (no copy), so
        existing optimizers keep working; a module shared by several parents stays one (FP8)
        module. Every FP8 module's state is labelled with its qualified name (warnings name it;
        :func:`label_fp8_modules`). The ``fp8kit`` logger lists the converted modules and every
        Linear-like module left, with the reason (INFO; WARNING when nothing was converted, and
        for a ``keep_high_precision`` pattern that matched nothing); a later
        ``load_state_dict`` of a checkpoint without FP8 state logs one line for all of it
        (:func:`~fp8kit.torch.checkpoint.plain_state_dict` goes the other way). PyTorch's fused
        encoder fast path, which would bypass FP8 submodules in eval, is off inside
        ``f8.autocast`` (docs/te_modules.md).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError("module_filter must be None or a callable (module, fqn) -> bool")
    patterns = _check_patterns(keep_high_precision)

    if isinstance(model, (nn.Linear, nn.MultiheadAttention)):
        reason = _skip_reason(model, "", patterns, module_filter)
        if reason is None:
            logger.info(
                "fp8kit.convert_model: converted the model itself (an nn.%s)",
                type(model).__name__,
            )
            return summarize_fresh_fp8_state(label_fp8_modules(_to_fp8(model)))
        logger.info(
            "fp8kit.convert_model: left the model itself (a %s) in high precision (%s)",
            type(model).__name__,
            reason,
        )
    converted: list[str] = []
    left: list[str] = []
    reasons: dict[str, str] = {}
    # Every (parent, name, child) edge to a Linear-like or attention module, shared modules
    # included, collected and decided before any change: a module reached by several paths is
    # kept in high precision if any path keeps it (one module, one decision).
    inside_attention = {id(m) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    edges = [
        (f"{fqn}.{name}" if fqn else name, parent, name, child)
        for fqn, parent in model.named_modules(remove_duplicate=False)
        if id(parent) not in inside_attention  # an attention's out_proj runs inside it
        for name, child in parent._modules.items()
        if isinstance(child, (nn.Linear, nn.MultiheadAttention))
    ]
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules(remove_duplicate=False))}
    kept: dict[int, tuple[str, str]] = {}  # id(module) -> (path, reason) of its first keeper
    for child_fqn, _, _, child in edges:
        reason = _skip_reason(child, child_fqn, patterns, module_filter)
        if reason is not None:
            kept.setdefault(id(child), (child_fqn, reason))
    replacements: dict[int, nn.Module] = {}  # id(old module) -> its FP8 module (shared modules)
    # Deepest edges first: a Linear registered inside a Linear is replaced before its parent's
    # submodules are carried over to the parent's FP8 module.
    for child_fqn, parent, name, child in reversed(edges):
        if id(child) in kept:
            first, reason = kept[id(child)]
            if child_fqn not in reasons:
                left.append(child_fqn)
                reasons[child_fqn] = reason if first == child_fqn else f"as {first}: {reason}"
            continue
        if id(child) not in replacements:
            replacements[id(child)] = _to_fp8(child)
        setattr(parent, name, replacements[id(child)])
        converted.append(child_fqn)
    converted.sort(key=order.__getitem__)
    left.sort(key=order.__getitem__)
    shared = len(converted) - len(replacements)  # paths to a module converted once already
    logger.info(
        "fp8kit.convert_model: converted %d module(s) to FP8%s: %s",
        len(replacements),
        f", reached by {len(converted)} paths" if shared else "",
        ", ".join(converted) or "none",
    )
    if left:
        # nothing converted and something other than FP8 modules left: the call did nothing
        # the user can see, so say why where a default logging setup shows it
        nothing = not converted and any(not reasons[f].startswith("already an f8.") for f in left)
        (logger.warning if nothing else logger.info)(
            "fp8kit.convert_model: %sleft %d Linear-like or attention module(s) in high "
            "precision: %s",
            "converted no module; " if nothing else "",
            len(left),
            "; ".join(f"{fqn} ({reasons[fqn]})" for fqn in left),
        )
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(f, p) for f in order)]
    if unused:
        logger.warning(
            "fp8kit.convert_model: keep_high_precision pattern(s) %s matched no module", unused
        )
    return summarize_fresh_fp8_state(label_fp8_modules(model))
