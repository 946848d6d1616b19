# Bench: tn.adaptive vs neuron eager, always-tn.jit, torch.compile(backend="neuron") and CPU torch.compile on four workloads.
"""Does the adaptive controller pick the better of eager and jit, and beat both on mixed workloads?

Workloads (one thread, seeded):

(a) ``stable``: a stack of transformer blocks (LayerNorm, 4-head causal
    self-attention, GELU MLP), the same input shape every call;
(b) ``random``: the same stack, random batch and sequence length every call;
(c) ``phases``: alternating phases of stable shapes and churning shapes;
(d) ``gpt2``: HF GPT-2 (tiny config) greedy ``generate`` with a growing
    sequence (KV cache, the HF default), several prompts.

Columns per strategy: total wall time (s), modelled NeuronCore time (ms,
from ``tn.profile()``), number of compiles, and the largest difference from
eager (tokens: number of differing sequences). Strategies: ``eager`` (model
and inputs on the ``neuron`` device: every op a one-op program), ``jit``
(``tn.jit`` of the model, neuron backend; for (d) the forward jitted with
``use_cache=False``, since tn.jit cannot take HF's cache object), ``adaptive``
(``tn.adaptive(model)``, defaults), ``tc-neuron`` (``torch.compile(backend=
"neuron")``) and ``tc-cpu`` (``torch.compile`` with Inductor, CPU tensors).
Every cell starts with the device's one-op program cache
empty (an earlier column's eager programs would otherwise be free). When a
workload cannot run on the neuron device, it runs on the CPU and the
``place`` column says so.

Goals: adaptive within 1.1x of min(eager, jit) on every workload; strictly
better than both on (c) and (d).

Usage: ``python bench/adaptive.py [--json PATH] [--scale N] [--no-torch-compile] [--only a,b,c,d]``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
import traceback

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import tn
import tn.lower  # noqa: F401  (registers the "neuron" jit backend)

torch.set_num_threads(1)

D, HEADS, LAYERS = 64, 4, 4


class Block(nn.Module):
    """Pre-LN transformer block: causal multi-head attention + GELU MLP."""

    def __init__(self, d: int = D, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def stack() -> nn.Module:
    """The block stack of workloads (a)-(c)."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(LAYERS)]).eval()


def shapes(kind: str, scale: int) -> list:
    """Input shapes (batch, seq) of workload ``kind``."""
    rng = random.Random(0)
    n = 30 * scale
    if kind == "stable":
        return [(4, 16)] * n
    if kind == "random":
        return [(rng.randint(1, 8), rng.randint(4, 32)) for _ in range(n)]
    if kind == "phases":
        out = []
        for _ in range(3):
            out += [(4, 16)] * (12 * scale)
            out += [(rng.randint(1, 8), rng.randint(4, 32)) for _ in range(6 * scale)]
        return out
    raise ValueError(kind)


def neuron_ok(model: nn.Module, sample) -> bool:
    """True when the model runs eagerly on the neuron device and agrees with the CPU."""
    try:
        m = copy.deepcopy(model).to("neuron")
        with torch.no_grad():
            y = m(sample.to("neuron")).cpu()
            return torch.allclose(y, model(sample), atol=1e-3, rtol=1e-3)
    except Exception:
        return False


def run_stack(kind: str, strategy: str, scale: int) -> dict:
    """One cell of workloads (a)-(c)."""
    base = stack()
    shp = shapes(kind, scale)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(b, t, D, generator=g) for b, t in shp]
    with torch.no_grad():
        refs = [base(x) for x in xs]
    dev = "cpu" if strategy == "tc-cpu" or not neuron_ok(base, xs[0]) else "neuron"
    m = copy.deepcopy(base).to(dev)
    compiles = lambda: 0  # noqa: E731
    if strategy == "jit":
        f = tn.jit(m, backend="neuron")
        compiles = lambda: f.cache_info().misses  # noqa: E731
    elif strategy == "adaptive":
        f = tn.adaptive(m)
        compiles = lambda: sum(r.compiles for r in f.regions.values())  # noqa: E731
    elif strategy == "tc-neuron":
        from tn import dynamo_backend
        start = dynamo_backend.graphs_compiled()
        f = torch.compile(m, backend="neuron")
        compiles = lambda: dynamo_backend.graphs_compiled() - start  # noqa: E731
    elif strategy == "tc-cpu":
        import torch._dynamo.utils as du
        start = du.counters["stats"]["unique_graphs"]
        f = torch.compile(m)
        compiles = lambda: du.counters["stats"]["unique_graphs"] - start  # noqa: E731
    else:
        f = m
    xs_dev = [x.to(dev) for x in xs]
    err = 0.0
    with torch.no_grad(), tn.profile() as prof:
        t0 = time.perf_counter()
        outs = [f(x) for x in xs_dev]
        wall = time.perf_counter() - t0
    for y, r in zip(outs, refs):
        err = max(err, float((y.cpu() - r).abs().max()))
    row = {"wall_s": wall, "device_ms": prof.total_us / 1e3, "compiles": compiles(), "err": err, "place": dev}
    if strategy == "adaptive":
        row["report"] = f.report(print_table=False)
    return row


def gpt2(scale: int):
    """A tiny HF GPT-2 and its prompts for workload (d)."""
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=256,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 256, (1, 6 + 2 * i), generator=g) for i in range(3)]
    return model, prompts, 24 * scale


def run_gpt2(strategy: str, scale: int) -> dict:
    """One cell of workload (d): greedy generation of every prompt."""
    base, prompts, new = gpt2(scale)
    with torch.no_grad():
        refs = [base.generate(p, max_new_tokens=new, do_sample=False) for p in prompts]
    dev = "neuron"
    if strategy == "tc-cpu":
        dev = "cpu"
    else:
        try:
            m = copy.deepcopy(base).to("neuron")
            with torch.no_grad():
                m.generate(prompts[0].to("neuron"), max_new_tokens=2, do_sample=False)
        except Exception:
            dev = "cpu"
    m = copy.deepcopy(base).to(dev)
    kw = {}
    compiles = lambda: 0  # noqa: E731
    target = m
    if strategy == "jit":
        core = copy.deepcopy(m)
        jm = tn.jit(core, backend="neuron")
        m.forward = lambda *a, **k: jm(*a, **k)  # generate calls model(...) -> the jitted forward
        kw = {"use_cache": False}
        compiles = lambda: jm.cache_info().misses  # noqa: E731
    elif strategy == "adaptive":
        target = tn.adaptive(m)
        compiles = lambda: sum(r.compiles for r in target.regions.values())  # noqa: E731
    elif strategy in ("tc-neuron", "tc-cpu"):
        import torch._dynamo.utils as du
        from tn import dynamo_backend
        s0, c0 = dynamo_backend.graphs_compiled(), du.counters["stats"]["unique_graphs"]
        m.forward = torch.compile(m.forward, backend="neuron" if strategy == "tc-neuron" else "inductor")
        compiles = ((lambda: dynamo_backend.graphs_compiled() - s0) if strategy == "tc-neuron"
                    else (lambda: du.counters["stats"]["unique_graphs"] - c0))
    with torch.no_grad(), tn.profile() as prof:
        t0 = time.perf_counter()
        outs = [target.generate(p.to(dev), max_new_tokens=new, do_sample=False, **kw) for p in prompts]
        wall = time.perf_counter() - t0
    bad = sum(0 if torch.equal(o.cpu(), r) else 1 for o, r in zip(outs, refs))
    row = {"wall_s": wall, "device_ms": prof.total_us / 1e3, "compiles": compiles(), "err": bad, "place": dev}
    if strategy == "adaptive":
        row["report"] = target.report(print_table=False)
    return row


def _cold_device() -> None:
    """Empty the neuron device's cache of one-op programs, so no column reuses another's eager programs."""
    try:
        from tn.device import eager
        eager.clear_cache()
    except (ImportError, AttributeError):
        pass


WORKLOADS = {"a": "stable", "b": "random", "c": "phases", "d": "gpt2"}


def main(argv=None) -> int:
    """Run the table; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--scale", type=int, default=1, help="multiply the number of calls/tokens")
    ap.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile columns")
    ap.add_argument("--only", default="a,b,c,d", help="workloads to run, e.g. a,c")
    ap.add_argument("--reports", action="store_true", help="print tn.adaptive_report for every workload")
    ap.add_argument("-v", action="store_true", help="print the traceback of a column that fails")
    args = ap.parse_args(argv)
    strategies = ["eager", "jit", "adaptive"]
    if not args.no_torch_compile:
        strategies += ["tc-neuron", "tc-cpu"]
    results = {}
    for key in args.only.split(","):
        kind = WORKLOADS[key]
        results[kind] = {}
        for s in strategies:
            if s.startswith("tc-"):
                torch._dynamo.reset()  # no graphs reused from an earlier workload
            _cold_device()
            try:
                row = run_gpt2(s, args.scale) if kind == "gpt2" else run_stack(kind, s, args.scale)
            except Exception as e:  # a column that cannot run says why
                row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
                if "-v" in sys.argv:
                    traceback.print_exc()
            results[kind][s] = row
            print(f"  {kind:7s} {s:10s} " + (f"{row['wall_s']:.3f} s  {row['compiles']} compiles  "
                                              f"{row['place']}" if "error" not in row else row["error"]),
                  file=sys.stderr)
    from tabulate import tabulate
    table = []
    for kind, cols in results.items():
        r = {"workload": kind}
        for s, row in cols.items():
            if "error" in row:
                r[f"{s} s"] = "n/a"
                continue
            r[f"{s} s"] = round(row["wall_s"], 3)
            r[f"{s} dev ms"] = round(row["device_ms"], 2)
            r[f"{s} #c"] = row["compiles"]
        e, j, a = (cols.get(s, {}).get("wall_s") for s in ("eager", "jit", "adaptive"))
        if None not in (e, j, a):
            r["adaptive/best"] = round(a / min(e, j), 2)
        r["place"] = cols.get("adaptive", {}).get("place", "?")
        table.append(r)
    print(tabulate(table, headers="keys"))
    for kind, cols in results.items():
        errs = {s: row.get("err", row.get("error")) for s, row in cols.items()}
        print(f"{kind}: max |diff| vs eager (gpt2: differing sequences): {errs}")
        if args.reports and "report" in cols.get("adaptive", {}):
            from tabulate import tabulate as tb
            print(tb(cols["adaptive"]["report"], headers="keys"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
