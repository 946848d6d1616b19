# Bench: one training step (forward, loss, backward, SGD step) of a small MLP and a 2-layer GPT-2 on each of tn's doors.
"""Training-step benchmark: CPU eager, neuron eager, torch.compile(backend="neuron").

Usage::

    python bench/training_step.py [--json PATH] [--repeats N] [--only mlp,gpt2]

Every column trains its own copy of the same model (same initial weights,
same batch) with ``torch.optim.SGD(lr=0.01, momentum=0.9)``; one step is
``zero_grad``, forward, loss, ``backward``, ``step``. Measured in one process
with one CPU thread, repeats interleaved across columns (cpu, neuron, compile,
compile-on-device, cpu, ...) so machine noise hits every column alike.

Rows (per workload):

* ``cpu eager``: torch on the CPU (the reference).
* ``neuron eager``: ``model.to("neuron")``: every aten op a one-op NeuronCore
  program (skipped when the device is not available).
* ``compile (cpu in)``: ``torch.compile(model, backend="neuron")`` on CPU
  tensors: AOTAutograd forward and backward graphs, each one tn program;
  the optimizer step runs eagerly on the CPU.
* ``compile (neuron in)``: the same with the model and batch on the device
  (optimizer step as neuron eager ops).

Columns: ``host ms`` min / median wall time of a step; ``device us``:
modelled NeuronCore time of one step (every program run, eager or compiled,
back to back, from any thread; 0 for the CPU); ``1st step s``: first step (tracing and
compiling); ``host ops``: ops that ran on the host instead of the NeuronCore;
``loss``: the loss of the last step (all rows should agree closely).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tn  # noqa: E402
import tn.lower  # noqa: E402,F401  (registers the neuron jit backend)
from tn import dynamo_backend  # noqa: E402

try:
    from tabulate import tabulate
except ImportError:  # pragma: no cover
    tabulate = None


# --------------------------------------------------------------------------- workloads


def _mlp():
    """MLP 256 -> 512 -> 512 -> 10 (GELU), batch 64, cross-entropy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    return model, (x, y), loss_fn


def _gpt2():
    """Hugging Face GPT2LMHeadModel, 2 layers, width 128, 4 heads, vocab 512; batch 4 x 64 tokens, LM loss."""
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(3, 512, (4, 64), generator=torch.Generator().manual_seed(1))

    def loss_fn(m, batch):
        return m(batch[0], labels=batch[0]).loss

    return model, (ids,), loss_fn


WORKLOADS = {"mlp": _mlp, "gpt2": _gpt2}


# --------------------------------------------------------------------------- runners


def device_available() -> bool:
    """True when the ``neuron`` device is registered and usable."""
    mod = getattr(torch, "neuron", None)
    try:
        return bool(mod is not None and mod.is_available())
    except Exception:
        return False


class Runner:
    """One column: a model copy, its optimizer, and the function that runs one training step."""

    def __init__(self, label, model, batch, loss_fn, device, compiled):
        self.label = label
        self.model = copy.deepcopy(model).to(device).train()
        self.batch = tuple(t.to(device) for t in batch)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.fwd = torch.compile(self.model, backend="neuron") if compiled else self.model
        self.loss_fn = loss_fn
        self.device = device
        self.compiled = compiled
        self.times = []
        self.first_s = None
        self.device_us = 0.0
        self.host_ops = {}
        self.loss = None

    def step(self):
        """One training step; returns the loss as a Python float (which synchronises)."""
        self.opt.zero_grad()
        loss = self.loss_fn(self.fwd, self.batch)
        loss.backward()
        self.opt.step()
        return loss.item()

    def warm(self):
        """First step (timed separately: tracing/compiling), a second to reach steady state, one measured step.

        Modelled device time is taken from counters rather than ``tn.profile()``:
        autograd runs a device's backward in its own worker thread, which a
        profiler (a context variable of the calling thread) does not see. Eager
        device ops charge ``torch.neuron.device_time_ns()`` from any thread;
        compiled graphs keep the profile of their last call.
        """
        if self.device == "neuron":
            tn.neuron.reset_op_counts()
        before = set(id(g) for g in dynamo_backend.compiled_graphs())
        t = time.perf_counter()
        self.step()
        self.first_s = time.perf_counter() - t
        self.step()
        graphs = [g for g in dynamo_backend.compiled_graphs() if id(g) not in before]
        exes = [x for g in graphs for x in dynamo_backend.executables_of(g)]
        for x in exes:
            x.last_profile = None
        eager0 = torch.neuron.device_time_ns() if device_available() else 0.0
        self.loss = self.step()
        eager_ns = (torch.neuron.device_time_ns() - eager0) if device_available() else 0.0
        compiled_ns = sum(x.last_profile.total_ns for x in exes if getattr(x, "last_profile", None) is not None)
        self.device_us = (eager_ns + compiled_ns) / 1e3
        host = {}
        for g in graphs:
            for k, v in dynamo_backend.host_ops_of(g).items():
                host[k] = host.get(k, 0) + v
        if self.device == "neuron":
            for k, v in tn.neuron.fallback_ops().items():
                host[k] = host.get(k, 0) + v
        self.host_ops = host

    def timed(self):
        """One timed step."""
        t = time.perf_counter()
        self.loss = self.step()
        self.times.append(time.perf_counter() - t)


def bench(name, repeats):
    """Rows of one workload."""
    model, batch, loss_fn = WORKLOADS[name]()
    specs = [("cpu eager", "cpu", False)]
    dev = device_available()
    if dev:
        specs.append(("neuron eager", "neuron", False))
    specs.append(("compile (cpu in)", "cpu", True))
    if dev:
        specs.append(("compile (neuron in)", "neuron", True))
    torch._dynamo.reset()
    runners = []
    for label, device, compiled in specs:
        r = Runner(label, model, batch, loss_fn, device, compiled)
        r.warm()
        runners.append(r)
    for _ in range(repeats):
        for r in runners:
            r.timed()
    rows = []
    for r in runners:
        rows.append({
            "workload": name, "mode": r.label,
            "host_ms_min": min(r.times) * 1e3, "host_ms_median": statistics.median(r.times) * 1e3,
            "device_us": r.device_us, "first_step_s": r.first_s,
            "host_ops": ", ".join(f"{k} x{v}" for k, v in sorted(r.host_ops.items())) or "-",
            "loss": r.loss,
        })
    return rows


def main(argv=None) -> int:
    """Run the bench, print the table, optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per column (interleaved)")
    ap.add_argument("--only", default="", help="comma-separated workloads (" + ",".join(WORKLOADS) + ")")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(WORKLOADS)
    for n in names:
        if n not in WORKLOADS:
            ap.error(f"unknown workload {n!r}; choose from {', '.join(WORKLOADS)}")
    rows = []
    for n in names:
        rows.extend(bench(n, args.repeats))
    table = [[r["workload"], r["mode"], f"{r['host_ms_min']:.1f} / {r['host_ms_median']:.1f}",
              f"{r['device_us']:.0f}" if r["device_us"] else "-", f"{r['first_step_s']:.2f}", r["host_ops"],
              f"{r['loss']:.5f}"] for r in rows]
    headers = ["workload", "mode", "host ms min/med", "device us", "1st step s", "host ops", "loss"]
    if tabulate is not None:
        print(tabulate(table, headers=headers))
    else:  # pragma: no cover
        print("\t".join(headers))
        for row in table:
            print("\t".join(map(str, row)))
    if not device_available():
        print("(the neuron device is not available: its rows are skipped)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
