"""Distributed FP8 training with fp8kit: DDP or FSDP2, amaxes reduced across ranks (CPU, gloo).

    torchrun --nproc-per-node 2 examples/distributed_train.py                # DDP
    torchrun --nproc-per-node 2 examples/distributed_train.py --wrap fsdp2   # FSDP2
    torchrun --nproc-per-node 2 examples/distributed_train.py --checkpoint /tmp/fp8-ckpt

Every rank trains on its own shard of a synthetic regression task. With ``reduce_amax=True``
(the default) each update event all-reduces the amaxes, so all ranks keep identical FP8 scales;
the script checks that at the end. The order of the set-up steps matters (see
``docs/distributed.md``): convert, size the FP8 state, then wrap.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fp8kit.torch as f8
from fp8kit.recipe import DelayedScaling
from fp8kit.torch.checkpoint import init_fp8_state
from fp8kit.torch.ddp import ddp_ignore_fp8_state


def build_model(recipe: DelayedScaling, wrap: str) -> nn.Module:
    """The same initial weights on every rank, converted to FP8, then wrapped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    f8.convert_model(model)  # 1. swap nn.Linear for f8.Linear before any wrapper sees the model
    init_fp8_state(model, recipe)  # 2. fixed FP8 state shapes (checkpoints load into them)
    if wrap == "ddp":
        ddp_ignore_fp8_state(model)  # 3. fp8kit keeps FP8 state in sync, not DDP's broadcast
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # This example trains on the CPU (gloo): say so, or fully_shard takes a CUDA mesh if it can.
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model:
        if isinstance(layer, f8.Linear):
            fully_shard(layer, mesh=mesh)  # 3. shards the weights; FP8 state stays per rank
    return fully_shard(model, mesh=mesh)


def fp8_state_checksum(model: nn.Module) -> torch.Tensor:
    """Sum of every FP8 history and scale of ``model`` (float64 scalar)."""
    total = torch.zeros((), dtype=torch.float64)
    for module in model.modules():
        if isinstance(module, f8.ScalingState):
            total += module.amax_history.double().sum() + module.scale.double().sum()
    return total


def train(wrap: str = "ddp", steps: int = 20, checkpoint: str | None = None) -> float:
    """Train on this rank's shard in an initialised process group; returns the last loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = DelayedScaling(amax_history_len=16)  # reduce_amax=True by default
    model = build_model(recipe, wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    target_map = torch.randn(64, 64, generator=torch.Generator().manual_seed(7)) / 8
    loss = torch.zeros(())
    for step in range(steps):
        x = torch.randn(32, 64, generator=gen) * (1 + rank)  # ranks see different ranges
        # Enter and exit the autocast on every rank in every step: its exit (and the backward
        # pass) are collectives when amaxes are reduced.
        with f8.autocast(recipe=recipe):
            y = model(x)
        loss = F.mse_loss(y, x @ target_map)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {loss.item():.5f}")

    sums = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, fp8_state_checksum(model))
    if any(not torch.equal(s, sums[0]) for s in sums):
        raise RuntimeError(f"FP8 states differ across ranks: {[float(s) for s in sums]}")
    if rank == 0:
        print(f"FP8 states identical on all {world} ranks (checksum {float(sums[0]):.6g})")
    if checkpoint is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # reduce_amax=True: every rank holds the same FP8 state, so DCP's one copy is right.
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=checkpoint)
        if rank == 0:
            print(f"saved a distributed checkpoint to {checkpoint}")
    return loss.item()


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=_positive_int, default=20, help="training steps (>= 1)")
    parser.add_argument("--checkpoint", default=None, help="directory for a DCP checkpoint")
    args = parser.parse_args()
    # A bounded timeout: a rank that stops taking part makes the others fail, not wait forever.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        train(args.wrap, args.steps, args.checkpoint)
        # Every rank done before any tears down: without it, an FSDP2 run (with or without FP8)
        # aborted at exit in about 1 of 5 runs on a 2-core CPU (docs/decisions/0266).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
