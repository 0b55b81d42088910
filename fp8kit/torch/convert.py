"""``convert_model``: swap every plain ``torch.nn.Linear`` of a model for ``f8.Linear``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fp8kit.torch.linear import Linear
from fp8kit.torch.state import FP8Meta

__all__ = ["convert_model"]

ModuleFilter = Callable[[nn.Module, str], bool]


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
    new.fp8_meta = FP8Meta(num_gemms=1, device=old.weight.device)
    new.train(old.training)
    return new


def convert_model(model: nn.Module, *, module_filter: ModuleFilter | None = None) -> nn.Module:
    """Replace every ``torch.nn.Linear`` in ``model`` (in place) with :class:`f8.Linear`.

    Args:
        model: any module. Only modules whose type is exactly ``torch.nn.Linear`` are replaced:
            subclasses (e.g. attention ``out_proj``) may rely on their own forward and are left.
        module_filter: ``(module, fully_qualified_name) -> bool``; a Linear is converted only if it
            returns True (the torchao convention).

    Returns:
        ``model`` itself, or a new :class:`f8.Linear` when ``model`` is a bare ``nn.Linear``.
        Parameters are the same objects as before (no copy), so existing optimizers keep working.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError("module_filter must be None or a callable (module, fqn) -> bool")

    def wanted(module: nn.Module, fqn: str) -> bool:
        return type(module) is nn.Linear and (module_filter is None or module_filter(module, fqn))

    if wanted(model, ""):
        return _to_fp8_linear(model)  # type: ignore[arg-type]
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            child_fqn = f"{fqn}.{name}" if fqn else name
            if wanted(child, child_fqn):
                setattr(parent, name, _to_fp8_linear(child))  # type: ignore[arg-type]
    return model
