# Bench of the neuron device: per-op eager dispatch overhead (device vs CPU, one thread) with modelled device time.
"""Per-op dispatch overhead of the ``neuron`` device.

    python bench/device.py                 # dispatch table
    python bench/device.py --repeats 21 --number 200
    python bench/device.py --skip-training   # without the training-step table (it compiles GPT-2)

For each case the CPU op and the same op on neuron tensors run in
interleaved batches (``--repeats`` batches of ``--number`` calls each, one
thread); the table gives min and median µs per call, the overhead of the
device over CPU eager, and the modelled NeuronCore time of the op's one-op
program. Cases marked ``fast`` go through :mod:`tn.device.fastpath`;
``program`` ones run their one-op program on the software NeuronCore every
call. A breakdown table times the pieces of the fast path.

Sections are functions (:func:`dispatch_rows`, :func:`breakdown_rows`) that
return rows, so further tables (e.g. a training-step table) can be added as
their own functions and listed in :data:`SECTIONS`.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import tn  # noqa: F401  (registers the neuron device)


def _per_call_us(fn, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number * 1e6


def _cases():
    """(name, path, function of (tensors...), CPU inputs)."""
    torch.manual_seed(0)
    a4, b4 = torch.randn(4, 4), torch.randn(4, 4)
    a64, b64 = torch.randn(64, 64), torch.randn(64, 64)
    m32 = torch.randn(32, 32)
    return [
        ("add 4x4 f32", "fast", torch.add, (a4, b4)),
        ("mul 4x4 f32", "fast", torch.mul, (a4, b4)),
        ("add 4x4 bf16", "fast", torch.add, (a4.bfloat16(), b4.bfloat16())),
        ("add 64x64 f32", "fast", torch.add, (a64, b64)),
        ("add 4x4 + scalar", "program", lambda x: x + 1.0, (a4,)),
        ("relu 4x4", "program", torch.relu, (a4,)),
        ("sum 64x64", "program", torch.sum, (a64,)),
        ("matmul 32x32", "program", torch.matmul, (m32, m32)),
    ]


def dispatch_rows(repeats: int = 15, number: int = 100) -> list:
    """One row per case: CPU and device µs per call (min, median), overhead, modelled device µs."""
    rows = []
    for name, path, fn, cpu_in in _cases():
        dev_in = tuple(t.to("neuron") for t in cpu_in)
        fn(*cpu_in)
        fn(*dev_in)             # compile the one-op program (and arm the fast path)
        fn(*dev_in)
        t0 = torch.neuron.device_time_ns()
        fn(*dev_in)
        modelled_us = (torch.neuron.device_time_ns() - t0) / 1e3
        n = number if path == "fast" else max(1, number // 10)
        cpu, dev = [], []
        for _ in range(repeats):   # interleaved, so load changes hit both
            cpu.append(_per_call_us(lambda: fn(*cpu_in), n))
            dev.append(_per_call_us(lambda: fn(*dev_in), n))
        rows.append({"op": name, "path": path, "cpu_min_us": min(cpu), "cpu_med_us": statistics.median(cpu),
                     "neuron_min_us": min(dev), "neuron_med_us": statistics.median(dev),
                     "overhead_min_us": min(dev) - min(cpu), "modelled_device_us": modelled_us})
    return rows


def breakdown_rows(repeats: int = 15, number: int = 200) -> list:
    """Where the fast path's time goes for a 4x4 fp32 add (µs per call of each piece, min over repeats)."""
    from tn.device import allocator, fastpath

    a = torch.randn(4, 4).to("neuron")
    b = torch.randn(4, 4).to("neuron")
    a + b
    a + b
    keys = fastpath._CPU
    st = allocator.alloc_storage(64)

    def make():
        t = fastpath._create_empty([0], torch.float32)
        fastpath._set_redispatch(keys, t, st, 0, a.shape, (4, 1))
        return t

    out = make()
    ca, cb = torch.randn(4, 4), torch.randn(4, 4)
    pieces = [
        ("whole op (a + b)", lambda: a + b),
        ("allocate storage (native alloc + storage + weakref)", lambda: allocator.alloc_storage(64)),
        ("tensor object on the storage (create + set_)", make),
        ("native add (tn_dev_binary)", lambda: fastpath._binary(0, 0, a.data_ptr(), b.data_ptr(), out.data_ptr(), 16)),
        ("eligibility checks", lambda: (a.is_cpu, b.dtype is a.dtype, a.is_contiguous(), b.is_contiguous(),
                                        a.shape == b.shape)),
        ("CPU eager 4x4 add, for reference", lambda: ca + cb),
    ]
    rows = []
    for name, fn in pieces:
        rows.append({"piece": name, "min_us": min(_per_call_us(fn, number) for _ in range(repeats))})
    return rows


def training_rows(repeats: int = 15, number: int = 100) -> list:
    """Training steps (MLP, 2-layer GPT-2): CPU eager, neuron eager, torch.compile(backend="neuron"),
    host time and modelled device time (the workloads and runners of ``bench/training_step.py``)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import training_step

    torch._dynamo.config.cache_size_limit = 64
    steps = max(3, min(repeats, 7))
    return [{k: v for k, v in row.items() if k != "loss"} | {"loss": round(row["loss"], 5)}
            for name in training_step.WORKLOADS for row in training_step.bench(name, steps)]


#: (title, function) of every table this bench prints, in order
SECTIONS = [
    ("per-op dispatch: neuron eager vs CPU eager (one thread)", dispatch_rows),
    ("fast path breakdown, 4x4 fp32 add", breakdown_rows),
    ("training step: CPU eager, neuron eager, torch.compile(backend='neuron') (one thread)", training_rows),
]


def main(argv=None) -> None:
    """Print every section's table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15, help="interleaved batches per case")
    p.add_argument("--number", type=int, default=100, help="calls per batch")
    p.add_argument("--skip-training", action="store_true", help="leave out the training-step table")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for title, fn in SECTIONS:
        if args.skip_training and fn is training_rows:
            continue
        rows = fn(repeats=args.repeats, number=args.number)
        print(f"\n{title}")
        print(tabulate(rows, headers="keys", floatfmt=".2f"))


if __name__ == "__main__":
    main()
