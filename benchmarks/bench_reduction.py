"""Cost of the distributed amax reduction per update event (issue 3).

Two gloo ranks on this machine each hold the forward states of 100 modules (``(L, 3)`` histories,
as ``f8.Linear``) and time one update event, with ``reduce_amax=False`` (local batched update) and
``reduce_amax=True`` (concatenate, one MAX all-reduce, layout fingerprint check, batched update).
Both ranks pass a barrier before every timed event so the all-reduce does not also measure a late
peer. Prints the median of the repeats (the slower rank's) in ms per event, and for scale a bare
all-reduce of the same buffer size.

    python -m benchmarks.bench_reduction [--modules 100] [--repeats 50]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8kit.recipe import DelayedScaling
from fp8kit.torch.state import ScalingState, update_states

HISTORY_LENS = (16, 1024)
E4M3_MAX = 448.0


def _time_events(
    variants: list[tuple[list[ScalingState], DelayedScaling]], repeats: int
) -> list[float]:
    """Median seconds of one forward update event per variant (states, recipe).

    The variants take turns in every repeat (round robin), so load changes on a shared machine
    hit them alike; 5 warm-up rounds are not timed.
    """
    times: list[list[float]] = [[] for _ in variants]
    for i in range(repeats + 5):
        for k, (states, recipe) in enumerate(variants):
            for s in states:  # a step's quantizations (not timed)
                s.record_amax(0, torch.tensor(1.0 + (i % 7) + dist.get_rank()))
            dist.barrier()
            start = time.perf_counter()
            update_states(states, recipe, E4M3_MAX, None, direction="forward")
            elapsed = time.perf_counter() - start
            if i >= 5:
                times[k].append(elapsed)
    return [statistics.median(t) for t in times]


def _time_bare_all_reduce(numel: int, repeats: int) -> float:
    """Median seconds of a plain MAX all-reduce of ``numel`` float32 (the collective's floor)."""
    buffer = torch.zeros(numel)
    times = []
    for i in range(repeats + 5):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
        elapsed = time.perf_counter() - start
        if i >= 5:
            times.append(elapsed)
    return statistics.median(times)


def _rank_main(rank: int, world: int, store_dir: str, modules: int, repeats: int) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(store_dir) / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    rows = []
    for length in HISTORY_LENS:
        variants = [
            (
                [ScalingState(3, length) for _ in range(modules)],
                DelayedScaling(amax_history_len=length, reduce_amax=reduce),
            )
            for reduce in (False, True)
        ]
        event_medians = _time_events(variants, repeats)
        bare = _time_bare_all_reduce(3 * modules + 3, repeats)
        medians = torch.tensor([*event_medians, bare])
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slower rank's medians
        rows.append((length, *(float(m) * 1e3 for m in medians)))
    if rank == 0:
        print(
            f"# amax reduction per update event: {modules} modules x 3 slots, {world} ranks, "
            f"gloo on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, 1 thread per rank, median of {repeats}"
        )
        print(
            "| amax_history_len | local update (ms) | with reduction (ms) | overhead (ms) "
            "| bare all-reduce (ms) |"
        )
        print("|---|---|---|---|---|")
        for length, local, reduced, bare_ms in rows:
            print(
                f"| {length} | {local:.3f} | {reduced:.3f} | {reduced - local:.3f} "
                f"| {bare_ms:.3f} |"
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="5 repeats (smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 5
    with tempfile.TemporaryDirectory() as store_dir:
        mp.spawn(
            _rank_main,
            args=(args.ranks, store_dir, args.modules, args.repeats),
            nprocs=args.ranks,
            join=True,
        )


if __name__ == "__main__":
    main()
