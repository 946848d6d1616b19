# Run a function on N spawned ranks on loopback with a hard timeout (the tests' and benches' multi-process harness).
"""``run_ranks(job, world)``: ``job(rank, world)`` in ``world`` fresh processes, results back, never a hang.

Like ``torch.multiprocessing.spawn`` (the ``spawn`` start method: the neuron
device refuses use after fork), plus what a test or bench needs:
``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` are set, each rank's
return value (or its exception as text) comes back to the caller, and the
whole run has a deadline: ranks still running after ``timeout`` seconds are
killed and :class:`RanksTimeout` names them. ``job`` must be importable by
name from a fresh interpreter (a module-level function).

>>> from tn.distributed.spawn import free_port
>>> 1024 < free_port() < 65536
True
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as _queue
import socket
import time
import traceback
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from ..errors import TnError

__all__ = ["run_ranks", "free_port", "results_of", "RanksTimeout", "RankFailed"]


class RanksTimeout(TnError, RuntimeError):
    """Ranks did not report within the deadline (they were killed)."""


class RankFailed(TnError, RuntimeError):
    """A rank raised (the message holds its exception and traceback)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _entry(job, rank, world, port, results, env):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world)})
    os.environ.update(env[rank] if isinstance(env, (list, tuple)) else (env or {}))
    try:
        torch.set_num_threads(1)
        out = job(rank, world)
        results.put((rank, "ok", pickle.dumps(out)))   # plain pickle: no shared-memory tensors outliving the rank
    except BaseException as e:  # noqa: BLE001  (everything goes back to the parent)
        results.put((rank, "error", f"{type(e).__name__}: {e}", traceback.format_exc()))


def run_ranks(job: Callable, world: int = 2, timeout: float = 120.0, env=None,
              expect_exit: Sequence[int] = ()) -> Tuple[Dict[int, tuple], List]:
    """Run ``job(rank, world)`` on ``world`` spawned ranks; returns ``(reports, exit_codes)``.

    ``reports[rank]`` is ``("ok", result)`` or ``("error", "Type: message", traceback)``. ``env``: extra
    environment, set in the rank before ``job`` runs (a dict for every rank, or a list of one dict per rank);
    the ranks start with this process's environment plus ``OMP_NUM_THREADS=1`` unless it is set (what must hold
    from the ranks' first import on, such as tn's warm-up switch, goes into this process's environment). Ranks in ``expect_exit`` may end without reporting (a job that
    kills a rank). Raises :class:`RanksTimeout` naming the ranks that neither reported nor ended within
    ``timeout`` s."""
    base = {"OMP_NUM_THREADS": "1"}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(job, r, world, port, results, env), daemon=True)
             for r in range(world)]
    saved = {k: os.environ.get(k) for k in base}
    os.environ.update({k: os.environ.get(k, v) for k, v in base.items()})   # from the child's first import on
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    reports: Dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    dead_since: Dict[int, float] = {}
    try:
        while len(reports) < world and time.monotonic() < deadline:
            try:
                item = results.get(timeout=min(max(deadline - time.monotonic(), 0.01), 0.5))
                reports[item[0]] = (item[1], pickle.loads(item[2])) if item[1] == "ok" else item[1:]
                continue
            except _queue.Empty:
                pass
            now = time.monotonic()
            for r in range(world):   # a rank that ended without reporting: its queued report gets 2 s to arrive
                if r not in reports and not procs[r].is_alive():
                    dead_since.setdefault(r, now)
            if all(r in reports or (r in dead_since and (r in expect_exit or now - dead_since[r] > 2.0))
                   for r in range(world)):
                break
        missing = [r for r in range(world) if r not in reports and r not in expect_exit]
        if missing:
            ended = {r: procs[r].exitcode for r in missing if r in dead_since}
            raise RanksTimeout(f"ranks {missing} did not report within {timeout} s (exit codes of those that "
                               f"ended: {ended}; reports: {reports})")
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic() + 5)))
            if p.is_alive():
                p.kill()
                p.join(5)
    return reports, [p.exitcode for p in procs]


def results_of(reports: Dict[int, tuple]) -> list:
    """The results of every rank in rank order; :class:`RankFailed` with the first failing rank's error."""
    for r in sorted(reports):
        if reports[r][0] != "ok":
            raise RankFailed(f"rank {r} failed: {reports[r][1]}\n{reports[r][2]}")
    return [reports[r][1] for r in sorted(reports)]
