"""torch.compile: a model of f8.Linear trains with the same numbers as in eager mode."""

from __future__ import annotations

import pytest
import torch

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        f8.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), f8.Linear(64, 16)
    )


@pytest.mark.slow
def test_compiled_model_matches_eager_bit_for_bit() -> None:
    eager, compiled_base = _model(), _model()
    compiled = torch.compile(compiled_base)
    recipe = DelayedScaling(amax_history_len=4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_base)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(8, 32, generator=gen)
        outs = []
        for model, opt in zip((eager, compiled), opts, strict=True):
            with f8.autocast(recipe=recipe):
                y = model(x)
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y.detach())
        assert torch.equal(outs[0], outs[1])
    for (name, a), b in zip(eager.state_dict().items(), compiled_base.state_dict().values(),
                            strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    assert eager[0].fp8_meta.forward.update_count[0].item() == 4
