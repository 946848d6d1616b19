# The main demo (`python -m tn.demo`): small models -> printed IR -> tn.jit vs eager PyTorch table; exits 1 on a mismatch.
"""tn's demo: what tn does, in a few seconds.

1. Builds two small models: a 2-layer MLP and a causal self-attention block.
2. Prints the IR ``tn.make_ir`` produces for each (after the default passes).
3. Runs each with ``tn.jit`` on every requested backend and prints a table
   comparing with eager PyTorch: max abs error per output, the tolerance for
   its dtype, ok/FAIL, and timings (first call = trace + compile + run, then a
   cached call, eager for reference).

The exit status is 1 if any comparison fails (CI runs this module).

Extending it: add a :class:`Case` to :func:`cases`, or a column to the table
by appending a ``(header, fn(case, backend, result) -> str)`` pair to
:data:`EXTRA_COLUMNS` (e.g. the NeuronCore's modelled cycles).

The model classes (:class:`MLP`, :class:`CausalSelfAttention`,
:class:`GPT2Block`) are also used by ``bench/jit_overhead.py``.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import tn
from tn.ir import aval_str

__all__ = ["MLP", "CausalSelfAttention", "GPT2Block", "Case", "cases", "run_case", "main",
           "TOLERANCES", "EXTRA_COLUMNS"]

#: Comparison tolerance (rtol, atol) per output dtype.
TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
}

#: Extra table columns: ``(header, fn(case, backend, result_dict) -> str)``.
EXTRA_COLUMNS: List[Tuple[str, Callable[["Case", str, Dict[str, Any]], str]]] = []


class MLP(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, d_in: int = 64, d_hidden: int = 256, d_out: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fc2(gelu(fc1(x)))``."""
        return self.fc2(F.gelu(self.fc1(x)))


class CausalSelfAttention(nn.Module):
    """GPT-2 style multi-head causal self-attention (fused qkv projection, masked softmax)."""

    def __init__(self, d_model: int = 64, n_heads: int = 4, max_seq: int = 128):
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("mask", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention over the sequence dimension of ``x`` ([batch, seq, d_model])."""
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = att.softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class GPT2Block(nn.Module):
    """A GPT-2 transformer block: pre-LayerNorm attention and MLP with residuals."""

    def __init__(self, d_model: int = 768, n_heads: int = 12, max_seq: int = 1024):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_seq)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + attn(ln1(x))`` then ``+ mlp(ln2(.))``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@dataclass
class Case:
    """One demo model: a module and example inputs."""
    name: str
    module: nn.Module
    inputs: Tuple[torch.Tensor, ...]
    show_ir: bool = True
    extra: Dict[str, Any] = field(default_factory=dict)


def cases() -> List[Case]:
    """The demo's models and inputs (seeded, small enough to run in well under a second each)."""
    torch.manual_seed(0)
    mlp = MLP(64, 256, 64).eval()
    attn = CausalSelfAttention(64, 4, 32).eval()
    mlp_bf16 = MLP(64, 256, 64).eval().to(torch.bfloat16)
    return [
        Case("mlp f32", mlp, (torch.randn(8, 64),)),
        Case("causal attention f32", attn, (torch.randn(2, 16, 64),)),
        Case("mlp bf16", mlp_bf16, (torch.randn(8, 64, dtype=torch.bfloat16),), show_ir=False),
    ]


def _time(fn: Callable[[], Any], repeat: int = 20) -> float:
    """Median wall time of ``fn()`` in seconds."""
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def _fmt_time(s: float) -> str:
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def run_case(case: Case, backend: str) -> Dict[str, Any]:
    """Run ``case`` eagerly and with ``tn.jit`` on ``backend``; returns outputs, errors and timings."""
    with torch.no_grad():
        want = case.module(*case.inputs)
        jitted = tn.jit(case.module, backend=backend)
        t0 = time.perf_counter()
        got = jitted(*case.inputs)
        first = time.perf_counter() - t0
        cached = _time(lambda: jitted(*case.inputs))
        eager = _time(lambda: case.module(*case.inputs))
        with tn.profile() as prof:  # one more call, to see what the NeuronCore model did
            jitted(*case.inputs)
    outs = []
    for j, (g, w) in enumerate(zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want))):
        rtol, atol = TOLERANCES.get(w.dtype, TOLERANCES[torch.float32])
        err = (g.float() - w.float()).abs().max().item() if w.numel() else 0.0
        ok = g.shape == w.shape and g.dtype == w.dtype and torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol)
        outs.append(dict(index=j, shape=tuple(w.shape), dtype=w.dtype, err=err, atol=atol, rtol=rtol, ok=ok))
    return dict(outputs=outs, first=first, cached=cached, eager=eager, jitted=jitted, profile=prof)


def _device_time(case: "Case", backend: str, r: Dict[str, Any]) -> str:
    runs = r["profile"].runs
    return f"{r['profile'].total_us:.2f} µs" if runs else "- (host)"


def _tensor_util(case: "Case", backend: str, r: Dict[str, Any]) -> str:
    runs = r["profile"].runs
    busy = sum(run.busy_ns.get("TensorE", 0.0) for run in runs)
    total = sum(run.total_ns for run in runs)
    return f"{busy / total:.0%}" if total else "-"


def _hbm_bytes(case: "Case", backend: str, r: Dict[str, Any]) -> str:
    runs = r["profile"].runs
    return f"{sum(run.hbm_read_bytes + run.hbm_write_bytes for run in runs) / 1024:.1f} KiB" if runs else "-"


EXTRA_COLUMNS += [("modelled device time", _device_time), ("TensorE busy", _tensor_util), ("HBM traffic", _hbm_bytes)]


def main(argv: Sequence[str] | None = None) -> int:
    """Print IRs and the comparison table; return 0 if every output matched eager PyTorch, else 1."""
    from tabulate import tabulate  # lazy: tabulate loads only when a table is printed (keeps import tn fast)

    p = argparse.ArgumentParser(prog="python -m tn.demo", description=__doc__.splitlines()[0])
    p.add_argument("--backend", action="append", help="jit backend(s) to run (default: tn's default backend)")
    p.add_argument("--no-ir", action="store_true", help="do not print the IR listings")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    backends = a.backend or [tn.jit.default_backend()]

    all_cases = cases()
    if not a.no_ir:
        for case in all_cases:
            if not case.show_ir:
                continue
            ir = tn.make_ir(case.module)(*case.inputs)
            ins = ", ".join(aval_str(t.shape, t.dtype) for t in case.inputs)
            print(f"== {case.name}: tn.make_ir({type(case.module).__name__})({ins})  "
                  f"[{len(ir.eqns)} equations; parameters are the leading inputs]")
            print(ir)
            print()

    rows = []
    failed = False
    profiled = None
    for backend in backends:
        for case in all_cases:
            r = run_case(case, backend)
            if case.show_ir:
                profiled = (f"{case.name} [{backend}]", r)
            for o in r["outputs"]:
                failed |= not o["ok"]
                row = [case.name, backend, f"out {o['index']}: {aval_str(o['shape'], o['dtype'])}",
                       f"{o['err']:.2e}", f"{o['atol']:.0e} + {o['rtol']:.0e}·|x|", "ok" if o["ok"] else "FAIL",
                       _fmt_time(r["eager"]), _fmt_time(r["first"]), _fmt_time(r["cached"])]
                row += [fn(case, backend, r) for _, fn in EXTRA_COLUMNS]
                rows.append(row)
    headers = ["model", "backend", "output", "max abs err", "tolerance", "check", "eager", "tn.jit first call",
               "tn.jit cached"] + [h for h, _ in EXTRA_COLUMNS]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    if profiled is not None and profiled[1]["profile"].runs:
        name, r = profiled
        print(f"\nWhere the modelled time goes: {name}, one call on the NeuronCore model (tn.profile())")
        r["profile"].table()
        r["profile"].table(by="opcode")
    if failed:
        print("\nFAIL: tn.jit disagrees with eager PyTorch on at least one output (see the table).", file=sys.stderr)
        return 1
    print("\nAll outputs match eager PyTorch.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
