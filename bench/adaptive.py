# Bench: tn.adaptive vs neuron eager, always-tn.jit, torch.compile(backend="neuron") and CPU torch.compile on four workloads.
"""Does the adaptive controller pick the better of eager and jit, and beat both on mixed workloads?

Workloads (one thread, seeded, the same inputs for every strategy):

(a) ``stable``: a stack of 4 transformer blocks (LayerNorm, 4-head causal
    self-attention, GELU MLP), the same input shape every call;
(b) ``random``: the same stack, random batch and sequence length every call;
(c) ``phases``: alternating phases of stable shapes and churning shapes;
(d) ``gpt2``: HF GPT-2 (tiny config) greedy ``generate`` with a growing
    sequence (KV cache, the HF default), several prompts.

Strategies: ``eager`` (model and inputs on the ``neuron`` device: every op a
one-op program), ``jit`` (``tn.jit`` of the model, neuron backend; for (d)
the forward jitted with ``use_cache=False``, since tn.jit cannot take HF's
cache object), ``adaptive`` (``tn.adaptive(model)``, defaults),
``tc-neuron`` (``torch.compile(backend="neuron")``) and ``tc-cpu``
(``torch.compile`` with Inductor, CPU tensors).

How it is measured, so that the numbers can be trusted on a shared machine:

* every cell (workload x strategy) of every repeat runs in a fresh
  subprocess (``--inprocess`` runs them in this process instead, with fresh
  wrappers, jit caches, Dynamo state and an empty device program cache), so
  each strategy pays its compiles the way a fresh process does; the
  toolchain (tn's lowering, the device) is warmed on an unrelated op first,
  so one-time imports land on no strategy;
* repeats are interleaved (repeat 1 of every cell, then repeat 2, ...),
  the order of strategies rotating per repeat;
* one torch thread (Inductor compiles in the cell's process too), and the
  subprocesses pinned to one CPU (``--cpu``: ``auto`` picks the idlest CPU
  at start);
* per cell the min and median over the repeats of the wall time and of the
  CPU time (``time.process_time`` plus finished child processes such as
  Inductor's C++ compiler: what the cell itself spent; it does not grow
  when another tenant takes the core, wall time does) are
  reported, and per goal three ratios of adaptive to the better of eager
  and jit: of the minima, of the medians, and the median of per-repeat
  (paired, run back to back) ratios.

A goal is "met" when all three ratios meet it: within 1.1x of
min(eager, jit) on every workload; below 1.0 on (c) and (d). Verdicts are
printed for wall time (the goal as stated) and for CPU time (the same
comparison without the other tenants' noise). A verdict is "NOT met",
whatever the ratios, when any repeat of eager, jit or adaptive gave a wrong
answer (a stack output not ``allclose`` to CPU eager at atol = rtol = 1e-3;
a GPT-2 sequence differing from CPU eager's tokens), failed, or ran on the
CPU instead of the neuron device (the device check failed, so the strategy
silently became a CPU run: a different measurement).

Columns: wall and CPU time min / median (s), modelled NeuronCore time (ms,
from ``tn.profile()``, median), compiles (median); below the table the
largest difference from CPU eager (tokens: differing sequences).

Usage: ``python bench/adaptive.py [--json PATH] [--repeats N] [--scale N] [--only a,b,c,d]
[--no-torch-compile] [--inprocess] [--cpu auto|N|none] [--reports]``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # Inductor compiles in this process: its CPU time counts

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

torch.set_num_threads(1)

D, HEADS, LAYERS = 64, 4, 4
WORKLOADS = {"a": "stable", "b": "random", "c": "phases", "d": "gpt2"}
GOALS = {"stable": 1.1, "random": 1.1, "phases": 1.0, "gpt2": 1.0}  # 1.0: strictly better than both


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


def _cold_device() -> None:
    """Empty the neuron device's cache of one-op programs, so no strategy reuses another's eager programs."""
    try:
        from tn.device import eager
        eager.clear_cache()
    except (ImportError, AttributeError):
        pass


def _warm_toolchain() -> None:
    """Pay tn's one-time costs (imports, native libraries) on an unrelated op, then empty the device cache."""
    import tn
    try:
        x = torch.randn(3, 5)
        tn.jit(lambda a: (a * 2).sum(0), backend="neuron")(x)
        (x.to("neuron") * 3).cpu()
    except Exception:
        pass
    _cold_device()


def neuron_ok(model: nn.Module, sample) -> bool:
    """True when the model runs eagerly on the neuron device and agrees with the CPU."""
    try:
        m = copy.deepcopy(model).to("neuron")
        with torch.no_grad():
            y = m(sample.to("neuron")).cpu()
            return torch.allclose(y, model(sample), atol=1e-3, rtol=1e-3)
    except Exception:
        return False


def _cpu() -> float:
    """CPU seconds of this process and of its finished children (Inductor runs the C++ compiler as a child)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def _counting_inductor():
    """Inductor as a torch.compile backend that counts the graphs it compiles: ``(backend, [count])``."""
    from torch._inductor.compile_fx import compile_fx
    n = [0]

    def inductor(gm, example_inputs):
        n[0] += 1
        return compile_fx(gm, example_inputs)

    return inductor, n


def _adaptive_compiles(f) -> int:
    return sum(r.compiles for r in f.regions.values())


def run_stack(kind: str, strategy: str, scale: int) -> dict:
    """One cell of workloads (a)-(c)."""
    import tn
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
        compiles = lambda: _adaptive_compiles(f)  # noqa: E731
    elif strategy == "tc-neuron":
        from tn import dynamo_backend
        start = dynamo_backend.graphs_compiled()
        f = torch.compile(m, backend="neuron")
        compiles = lambda: dynamo_backend.graphs_compiled() - start  # noqa: E731
    elif strategy == "tc-cpu":
        backend, n_graphs = _counting_inductor()
        f = torch.compile(m, backend=backend)
        compiles = lambda: n_graphs[0]  # noqa: E731
    else:
        f = m
    xs_dev = [x.to(dev) for x in xs]
    _cold_device()
    with torch.no_grad(), tn.profile() as prof:
        t0, c0 = time.perf_counter(), _cpu()
        outs = [f(x) for x in xs_dev]
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    err = max(float((y.cpu() - r).abs().max()) for y, r in zip(outs, refs))
    ok = all(torch.allclose(y.cpu(), r, atol=1e-3, rtol=1e-3) for y, r in zip(outs, refs))
    row = {"wall_s": wall, "cpu_s": cpu, "device_ms": prof.total_us / 1e3, "compiles": compiles(), "err": err,
           "ok": ok, "place": dev}
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
    import tn
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
        compiles = lambda: _adaptive_compiles(target)  # noqa: E731
    elif strategy == "tc-neuron":
        from tn import dynamo_backend
        s0 = dynamo_backend.graphs_compiled()
        m.forward = torch.compile(m.forward, backend="neuron")
        compiles = lambda: dynamo_backend.graphs_compiled() - s0  # noqa: E731
    elif strategy == "tc-cpu":
        backend, n_graphs = _counting_inductor()
        m.forward = torch.compile(m.forward, backend=backend)
        compiles = lambda: n_graphs[0]  # noqa: E731
    ps = [p.to(dev) for p in prompts]
    _cold_device()
    with torch.no_grad(), tn.profile() as prof:
        t0, c0 = time.perf_counter(), _cpu()
        outs = [target.generate(p, max_new_tokens=new, do_sample=False, **kw) for p in ps]
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    bad = sum(0 if torch.equal(o.cpu(), r) else 1 for o, r in zip(outs, refs))
    row = {"wall_s": wall, "cpu_s": cpu, "device_ms": prof.total_us / 1e3, "compiles": compiles(), "err": bad,
           "ok": bad == 0, "place": dev}
    if strategy == "adaptive":
        row["report"] = target.report(print_table=False)
    return row


def run_cell(kind: str, strategy: str, scale: int, verbose: bool = False) -> dict:
    """One measurement of one cell, in this process, from fresh state."""
    import torch._dynamo
    torch._dynamo.reset()  # no graphs reused from an earlier cell
    _warm_toolchain()
    try:
        return run_gpt2(strategy, scale) if kind == "gpt2" else run_stack(kind, strategy, scale)
    except Exception as e:  # a column that cannot run says why
        if verbose:
            traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}


# --------------------------------------------------------------------------- the driver

def _cpu_busy(sample_s: float = 0.5) -> dict:
    """Busy share of each CPU this process may use, over ``sample_s`` seconds (from /proc/stat)."""
    def read():
        out = {}
        with open("/proc/stat") as fh:
            for line in fh:
                if line.startswith("cpu") and line[3].isdigit():
                    f = line.split()
                    vals = [int(x) for x in f[1:]]
                    out[int(f[0][3:])] = (sum(vals), vals[3] + (vals[4] if len(vals) > 4 else 0))
        return out
    try:
        a = read()
        time.sleep(sample_s)
        b = read()
    except OSError:
        return {}
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(a)
    return {c: 1.0 - (b[c][1] - a[c][1]) / max(1, b[c][0] - a[c][0]) for c in a if c in b and c in allowed}


def pick_cpu(arg: str):
    """The CPU to pin the cells to: ``none``, a number, or ``auto`` (the idlest now)."""
    if arg == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    if arg != "auto":
        return int(arg)
    busy = _cpu_busy()
    return min(busy, key=busy.get) if busy else None


def _subprocess_cell(kind: str, strategy: str, scale: int, cpu, verbose: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", f"{kind},{strategy}", "--scale", str(scale)]
    if cpu is not None:
        cmd += ["--cpu", str(cpu)]
    if verbose:
        cmd.append("-v")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", TN_LOG="")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"cell process failed (exit {p.returncode}): {tail[:160]}"}


def _ratios(cols: dict, metric: str = "wall_s") -> dict:
    """Adaptive over the better of eager and jit: of minima, of medians, median of paired per-repeat ratios."""
    walls = {s: [r.get(metric) for r in cols.get(s, [])] for s in ("eager", "jit", "adaptive")}
    if any(not w or any(x is None for x in w) for w in walls.values()):
        return {}
    e, j, a = walls["eager"], walls["jit"], walls["adaptive"]
    paired = [ai / min(ei, ji) for ei, ji, ai in zip(e, j, a)]
    return {"of_min": min(a) / min(min(e), min(j)),
            "of_median": statistics.median(a) / min(statistics.median(e), statistics.median(j)),
            "paired_median": statistics.median(paired), "paired": paired}


def _expected_place(strategy: str) -> str:
    """Where a strategy's cell must run for the measurement to be the one named."""
    return "cpu" if strategy == "tc-cpu" else "neuron"


def problems(cols: dict, strategies=("eager", "jit", "adaptive")) -> list:
    """Why a goal cannot be met whatever the times: wrong answers, failed cells, silent CPU fallbacks."""
    out = []
    for s in strategies:
        rows = cols.get(s, [])
        if not rows:
            out.append(f"{s} did not run")
        failed = [x for x in rows if "error" in x]
        if failed:
            out.append(f"{s} failed in {len(failed)} repeat(s): {failed[0]['error']}")
        ok = [x for x in rows if "error" not in x]
        wrong = [x for x in ok if not x.get("ok", x.get("err", 0) == 0)]
        if wrong:
            out.append(f"{s} WRONG answer in {len(wrong)} repeat(s) (err {max(x['err'] for x in wrong)})")
        moved = [x for x in ok if x.get("place", _expected_place(s)) != _expected_place(s)]
        if moved:
            out.append(f"{s} ran on {moved[0]['place']} instead of {_expected_place(s)} in {len(moved)} repeat(s) "
                       f"(the device check failed)")
    return out


def verdicts(results: dict, metric: str = "wall_s") -> list:
    """One line per goal: met / not met, with the ratios (of wall time, or of ``metric``).

    Fails on a wrong answer, a failed cell or a cell that ran somewhere other than its strategy says
    (``problems``), whatever the ratios.
    """
    lines = []
    what = {"wall_s": "wall", "cpu_s": "cpu"}[metric]
    for kind, cols in results.items():
        bad = problems(cols)
        rt = _ratios(cols, metric)  # {} when a repeat of eager, jit or adaptive failed
        goal = GOALS[kind]
        if not rt:
            lines.append(f"goal {kind} ({what}): NOT met (no ratios: {'; '.join(bad) or 'a column failed'})")
            continue
        vals = (rt["of_min"], rt["of_median"], rt["paired_median"])
        met = all(v < goal for v in vals) if goal == 1.0 else all(v <= goal for v in vals)
        met = met and not bad
        want = "< 1.0 (strictly better than eager and jit)" if goal == 1.0 else f"<= {goal} x min(eager, jit)"
        lines.append(f"goal {kind} ({what}): adaptive/best {want}: {'met' if met else 'NOT met'} "
                     f"(ratio of minima {vals[0]:.2f}, of medians {vals[1]:.2f}, paired median {vals[2]:.2f}; "
                     f"paired per repeat {', '.join(f'{p:.2f}' for p in rt['paired'])})"
                     + (f" [{'; '.join(bad)}]" if bad else ""))
    return lines


def table(results: dict, strategies: list) -> list:
    rows = []
    for kind, cols in results.items():
        r = {"workload": kind}
        for s in strategies:
            ok = [x for x in cols.get(s, []) if "error" not in x]
            if not ok:
                r[f"{s} s"] = "n/a"
                continue
            w = [x["wall_s"] for x in ok]
            c = [x.get("cpu_s", float("nan")) for x in ok]
            r[f"{s} wall min/med"] = f"{min(w):.2f}/{statistics.median(w):.2f}"
            r[f"{s} cpu min/med"] = f"{min(c):.2f}/{statistics.median(c):.2f}"
            r[f"{s} dev ms"] = round(statistics.median(x["device_ms"] for x in ok), 2)
            r[f"{s} #c"] = int(statistics.median(x["compiles"] for x in ok))
        for metric, what in (("wall_s", "wall"), ("cpu_s", "cpu")):
            rt = _ratios(cols, metric)
            if rt:
                r[f"a/best {what} min|med|pair"] = f"{rt['of_min']:.2f}|{rt['of_median']:.2f}|{rt['paired_median']:.2f}"
        rows.append(r)
    return rows


def main(argv=None) -> int:
    """Run the table; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--scale", type=int, default=1, help="multiply the number of calls/tokens")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per cell, interleaved (3)")
    ap.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile columns")
    ap.add_argument("--only", default="a,b,c,d", help="workloads to run, e.g. a,c")
    ap.add_argument("--strategies", default=None, help="comma-separated subset of the strategies")
    ap.add_argument("--inprocess", action="store_true", help="run the cells in this process (fresh state each)")
    ap.add_argument("--cpu", default="auto", help="pin to this CPU: auto (idlest), a number, or none")
    ap.add_argument("--reports", action="store_true", help="print tn.adaptive_report of the last adaptive cells")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # internal: run one cell, print its JSON row
    ap.add_argument("-v", action="store_true", help="print the traceback of a column that fails")
    args = ap.parse_args(argv)
    if args.cell:
        if args.cpu not in ("auto", "none"):
            os.sched_setaffinity(0, {int(args.cpu)})
        import tn  # noqa: F401
        import tn.lower  # noqa: F401  (registers the "neuron" jit backend)
        kind, strategy = args.cell.split(",")
        row = run_cell(kind, strategy, args.scale, args.v)
        print(json.dumps(row, default=str))
        return 0
    strategies = ["eager", "jit", "adaptive"]
    if not args.no_torch_compile:
        strategies += ["tc-neuron", "tc-cpu"]
    if args.strategies:
        strategies = [s for s in args.strategies.split(",") if s]
    cpu = pick_cpu(args.cpu)
    if args.inprocess:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        import tn  # noqa: F401
        import tn.lower  # noqa: F401
    kinds = [WORKLOADS[k] for k in args.only.split(",")]
    print(f"# {args.repeats} repeats, interleaved; {'in process' if args.inprocess else 'one subprocess per cell'}; "
          f"1 torch thread; pinned to CPU {cpu if cpu is not None else '(none)'}; scale {args.scale}", file=sys.stderr)
    results = {k: {s: [] for s in strategies} for k in kinds}
    for rep in range(args.repeats):
        for kind in kinds:
            order = strategies[rep % len(strategies):] + strategies[:rep % len(strategies)]
            for s in order:
                row = (run_cell(kind, s, args.scale, args.v) if args.inprocess
                       else _subprocess_cell(kind, s, args.scale, cpu, args.v))
                row["repeat"] = rep
                results[kind][s].append(row)
                print(f"  [{rep + 1}/{args.repeats}] {kind:7s} {s:10s} " +
                      (f"{row['wall_s']:.3f} s wall  {row['cpu_s']:.3f} s cpu  {row['compiles']} compiles  "
                       f"{row['place']}"
                       if "error" not in row else row["error"]), file=sys.stderr)
    from tabulate import tabulate
    print(tabulate(table(results, strategies), headers="keys"))
    for kind, cols in results.items():
        errs = {s: max((x.get("err", 0) for x in rows if "error" not in x), default="n/a") for s, rows in cols.items()}
        print(f"{kind}: max |diff| vs CPU eager (gpt2: differing sequences): {errs}")
        bad = problems(cols, strategies)
        print(f"{kind}: answers and placement of every column: " + ("ok" if not bad else "; ".join(bad)))
    for line in verdicts(results) + verdicts(results, "cpu_s"):
        print(line)
    if args.reports:
        for kind, cols in results.items():
            rows = [x for x in cols.get("adaptive", []) if "report" in x]
            if rows:
                print(f"\n{kind}: tn.adaptive_report (last repeat)")
                print(tabulate(rows[-1]["report"], headers="keys", maxcolwidths=[None] * 11 + [100]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "verdicts": verdicts(results) + verdicts(results, "cpu_s"), "cpu": cpu,
                       "repeats": args.repeats,
                       "inprocess": args.inprocess, "scale": args.scale}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
