"""Train one numeric variant of the demo GPT: same seed, same initial weights, same batches.

Every variant builds its model after ``torch.manual_seed(seed)`` and reads the batches at the
offsets drawn once from ``seed``, so the variants differ only in their arithmetic.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

import torch

from fp8kit.demo.corpus import Corpus
from fp8kit.demo.model import GPT, GPTConfig
from fp8kit.demo.precision import Variant
from fp8kit.demo.progress import ProgressBar
from fp8kit.torch.checkpoint import fp8_metas
from fp8kit.torch.inspect import Inspector, SlotStats

__all__ = ["RunResult", "TrainConfig", "batch_offsets", "lr_at", "train_variant"]


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping settings shared by all variants."""

    steps: int = 250
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.0
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 25
    eval_windows: int = 48
    inspect_every: int = 5
    seed: int = 0


@dataclass
class RunResult:
    """What one variant's training produced.

    ``train_loss[i]`` is the loss of step ``i`` (nats per byte); ``val_loss`` holds
    ``(steps done, loss)`` pairs, the first before any step; ``step_time[i]`` is the wall time of
    step ``i`` in seconds (forward, backward, optimizer; evaluation excluded). ``emulated``: the
    variant's arithmetic was emulated, so its step times are not its real speed.
    """

    name: str
    label: str
    description: str
    tokens_per_step: int
    emulated: bool = False
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[tuple[int, float]] = field(default_factory=list)
    step_time: list[float] = field(default_factory=list)
    inspected: list[bool] = field(default_factory=list)
    stats: list[SlotStats] = field(default_factory=list)
    wall_s: float = 0.0
    diverged: str | None = None

    @property
    def final_train_loss(self) -> float:
        """Mean training loss of the last 10% of the steps (at least one step)."""
        if not self.train_loss:
            return math.nan
        k = max(1, len(self.train_loss) // 10)
        return statistics.fmean(self.train_loss[-k:])

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1][1] if self.val_loss and not self.diverged else math.nan

    @property
    def tokens_per_s(self) -> float:
        """Tokens per step over the median step time of the steps the inspector did not
        sample; NaN (reported as "n/a") when it sampled every step: an inspected step's time
        includes the statistics, so it never stands in for the training speed (docs/demo.md)."""
        times = [t for t, i in zip(self.step_time, self.inspected, strict=True) if not i]
        return self.tokens_per_step / statistics.median(times) if times else math.nan


def batch_offsets(n_tokens: int, block: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """Start offsets ``(steps, batch)`` of the training windows, drawn once from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - block - 1, (steps, batch), generator=g)


def _windows(data: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, ...]:
    idx = offsets[:, None] + torch.arange(block + 1, device=data.device)
    tokens = data[idx].long()
    return tokens[:, :-1], tokens[:, 1:]


def _val_batches(
    val: torch.Tensor, block: int, windows: int, batch: int
) -> Iterator[tuple[torch.Tensor, ...]]:
    last = val.numel() - block - 1
    n = max(1, min(windows, last + 1))
    offsets = torch.linspace(0, last, n).round().long().to(val.device)
    for chunk in offsets.split(batch):
        yield _windows(val, chunk, block)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _evaluate(model: GPT, variant: Variant, val: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean loss over the fixed validation windows of ``val`` (bytes, on the model's device), in
    the variant's arithmetic, leaving the training's FP8 scaling state as it was.

    A forward pass under ``torch.no_grad()`` stages its amaxes for the next training step's
    update event, as in Transformer Engine (docs/semantics.md section 3); the validation
    windows must not move the training scales, so their staged amaxes are put back."""
    block = model.cfg.block_size
    staged = [(m.forward, m.forward.amax_history[0].clone()) for _, m in fp8_metas(model)]
    total = count = 0.0
    with torch.no_grad(), variant.context():
        for x, y in _val_batches(val, block, cfg.eval_windows, cfg.batch_size):
            total += model(x, y).item() * x.shape[0]
            count += x.shape[0]
        for state, row in staged:
            state.amax_history[0].copy_(row)
    return total / count


def train_variant(
    variant: Variant,
    model_cfg: GPTConfig,
    cfg: TrainConfig,
    corpus: Corpus,
    *,
    inspect: bool = False,
    stream: TextIO | None = None,
    device: torch.device | None = None,
) -> RunResult:
    """Train a fresh model under ``variant`` for ``cfg.steps`` steps.

    Args:
        variant: the arithmetic (its context wraps every forward pass).
        model_cfg, cfg: model size and training settings.
        corpus: training and validation bytes.
        inspect: collect FP8 statistics every ``cfg.inspect_every`` steps (FP8 variants).
        stream: where the progress bar goes (default stderr).
        device: where the model and the batches live (default the CPU). The model is built on
            the CPU from the seed and then moved, so every device starts from the same weights.

    Returns:
        The losses, timings and statistics; ``diverged`` names the first non-finite loss.
    """
    device = torch.device("cpu") if device is None else device
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg).to(device)
    opt = _optimizer(model, cfg)
    block = model_cfg.block_size
    offsets = batch_offsets(corpus.train.numel(), block, cfg.batch_size, cfg.steps, cfg.seed)
    offsets = offsets.to(device)
    train_data = corpus.train.to(device)
    val_data = corpus.val.to(device)
    result = RunResult(
        variant.name,
        variant.label,
        variant.description,
        cfg.batch_size * block,
        emulated=variant.emulated,
    )
    inspector = Inspector(model, every=cfg.inspect_every) if inspect else None
    bar = ProgressBar(variant.label, cfg.steps, stream)
    start = time.perf_counter()
    if inspector is not None:
        inspector.attach()
    try:
        with inspector.paused() if inspector is not None else _nothing():
            result.val_loss.append((0, _evaluate(model, variant, val_data, cfg)))
        for step in range(cfg.steps):
            sampled = inspector is not None and inspector.sampling
            x, y = _windows(train_data, offsets[step], block)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            t0 = time.perf_counter()
            with variant.context():
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()
            result.step_time.append(time.perf_counter() - t0)
            result.inspected.append(sampled)
            result.train_loss.append(value)
            if inspector is not None:
                result.stats.extend(inspector.step(step + 1))  # steps count from 1 (metrics.csv)
            if not math.isfinite(value):
                result.diverged = f"non-finite training loss {value} at step {step + 1}"
                break
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                with inspector.paused() if inspector is not None else _nothing():
                    val = _evaluate(model, variant, val_data, cfg)
                result.val_loss.append((done, val))
                if not math.isfinite(val):
                    result.diverged = f"non-finite validation loss {val} after step {step}"
                    break
            speed = result.tokens_per_s
            bar.update(done, value, speed if math.isfinite(speed) else None)
    finally:
        if inspector is not None:
            inspector.detach()
        result.wall_s = time.perf_counter() - start
        bar.close(result.diverged or f"val loss {result.final_val_loss:.4f}")
    return result


class _nothing:
    """A do-nothing context manager (cheaper to read than contextlib.nullcontext here)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
