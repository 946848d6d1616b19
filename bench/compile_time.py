# Bench: compile time of tn programs (trace + passes, tn.lower.compile_ir, first tn.jit call) with fresh caches.
"""How long does tn take to compile a program, and how does that scale?

Compile time is what a user waits for on a first call, and what the adaptive
controller (``tn.adaptive``) weighs against eager execution, so it should
grow about linearly with the program. One table, one row per program:

* ``zeta bf16``: ``torch.special.zeta`` on bf16 inputs, which decomposes into
  ~350 elementwise equations (a long fusable chain).
* ``special chain bf16``: zeta -> lgamma -> i0 -> erfcx, ~570 equations.
* ``chain+softmax fp32``: 40 x (sin, *, +) into a softmax over [8, 4096] (the rows do not fit one
  row group holding the whole chain).
* ``sin chain x400 bf16``: 400 x (sin, *, +) on bf16 (scaling of a long elementwise program).
* ``gpt2 block``: one Hugging Face ``GPT2Block`` (tiny config, random
  weights, fp32), batch 2 x 64 tokens.
* ``gpt2 4 layers``: a Hugging Face ``GPT2Model`` with 4 layers (the same
  config), token ids in.
* ``encoder 4 layers``: ``nn.TransformerEncoder`` of 4 ``TransformerEncoderLayer``.

Columns (``min / median`` over ``--repeats`` repeats, every repeat with fresh
caches: a new ``tn.jit`` object, the weight layout cache and the tracer's
meta cache cleared):

* ``eqns``: equations of the optimised IR.
* ``trace s``: ``tn.make_ir`` (trace + default passes).
* ``compile s``: ``tn.lower.compile_ir`` of that IR (fusion planning, lowering, program build).
* ``builds``: how many times the compiler built the program list (a failed fused group or
  SBUF hand-off makes it rebuild; 1 is the ideal).
* ``1st call s``: the first call of a fresh ``tn.jit(..., backend="neuron")`` (trace, passes,
  compile, weight layouts, one run): what a user waits for.
* ``device us``: modelled NeuronCore time of one steady call (``tn.profile()``).

Usage: ``python bench/compile_time.py [--repeats N] [--only NAME[,NAME...]] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tn  # noqa: E402
import tn.lower  # noqa: E402  (registers the neuron backend)
import tn.lower.compiler  # noqa: E402
import tn.lower.layout  # noqa: E402

try:
    from tabulate import tabulate
except ImportError:  # pragma: no cover
    tabulate = None


# --------------------------------------------------------------------------- programs


def _zeta(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Hurwitz zeta of bf16 inputs (~350 elementwise equations)."""
    return torch.special.zeta(x, q)


def _special_chain(x: torch.Tensor) -> torch.Tensor:
    """Four special functions in a row (~570 elementwise equations)."""
    s = torch.special
    return s.erfcx(s.i0(torch.lgamma(s.zeta(x.abs() + 1.5, x.abs() + 0.5))))


def _chain_softmax(x: torch.Tensor) -> torch.Tensor:
    """40 x (sin, *, +) into a softmax over rows too long for one row group with the whole chain."""
    for _ in range(40):
        x = torch.sin(x) * 1.01 + 0.1
    return torch.softmax(x, -1)


def _long_chain(x: torch.Tensor) -> torch.Tensor:
    """400 x (sin, *, +) on a bf16 tensor (1200+ elementwise equations)."""
    for _ in range(400):
        x = torch.sin(x) * 1.01 + 0.1
    return x


def _gpt2_config(n_layer: int) -> Any:
    """A tiny GPT-2 configuration (random weights), or None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers.GPT2Config(n_layer=n_layer, n_embd=128, n_head=4, vocab_size=256, n_positions=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _gpt2_block() -> Any:
    """``(module, args)``: one Hugging Face GPT2Block on a [2, 64, 128] hidden state."""
    cfg = _gpt2_config(1)
    if cfg is None:
        return None
    import transformers
    block = transformers.GPT2Model(cfg).eval().h[0]
    return block, (torch.randn(2, 64, 128),)


def _gpt2_stack() -> Any:
    """``(module, args)``: a 4-layer Hugging Face GPT2Model on [2, 64] token ids."""
    cfg = _gpt2_config(4)
    if cfg is None:
        return None
    import transformers
    model = transformers.GPT2Model(cfg).eval()
    return model, (torch.randint(3, 256, (2, 64)),)


def _encoder_stack() -> Any:
    """``(module, args)``: nn.TransformerEncoder, 4 layers, d=128, 4 heads, on [2, 64, 128]."""
    layer = torch.nn.TransformerEncoderLayer(128, 4, dim_feedforward=512, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval()
    return enc, (torch.randn(2, 64, 128),)


def programs() -> Dict[str, Callable[[], Any]]:
    """Name -> builder returning ``(fn or module, args)`` (seeded), or None when unavailable."""
    def zeta():
        x = (torch.rand(64, 256) * 4 + 1.5).bfloat16()
        q = (torch.rand(64, 256) * 3 + 0.5).bfloat16()
        return _zeta, (x, q)

    def chain():
        return _special_chain, ((torch.rand(64, 256) * 3 + 0.2).bfloat16(),)

    def chain_softmax():
        return _chain_softmax, (torch.randn(8, 4096),)

    def long_chain():
        return _long_chain, (torch.randn(64, 256).bfloat16(),)

    return {"zeta bf16": zeta, "special chain bf16": chain, "chain+softmax fp32": chain_softmax,
            "sin chain x400 bf16": long_chain, "gpt2 block": _gpt2_block, "gpt2 4 layers": _gpt2_stack,
            "encoder 4 layers": _encoder_stack}


# --------------------------------------------------------------------------- measuring


class _BuildCounter:
    """Counts ``NeuronExecutable._build`` calls while installed (a context manager)."""

    def __enter__(self) -> "_BuildCounter":
        cls = tn.lower.compiler.NeuronExecutable
        self.orig = cls._build
        self.n = 0
        counter = self

        def counted(exe: Any, host: Any) -> Any:
            counter.n += 1
            return counter.orig(exe, host)

        cls._build = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        tn.lower.compiler.NeuronExecutable._build = self.orig


def _fresh_caches() -> None:
    """Forget what an earlier compile left behind: weight layouts and the tracer's meta cache."""
    tn.lower.layout.clear()
    meta = getattr(tn.trace, "_META_CACHE", None)
    if isinstance(meta, dict):
        meta.clear()


def _stats(xs: List[float]) -> Tuple[float, float]:
    """(min, median)."""
    return min(xs), statistics.median(xs)


def measure(name: str, build: Callable[[], Any], repeats: int) -> Dict[str, Any]:
    """Time trace, compile and first call of one program ``repeats`` times; device time of a steady call."""
    torch.manual_seed(0)
    made = build()
    if made is None:
        return {"name": name, "skipped": "transformers is not installed"}
    fn, args = made
    trace_s, compile_s, first_s = [], [], []
    builds = eqns = 0
    device_us = None
    # grad mode stays on (tn.jit runs programs without autograd anyway): under no_grad, an eval
    # nn.TransformerEncoderLayer takes torch's fused fast path (_transformer_encoder_layer_fwd), which tn
    # does not trace
    for _ in range(repeats):
        _fresh_caches()
        t0 = time.perf_counter()
        ir = tn.make_ir(fn)(*args)
        t1 = time.perf_counter()
        with _BuildCounter() as bc:
            tn.lower.compile_ir(ir)
        t2 = time.perf_counter()
        trace_s.append(t1 - t0)
        compile_s.append(t2 - t1)
        builds, eqns = bc.n, len(ir.eqns)

        _fresh_caches()
        f = tn.jit(fn, backend="neuron")
        t0 = time.perf_counter()
        f(*args)
        first_s.append(time.perf_counter() - t0)
    f(*args)  # steady (laid-out weights once their layout is cached)
    with tn.profile() as prof:
        f(*args)
    device_us = prof.total_us
    return {"name": name, "eqns": eqns, "trace_s": _stats(trace_s), "compile_s": _stats(compile_s),
            "builds": builds, "first_call_s": _stats(first_s), "device_us": device_us}


def _fmt(mm: Tuple[float, float]) -> str:
    """``min / median`` in seconds."""
    return f"{mm[0]:.3f} / {mm[1]:.3f}"


def main(argv: Any = None) -> int:
    """Parse arguments, measure the programs, print the table (and write JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated program names (default: all)")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    progs = programs()
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(progs)
    rows = []
    for name in names:
        if name not in progs:
            raise SystemExit(f"unknown program {name!r}; choose from {', '.join(progs)}")
        r = measure(name, progs[name], a.repeats)
        rows.append(r)
        print(f"# {name}: done", file=sys.stderr, flush=True)
    header = ["program", "eqns", "trace s", "compile s", "builds", "1st call s", "device us"]
    table = []
    for r in rows:
        if "skipped" in r:
            table.append([r["name"], "-", "-", "-", "-", "-", r["skipped"]])
            continue
        table.append([r["name"], r["eqns"], _fmt(r["trace_s"]), _fmt(r["compile_s"]), r["builds"],
                      _fmt(r["first_call_s"]), f"{r['device_us']:.1f}"])
    print(f"compile time, min / median over {a.repeats} repeat(s), fresh caches each (tn {tn.__file__})")
    if tabulate is not None:
        print(tabulate(table, headers=header))
    else:  # pragma: no cover
        print("\t".join(header))
        for row in table:
            print("\t".join(str(c) for c in row))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
