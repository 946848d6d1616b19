# Bench: tn.jit first-call latency vs torch.compile (fresh processes), cached-call overhead vs eager and per case, one thread.
"""How much does tn.jit cost on top of the work itself?

Two tables, measured side by side in one run with ``torch.set_num_threads(1)``:

1. First call (trace + compile + run) of ``tn.jit`` vs ``torch.compile`` on
   an MLP (768 -> 3072 -> 768, batch 128) and a GPT-2 block (d=768, 12 heads,
   seq 128). Each first call runs in a fresh subprocess, so it really is the
   first. "first call" times the call alone; "with setup" adds ``import tn``
   + ``tn.jit(m)`` (tn warms its tracer up at import) or ``torch.compile(m)``
   (which imports Dynamo). Model construction is outside both. torch.compile gets an empty
   Inductor/Triton cache directory per process (a cold compile, as on a
   user's first run; ``--warm-compile-cache`` keeps the user's cache).
   Goal: tn ≤ 1/20 of torch.compile (one first call per process, so min = median;
   fails when tn's or torch.compile's answer differs from eager: max |err| > 1e-4 x max(1, max |eager|)).
2. Cached call of a one-op function (``x * 2`` on a 16x16 tensor) for eager,
   ``tn.jit`` and ``torch.compile``: min and median over interleaved repeats
   of a timed loop. Goal: tn.jit ≤ 20 µs above eager, judged on the median of
   tn.jit minus the median of eager (the minimum is printed beside it); fails
   when tn.jit's result (checked before and after the timed loops) is not ``x * 2``.
3. tn.jit's own cost on a cached call, per case and backend: a 2-layer MLP
   module (``tn.jit(module)``: 4 parameters are program inputs), a plain
   function of 2 tensors, and an HF ``GPT2Block`` from a tiny config (random
   weights, 12 parameters/buffers), and the same block called the way a
   ``tn.adaptive`` region calls its program (a dict of parameters, static
   training flags, an args tuple and a kwargs dict). The overhead is timed directly: the
   jitted call with its cached program swapped for a stub that returns the
   program's outputs (cache key, lookup, grad toggling, write-back, result
   assembly: everything but the program). The real call and the bare
   program are timed alongside for context. Min and median over interleaved
   repeats.

Usage: ``python bench/jit_overhead.py [--json PATH] [--repeats N] [--skip-compile]
[--overhead-only] [--backends reference,neuron]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

FIRST_CALL_GOAL = 20.0  # torch.compile first call / tn.jit first call, at least
OVERHEAD_GOAL_US = 20.0  # tn.jit cached call minus eager, at most (medians)
ERR_TOL = 1e-4  # a first call's answer is right when max |err| <= ERR_TOL x max(1, max |eager|)


def _demo_module():
    """tn/demo.py loaded by path, without importing the tn package (its model classes need only torch)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tn", "demo.py")
    spec = importlib.util.spec_from_file_location("_tn_demo_models", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _model(name: str):
    """``(module, input)`` for the first-call table, seeded."""
    demo = _demo_module()
    torch.manual_seed(0)
    if name == "mlp":
        return demo.MLP(768, 3072, 768).eval(), torch.randn(128, 768)
    if name == "gpt2-block":
        return demo.GPT2Block(768, 12, 1024).eval(), torch.randn(1, 128, 768)
    raise SystemExit(f"unknown model {name!r}: use mlp or gpt2-block")


def child_first_call(model: str, impl: str) -> dict:
    """In a fresh process: time setup (``import tn`` + ``tn.jit(m)``, or ``torch.compile(m)``) and the first call."""
    torch.set_num_threads(1)
    m, x = _model(model)
    with torch.no_grad():
        want = m(x)
        t0 = time.perf_counter()
        if impl == "tn":
            import tn
            f = tn.jit(m)
        else:
            f = torch.compile(m)
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = f(x)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        f(x)
        second = time.perf_counter() - t0
    err = (got - want).abs().max().item()
    tol = ERR_TOL * max(1.0, want.abs().max().item())
    return dict(first_s=first, second_s=second, setup_s=setup, max_abs_err=err, tol=tol, ok=bool(err <= tol))


def first_call_table(models, impls, cold: bool = True) -> dict:
    """Run every ``(model, impl)`` first call in its own subprocess."""
    import tempfile
    res: dict = {}
    for model in models:
        for impl in impls:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            tmp = tempfile.TemporaryDirectory(prefix="tn-bench-") if cold else None
            if tmp is not None:
                env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp.name, "inductor")
                env["TRITON_CACHE_DIR"] = os.path.join(tmp.name, "triton")
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, impl],
                               capture_output=True, text=True, env=env)
            if tmp is not None:
                tmp.cleanup()
            if p.returncode != 0:
                raise SystemExit(f"first-call child {model}/{impl} failed:\n{p.stderr[-4000:]}")
            res.setdefault(model, {})[impl] = json.loads(p.stdout.strip().splitlines()[-1])
    return res


def cached_call_table(repeats: int, inner: int, with_compile: bool) -> dict:
    """Interleaved timing of a one-op function: eager, tn.jit, torch.compile."""
    import tn
    torch.set_num_threads(1)

    def one_op(x):
        return x * 2

    x = torch.randn(16, 16)
    impls = {"eager": one_op, "tn.jit": tn.jit(one_op)}
    if with_compile:
        impls["torch.compile"] = torch.compile(one_op)
    ok = {k: True for k in impls}
    for name, f in impls.items():  # warm: compile and cache; a wrong answer is recorded (the verdict fails on it)
        for _ in range(3):
            ok[name] = ok[name] and bool(torch.equal(f(x), x * 2))
    samples = {k: [] for k in impls}
    for _ in range(repeats):
        for name, f in impls.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f(x)
            samples[name].append((time.perf_counter() - t0) / inner * 1e6)
    for name, f in impls.items():  # the cached program still gives the answer after the timed loops
        ok[name] = ok[name] and bool(torch.equal(f(x), x * 2))
    return {k: dict(min_us=min(v), median_us=statistics.median(v), ok=ok[k]) for k, v in samples.items()}


def _overhead_cases():
    """``{name: (build(backend) -> jitted callable, args)}`` for the cached-call overhead table, seeded."""
    import tn
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).eval()

    def fn2(x, y):
        """A plain function of two tensors."""
        return x * y + x

    cases = {
        "mlp module (4 params)": (lambda b: tn.jit(mlp, backend=b), (torch.randn(8, 64),)),
        "fn(x, y)": (lambda b: tn.jit(fn2, backend=b), (torch.randn(8, 64), torch.randn(8, 64))),
    }
    try:
        import transformers
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except ImportError:  # transformers is optional: the GPT-2 row is left out
        return cases
    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=64, vocab_size=128,
                     bos_token_id=0, eos_token_id=0)
    blk = GPT2Block(cfg).eval()
    x = torch.randn(1, 16, 64)
    cases["HF GPT2Block (12 params)"] = (lambda b: tn.jit(blk, backend=b), (x,))

    def region_program(params, flags, args, kwargs):
        """What a tn.adaptive region jits: the block's forward on a parameter dict, flags static."""
        return torch.func.functional_call(blk, params, args, kwargs)

    state = {**dict(blk.named_parameters()), **dict(blk.named_buffers())}
    flags = tuple(m.training for m in blk.modules())
    cases["GPT2Block, region-style call"] = (
        lambda b: tn.jit(region_program, static_argnums=(1,), backend=b),
        (state, flags, (x,), {"attention_mask": None}))
    return cases


def overhead_table(backends, repeats: int, budget_s: float = 0.003) -> dict:
    """tn.jit's cost around the cached program, per case and backend (µs per call, min/median).

    The overhead is measured directly: the jitted call is timed with its
    cached program's ``run`` swapped for a stub returning that program's
    outputs (so everything tn.jit does per call is timed: cache key, lookup,
    grad toggling, write-back, result assembly, and nothing else). For
    context each repeat also times the real jitted call and the bare program
    (``entry.run(tensors)``, grad off). Cases, backends and the three loops
    are interleaved within each repeat; each loop lasts about ``budget_s``.
    """
    torch.set_num_threads(1)
    runs = []
    for bname in backends:
        for cname, (build, args) in _overhead_cases().items():
            f = build(bname)
            f(*args)  # compile; timed calls run in grad mode, as a user's call does by default
            f(*args)
            core = getattr(f, "_core", None) or f._tn_core
            e = core.last_entry
            tensors = core.key_of(args, {})[2]
            with torch.no_grad():
                outs = e.run(tensors)
            real = e.run

            def stub(_tensors, _outs=outs):
                """The cached program's outputs, without running it."""
                return _outs

            def timed(fn, inner):
                """Seconds per call of ``fn()`` over ``inner`` calls."""
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                return (time.perf_counter() - t0) / inner

            def bare(e=e, tensors=tensors, real=real):
                """The cached program alone."""
                with torch.no_grad():
                    return real(tensors)

            call = (lambda f=f, args=args: f(*args))
            n_call = max(5, int(budget_s / max(timed(call, 3), 1e-7)))
            e.run = stub
            n_over = max(5, int(budget_s / max(timed(call, 20), 1e-7)))
            e.run = real
            runs.append((bname, cname, e, stub, real, call, bare, n_over, n_call))
    samples = {(b, c): ([], [], []) for b, c, *_ in runs}
    for _ in range(repeats):
        for b, c, e, stub, real, call, bare, n_over, n_call in runs:
            over, full, prog = samples[(b, c)]
            e.run = stub
            try:
                over.append(timed(call, n_over) * 1e6)
            finally:
                e.run = real
            full.append(timed(call, n_call) * 1e6)
            prog.append(timed(bare, n_call) * 1e6)
    res: dict = {}
    for (b, c), (over, full, prog) in samples.items():
        res.setdefault(b, {})[c] = dict(
            overhead_min_us=min(over), overhead_median_us=statistics.median(over),
            call_min_us=min(full), call_median_us=statistics.median(full),
            run_min_us=min(prog), run_median_us=statistics.median(prog))
    return res


def verdicts(first: dict, cached: dict) -> list:
    """The goal lines: first-call ratio (one sample per process: min = median) and cached-call overhead on medians.

    A verdict fails when an answer is wrong (tn.jit's, or torch.compile's in the first-call ratio).
    """
    out = []
    for model, r in first.items():
        t, c = r["tn"], r.get("torch.compile")
        if c is None:
            continue
        wrong = [n for n, x in (("tn.jit", t), ("torch.compile", c)) if not x.get("ok", False)]
        out.append(f"goal  {model} first call: torch.compile / tn.jit >= {FIRST_CALL_GOAL:.0f}x: {r['ratio']:.0f}x "
                   f"(one first call per fresh process: min = median; with setup {r['ratio_with_setup']:.0f}x), "
                   f"tn max err {t['max_abs_err']:.1e}  {'met' if r['met'] else 'NOT met'}"
                   + (f" (WRONG answer from {', '.join(wrong)})" if wrong else ""))
    c = cached.get("tn.jit")
    if c is not None:
        out.append(f"goal  cached call: tn.jit - eager <= {OVERHEAD_GOAL_US:.0f} µs (median): "
                   f"{c['overhead_median_us']:+.1f} µs (min {c['overhead_min_us']:+.1f} µs; tn.jit median "
                   f"{c['median_us']:.1f}, min {c['min_us']:.1f} µs), answer {'ok' if c['ok'] else 'WRONG'}  "
                   f"{'met' if c['met'] else 'NOT met'}")
    return out


def main(argv=None) -> int:
    """Run both tables, print them (tabulate) and optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    ap.add_argument("--repeats", type=int, default=60, help="interleaved repeats of the cached-call loop")
    ap.add_argument("--inner", type=int, default=300, help="calls per timed loop")
    ap.add_argument("--no-first-call", action="store_true", help="only the cached-call table")
    ap.add_argument("--skip-compile", action="store_true", help="leave torch.compile out (quick check)")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the per-case overhead table (MLP module, fn of 2 tensors, GPT-2 block)")
    ap.add_argument("--backends", default="reference,neuron",
                    help="comma-separated backends of the overhead table (default: reference,neuron)")
    ap.add_argument("--overhead-repeats", type=int, default=40, help="interleaved repeats of the overhead table")
    ap.add_argument("--warm-compile-cache", action="store_true",
                    help="let torch.compile use the user's on-disk Inductor cache (default: a cold, empty one)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "IMPL"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child_first_call(*a.child)))
        return 0

    from tabulate import tabulate
    torch.set_num_threads(1)
    overhead = overhead_table([b for b in a.backends.split(",") if b], a.overhead_repeats)
    rows = [[b, c, f"{r['overhead_min_us']:.1f}", f"{r['overhead_median_us']:.1f}", f"{r['call_min_us']:.1f}",
             f"{r['call_median_us']:.1f}", f"{r['run_min_us']:.1f}", f"{r['run_median_us']:.1f}"]
            for b, cs in overhead.items() for c, r in cs.items()]
    print(f"tn.jit overhead on a cached call (the call with its program stubbed out), µs per call, "
          f"{a.overhead_repeats} interleaved repeats, 1 thread:")
    print(tabulate(rows, headers=["backend", "case", "overhead min", "overhead median", "call min", "call median",
                                  "program min", "program median"], disable_numparse=True))
    if a.overhead_only:
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(dict(overhead=overhead), fh, indent=2)
        return 0
    print()
    impls = ["tn"] + ([] if a.skip_compile else ["torch.compile"])
    first = {} if a.no_first_call else first_call_table(["mlp", "gpt2-block"], impls, cold=not a.warm_compile_cache)
    rows = []
    for model, r in first.items():
        t = r["tn"]
        row = [model, f"{t['first_s'] * 1e3:.0f} ms", f"{(t['setup_s'] + t['first_s']):.2f} s",
               f"{t['second_s'] * 1e3:.1f} ms"]
        if "torch.compile" in r:
            c = r["torch.compile"]
            r["ratio"] = c["first_s"] / t["first_s"]
            r["ratio_with_setup"] = (c["setup_s"] + c["first_s"]) / (t["setup_s"] + t["first_s"])
            r["met"] = r["ratio"] >= FIRST_CALL_GOAL and t.get("ok", False) and c.get("ok", False)
            row += [f"{c['first_s']:.2f} s", f"{(c['setup_s'] + c['first_s']):.2f} s", f"{c['second_s'] * 1e3:.1f} ms",
                    f"{r['ratio']:.0f}x", f"{r['ratio_with_setup']:.0f}x", "met" if r["met"] else "MISSED"]
        row.append(f"{t['max_abs_err']:.1e}" + ("" if t.get("ok", False) else " WRONG"))
        rows.append(row)
    headers = ["model", "tn.jit first call", "tn: import tn + jit + first", "tn.jit 2nd call"]
    if "torch.compile" in impls:
        headers += ["torch.compile first call", "compile: torch.compile() + first", "torch.compile 2nd call",
                    "compile/tn", "with setup", f"goal ≥{FIRST_CALL_GOAL:.0f}x"]
    headers.append("tn max abs err vs eager")
    if first:
        print("First call (trace + compile + run), each in a fresh process, 1 thread"
              + ("" if a.warm_compile_cache else ", torch.compile with a cold Inductor cache") + ":")
        print(tabulate(rows, headers=headers, disable_numparse=True))

    cached = cached_call_table(a.repeats, a.inner, not a.skip_compile)
    eager = cached["eager"]
    rows = []
    for name, c in cached.items():
        over_min = c["min_us"] - eager["min_us"]
        over_med = c["median_us"] - eager["median_us"]
        c["overhead_min_us"], c["overhead_median_us"] = over_min, over_med
        goal = ""
        if name == "tn.jit":
            c["met"] = over_med <= OVERHEAD_GOAL_US and c["ok"]
            goal = "met" if c["met"] else "MISSED"
        rows.append([name, f"{c['min_us']:.1f}", f"{c['median_us']:.1f}", f"{over_min:+.1f}", f"{over_med:+.1f}",
                     "ok" if c["ok"] else "WRONG", goal])
    print()
    print(f"Cached call of a one-op function (x * 2, f32[16,16]), µs per call, {a.repeats} interleaved repeats "
          f"of {a.inner} calls:")
    print(tabulate(rows, headers=["impl", "min", "median", "over eager (min)", "over eager (median)", "answer",
                                  f"goal ≤{OVERHEAD_GOAL_US:.0f} µs (median)"], disable_numparse=True))
    print()
    for line in verdicts(first, cached):
        print(line)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(first_call=first, cached_call=cached, overhead=overhead, goals=dict(
                first_call_ratio=FIRST_CALL_GOAL, cached_overhead_us=OVERHEAD_GOAL_US),
                verdicts=verdicts(first, cached)), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
