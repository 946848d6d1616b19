# Bench: host cost of zeroing the runtime-allocated scratch/output block per program call, ranges vs the whole block.
"""Per-call host cost of the block of unbound outputs/scratch (issue 13's host wall).

Usage::

    python bench/scratch_zeroing.py [--steps 30] [--modes "tn.jit,device adaptive"] [--json PATH]

Runs the GPT-2 training step of ``bench/eager_windows.py`` (2 layers, d=128,
batch 2 x 32, SGD) under each mode and alternates, step by step in one
process, between the runtime's two ways of preparing the block a call carves
for its unbound outputs and scratch tensors:

* ``ranges``: zero only what :func:`tn.neuron.zeroing.zero_ranges` says the
  program may read before writing (and outputs' never-written bytes), as the
  runtime does;
* ``whole``: zero the whole block (``np.zeros`` when fresh, ``fill(0)`` when
  reused), as the runtime did before.

Per way: step host wall and host overhead (step wall minus the engine's wall
in the step's program runs), min / median over the steps (ms), and the block
bytes per step. That both ways compute the same thing is for the tests
(``tests/test_scratch_zeroing.py``) and ``bench/program_fingerprint.py``;
layouts made after the warm-up steps (none in a steady loop) are not toggled.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import eager_windows as ew  # noqa: E402
from tn.neuron import runtime  # noqa: E402

try:
    from tabulate import tabulate
except ImportError:  # pragma: no cover
    tabulate = None

_ENGINE_WALL = [0.0]
_BLOCK_BYTES = [0]
_OF_RUN = runtime.RunResult._of_run.__func__


def _of_run(cls, call, total, times, busy, counts, hbm, values, wall):
    _ENGINE_WALL[0] += wall
    if values and type(values[-1]) is runtime._Carved and values[-1].block is not None:
        _BLOCK_BYTES[0] += values[-1].block.nbytes
    return _OF_RUN(cls, call, total, times, busy, counts, hbm, values, wall)


def _zeroing_objects() -> list:
    """``(object, zero, late)`` of every carve layout and plan alive (what a run reads to zero its block)."""
    out = []
    for o in gc.get_objects():
        if type(o) is runtime._Layout:
            out.append((o, o.zero, o.late))
        elif type(o) is runtime.BoundPlan:
            out.append((o, o._zero, o._late))
    return out


def _set_whole(whole: bool, saved: list):
    """Make the ``saved`` layouts and plans zero their whole blocks (``whole``) or their ranges again."""
    for o, zero, late in saved:
        if whole:
            zero, late = None, ()
        if type(o) is runtime._Layout:
            o.zero, o.late = zero, late
        else:
            o._zero, o._late = zero, late


def bench_mode(mode: str, steps: int) -> list:
    """Rows (one per way) of one mode."""
    step = ew.train_runner(mode, ew.gpt2_workload, ew.Counters())
    for _ in range(3):     # compile, then let the spare blocks settle
        step()
    saved = _zeroing_objects()
    stats = {False: ([], [], []), True: ([], [], [])}
    gc.collect()
    for k in range(2 * steps):
        whole = bool(k & 1)
        _set_whole(whole, saved)
        _ENGINE_WALL[0] = 0.0
        _BLOCK_BYTES[0] = 0
        t = time.perf_counter()
        step()
        wall = time.perf_counter() - t
        walls, over, blocks = stats[whole]
        walls.append(wall)
        over.append(wall - _ENGINE_WALL[0])
        blocks.append(_BLOCK_BYTES[0])
    _set_whole(False, saved)
    rows = []
    for whole in (False, True):
        walls, over, blocks = stats[whole]
        rows.append({"mode": mode, "zeroing": "whole" if whole else "ranges",
                     "wall_ms_min": min(walls) * 1e3, "wall_ms_median": statistics.median(walls) * 1e3,
                     "overhead_ms_min": min(over) * 1e3, "overhead_ms_median": statistics.median(over) * 1e3,
                     "block_MB": statistics.median(blocks) / 1e6})
    return rows


def main(argv=None) -> int:
    """Run and print the table (``--json``: also write the rows)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="steps per way and mode")
    ap.add_argument("--modes", default="tn.jit,device adaptive")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    runtime.RunResult._of_run = classmethod(_of_run)
    rows = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        rows += bench_mode(mode, args.steps)
    cols = ["mode", "zeroing", "wall_ms_min", "wall_ms_median", "overhead_ms_min", "overhead_ms_median", "block_MB"]
    table = [[r[c] for c in cols] for r in rows]
    print(tabulate(table, headers=cols, floatfmt=".3f") if tabulate else "\n".join(map(str, table)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
