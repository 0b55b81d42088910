"""Run a function in several processes joined by a gloo process group, with a hard time limit.

:func:`run_job` starts ``world_size`` processes (forked from a forkserver that has imported torch
once, so each job costs no fresh torch import), rendezvous through a ``FileStore`` in a temporary
directory, runs ``fn(rank, world_size, workdir, *args)`` in each and returns every rank's return
value. A job that exceeds its time limit is killed and fails the calling test; an exception in a
rank fails it with that rank's traceback. Workers run several scenarios each
(:func:`run_scenarios`) because starting processes is the expensive part on a small machine.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "fp8kit.torch",
]
_context: Any = None


def _mp_context() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    pg_timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    out = Path(workdir) / f"result_{rank}.pt"
    torch.set_num_threads(1)  # several ranks share two cores
    try:
        store = torch.distributed.FileStore(str(Path(workdir) / "store"), world_size)
        torch.distributed.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result: Any = {"ok": fn(rank, world_size, workdir, *args)}
    except BaseException:  # report everything, the parent decides
        result = {"error": traceback.format_exc()}
    torch.save(result, out)
    # Exit without waiting for peers: a rank left in a broken collective must not block us.
    os._exit(0)


def run_job(
    fn: Callable[..., Any],
    world_size: int,
    workdir: Path,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 90.0,
    pg_timeout_s: float = 30.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, workdir, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level function (it is pickled by reference).
        workdir: an empty directory shared by the ranks (rendezvous file, results, checkpoints).
        timeout_s: hard limit for the whole job; beyond it every process is killed and the
            test fails.
        pg_timeout_s: the process group's timeout (bounds every collective).

    Returns:
        Each rank's return value, by rank.
    """
    ctx = _mp_context()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, str(workdir), pg_timeout_s, tuple(args)),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        pytest.fail(f"distributed job {fn.__name__} exceeded {timeout_s} s; ranks {hung} hung")
    results = []
    for rank in range(world_size):
        path = workdir / f"result_{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} of {fn.__name__} died (exit code {procs[rank].exitcode})")
        res = torch.load(path, weights_only=False)
        if "error" in res:
            pytest.fail(f"rank {rank} of {fn.__name__} raised:\n{res['error']}")
        results.append(res["ok"])
    return results


def run_scenarios(
    scenarios: Sequence[Callable[..., Any]], rank: int, world_size: int, workdir: str
) -> dict[str, Any]:
    """Run each scenario ``s(rank, world_size, workdir)`` in turn; collect results by name.

    An exception is recorded as ``{"error": traceback}`` and stops the remaining scenarios (the
    ranks may be out of step after it); they are recorded as ``{"error": "not run ..."}``.
    """
    results: dict[str, Any] = {}
    failed = None
    for scenario in scenarios:
        name = scenario.__name__
        if failed is not None:
            results[name] = {"error": f"not run: {failed} failed before it"}
            continue
        try:
            results[name] = scenario(rank, world_size, workdir)
        except BaseException:  # DCP's CheckpointException is not an Exception
            results[name] = {"error": traceback.format_exc()}
            failed = name
        if failed is None:
            torch.distributed.barrier()
    return results


def scenario_result(job: list[dict[str, Any]], name: str) -> list[Any]:
    """Every rank's result of scenario ``name``, failing the test if any rank raised."""
    per_rank = [ranks[name] for ranks in job]
    for rank, res in enumerate(per_rank):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{res['error']}")
    return per_rank
