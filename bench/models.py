# Bench: small models side by side — torch eager CPU, tn.jit on the software NeuronCore (host time + modelled device numbers), torch.compile.
"""Model-level benchmark of tn.jit against torch eager and torch.compile.

Usage::

    python bench/models.py [--json PATH] [--repeats N] [--only NAME[,NAME...]] [--no-compile]

One table, every workload measured in the same process with one CPU thread
(``torch.set_num_threads(1)``), repeats interleaved (eager, tn.jit,
torch.compile, eager, ...) so machine noise hits every column alike; times
are ``min / median`` over the repeats.

Columns:

* ``eager ms``: torch eager on the CPU.
* ``tn host ms``: a steady ``tn.jit`` call (backend ``neuron``): the host wall
  time of simulating the NeuronCore program(s) plus binding and host fallbacks.
* ``tn 1st call s``: the first ``tn.jit`` call (trace, passes, compile, one run).
* ``device us``: modelled NeuronCore time of one call (trn2 by default), end to end (every program of the
  call, every engine, DMA included): min / median over profiled calls (the model is deterministic, so the two
  agree unless something changed between calls).
* ``MFU %`` (headline): end-to-end model FLOPs utilisation = matmul FLOPs / (TensorE bf16 peak x modelled
  device time of the call, median). Idle TensorE counts against it.
* ``of roofline`` (headline): roofline time / modelled device time (median), where ``roofline us`` =
  max(HBM bytes / HBM bandwidth, matmul FLOPs / bf16 peak) is the least time any schedule of this program's
  traffic and math could take. With batch 64 the MLP's weights (12.6 MB bf16) must stream from HBM every
  call, so its end-to-end MFU cannot exceed the ``MFU ceiling %`` (MFU at the roofline time, ~29% on trn2)
  however good the schedule; ``of roofline`` = MFU / MFU ceiling.
  The device verdicts are checked against this number.
* ``HBM MB``: HBM bytes read + written by the programs.
* ``host ops``: equations that ran on the host (no lowering): should be 0.
* ``max err`` / ``ok``: max |tn - eager CPU| over the outputs of the first call, the steady timed calls and the
  profiled calls, and whether it is within tolerance (max err <= tol x max(1, max |eager|), tol 1e-4 for fp32
  workloads, 2e-2 for bf16). Every verdict fails on a wrong answer.
* ``TensorE busy-eff %`` (secondary): matmul FLOPs / (TensorE bf16 peak x TensorE *busy* time): how well the
  matmul instructions use the 128x128 array while TensorE works (transposes on TensorE count as busy, zero
  FLOPs). It ignores idle TensorE (a full-tile matmul scores ~100% however idle TensorE is), so it is not a
  utilisation verdict; it says whether the matmul tiles are shaped well.
* ``compile 1st s`` / ``compile ms``: torch.compile (inductor) first call and steady calls.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tn  # noqa: E402
import tn.lower  # noqa: E402,F401  (registers the neuron backend)

try:
    from tabulate import tabulate
except ImportError:  # pragma: no cover
    tabulate = None


# --------------------------------------------------------------------------- workloads


class ElementwiseChain(torch.nn.Module):
    """Eight elementwise ops on one tensor."""

    def forward(self, x):
        """The chain."""
        y = torch.relu(x * 1.5 + 0.25)
        y = torch.tanh(y - torch.sigmoid(x))
        return y * x + 1.0


class MLP(torch.nn.Module):
    """512 -> 2048 -> 2048 -> 512 with GELU."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(512, 2048)
        self.fc2 = torch.nn.Linear(2048, 2048)
        self.fc3 = torch.nn.Linear(2048, 512)

    def forward(self, x):
        """Three Linear layers."""
        x = torch.nn.functional.gelu(self.fc1(x))
        x = torch.nn.functional.gelu(self.fc2(x))
        return self.fc3(x)


class Attention(torch.nn.Module):
    """softmax(q k^T / sqrt(d)) v."""

    def forward(self, q, k, v):
        """Attention of q over k, v."""
        s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        return torch.softmax(s, dim=-1) @ v


class GPT2Block(torch.nn.Module):
    """A GPT-2 transformer block: LayerNorm, fused qkv, causal attention, MLP 4x, residuals."""

    def __init__(self, d=768, heads=12):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        """Pre-norm attention then MLP, with residuals."""
        B, T, C = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, h, C // h).transpose(1, 2)
        k = k.view(B, T, h, C // h).transpose(1, 2)
        v = v.view(B, T, h, C // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * ((C // h) ** -0.5)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def loop50(x):
    """50 small ops in a Python loop (dispatch overhead dominates)."""
    for _ in range(25):
        x = torch.tanh(x * 1.1)
    return x


def workloads():
    """(name, callable, inputs) of every workload."""
    g = torch.Generator().manual_seed(0)

    def rn(*s, dtype=torch.float32):
        """Seeded normal tensor."""
        return torch.randn(*s, generator=g).to(dtype)

    torch.manual_seed(0)
    mlp = MLP().eval()
    gpt = GPT2Block().eval()
    mlp16 = MLP().eval().to(torch.bfloat16)
    gpt16 = GPT2Block().eval().to(torch.bfloat16)
    return [
        ("elementwise 1024x1024", ElementwiseChain(), (rn(1024, 1024),)),
        ("MLP b64 fp32", mlp, (rn(64, 512),)),
        ("MLP b64 bf16", mlp16, (rn(64, 512, dtype=torch.bfloat16),)),
        ("attention 8h s128 d64", Attention(), (rn(1, 8, 128, 64), rn(1, 8, 128, 64), rn(1, 8, 128, 64))),
        ("GPT-2 block fp32", gpt, (rn(1, 128, 768),)),
        ("GPT-2 block bf16", gpt16, (rn(1, 128, 768, dtype=torch.bfloat16),)),
        ("50-op loop 16x16", loop50, (rn(16, 16),)),
    ]


# --------------------------------------------------------------------------- measurement


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _stats(xs):
    return (min(xs), statistics.median(xs)) if xs else (float("nan"), float("nan"))


def _entry_exe(f):
    """The NeuronExecutable of the most recent compiled signature of a tn.jit object (for host-op counts)."""
    core = getattr(f, "_tn_core", None) or getattr(f, "_core", None)
    try:
        return list(core.cache.values())[-1].run
    except Exception:
        return None


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max err <= tol x max(1, max |eager|)


def _outs(y):
    """The output tensors of a call (a tensor or a tuple/list of them)."""
    return list(y) if isinstance(y, (tuple, list)) else [y]


def _err(out, ref):
    """Max |out - ref| over the outputs."""
    return max(float((o.float() - r.float()).abs().max()) for o, r in zip(_outs(out), _outs(ref)))


def _tol(ref):
    """The error bound of a workload's outputs (by the dtype of its outputs)."""
    refs = _outs(ref)
    tol = max(TOL.get(r.dtype, 2e-2) for r in refs)
    return tol * max(1.0, max(float(r.float().abs().max()) for r in refs))


def measure(name, fn, inputs, repeats, use_compile):
    """One row of the table."""
    row = {"workload": name}
    f = tn.jit(fn, backend="neuron")
    with torch.no_grad():
        ref = fn(*inputs)
        t_first, out = _timed(f, *inputs)
        errs = [_err(out, ref)]
        row["tn_first_s"] = t_first
        exe = _entry_exe(f)
        stats = getattr(exe, "stats", {}) or {}
        row["host_ops"] = sum(stats.get("host_ops", {}).values()) if stats else None
        row["host_op_names"] = sorted(stats.get("host_ops", {})) if stats else []
        dev_ns, runs = [], []
        for _ in range(max(1, min(repeats, 3))):  # modelled time per call: deterministic, checked by min vs median
            with tn.profile() as prof:
                errs.append(_err(f(*inputs), ref))
            runs = prof.runs
            dev_ns.append(sum(r.total_ns for r in runs))
        total_ns = statistics.median(dev_ns)
        flops = sum(r.matmul_flops for r in runs)
        peak = runs[0].arch.peak_flops_bf16 if runs else 1.0
        row["device_us"] = [x / 1e3 for x in _stats(dev_ns)]
        row["matmul_gflop"] = flops / 1e9
        row["mfu_pct"] = list(_stats([100.0 * flops / (peak * x * 1e-9) if x else 0.0 for x in dev_ns]))
        te_busy = sum(r.busy_ns.get("TensorE", 0.0) for r in runs)
        row["tensore_busy_pct"] = 100.0 * te_busy / total_ns if total_ns else 0.0
        row["tensore_busy_eff_pct"] = 100.0 * flops / (peak * te_busy * 1e-9) if te_busy else 0.0
        hbm_bytes = sum(r.hbm_read_bytes + r.hbm_write_bytes for r in runs)
        row["hbm_mb"] = hbm_bytes / 1e6
        bw = runs[0].arch.hbm_bytes_per_s if runs else 1.0
        row["roofline_us"] = max(hbm_bytes / bw, flops / peak) * 1e6
        row["mfu_ceiling_pct"] = 100.0 * flops / (peak * row["roofline_us"] * 1e-6) if row["roofline_us"] else 0.0
        row["of_roofline_pct"] = list(_stats([100.0 * row["roofline_us"] * 1e3 / x if x else 0.0 for x in dev_ns]))
        row["programs"] = len(runs)
        comp = None
        if use_compile:
            try:
                torch._dynamo.reset()
                comp = torch.compile(fn)
                t_c, _ = _timed(comp, *inputs)
                row["compile_first_s"] = t_c
            except Exception as e:  # inductor unavailable (no C++ compiler ...)
                row["compile_first_s"] = None
                row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                comp = None
        te, tt, tc = [], [], []
        for _ in range(repeats):
            te.append(_timed(fn, *inputs)[0])
            t, out = _timed(f, *inputs)
            tt.append(t)
            errs.append(_err(out, ref))
            if comp is not None:
                tc.append(_timed(comp, *inputs)[0])
        row["eager_ms"] = [x * 1e3 for x in _stats(te)]
        row["tn_host_ms"] = [x * 1e3 for x in _stats(tt)]
        row["compile_ms"] = [x * 1e3 for x in _stats(tc)] if tc else None
        row["max_err"] = max(errs)
        row["tol"] = _tol(ref)
        row["ok"] = row["max_err"] <= row["tol"]  # NaN fails too
    return row


def _fmt_pair(p, digits=2):
    if p is None:
        return "n/a"
    return f"{p[0]:.{digits}f} / {p[1]:.{digits}f}"


def table(rows):
    """The printed table (tabulate if available): headline columns first, busy-time efficiency last."""
    headers = ["workload", "eager ms", "tn host ms", "tn/eager", "tn 1st call s", "device us", "MFU %",
               "of roofline", "MFU ceiling %", "roofline us", "HBM MB", "host ops", "max err", "ok",
               "compile 1st s", "compile ms", "TensorE busy-eff %"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["workload"], "failed: " + r["error"]] + [""] * (len(headers) - 2))
            continue
        ratio = r["tn_host_ms"][1] / r["eager_ms"][1] if r["eager_ms"][1] else float("nan")
        body.append([
            r["workload"], _fmt_pair(r["eager_ms"], 3), _fmt_pair(r["tn_host_ms"], 2), f"{ratio:.1f}x",
            f"{r['tn_first_s']:.2f}", _fmt_pair(r["device_us"], 1), f"{r['mfu_pct'][1]:.1f}",
            f"{r['of_roofline_pct'][1]:.0f}%", f"{r['mfu_ceiling_pct']:.1f}" if r["matmul_gflop"] else "-",
            f"{r['roofline_us']:.1f}", f"{r['hbm_mb']:.2f}",
            r["host_ops"] if r["host_ops"] is not None else "?", f"{r['max_err']:.2e}",
            "ok" if r["ok"] else "WRONG",
            "n/a" if r.get("compile_first_s") is None else f"{r['compile_first_s']:.2f}",
            _fmt_pair(r.get("compile_ms"), 3),
            f"{r['tensore_busy_eff_pct']:.1f}" if r["tensore_busy_eff_pct"] else "-",
        ])
    if tabulate is not None:
        return tabulate(body, headers=headers, stralign="right")
    return "\n".join([" | ".join(headers)] + [" | ".join(str(c) for c in b) for b in body])


ROOFLINE_GOAL = 70.0  # % of the HBM/compute roofline, end to end (the 70% utilisation goal, reachable)


def goals(rows):
    """Verdict lines for the bench goals, from the rows that were run.

    Host-time goals judge the ratio of medians and print the ratio of minima too; device goals judge the
    end-to-end fraction of roofline of the median modelled call (MFU / MFU ceiling) and print min and median
    over the profiled calls. Every verdict fails when the workload's answer is wrong (``ok``), when it ran
    ops on the host, or when the workload failed to run.
    """
    by = {r["workload"]: r for r in rows}
    out = []

    def broken(r):
        """Why a row cannot pass whatever its numbers ('' when it can)."""
        if "error" in r:
            return f"workload failed: {r['error']}"
        why = []
        if not r["ok"]:
            why.append(f"WRONG answer: max err {r['max_err']:.2e} > tol {r['tol']:.2e} vs eager CPU")
        if r["host_ops"]:
            why.append(f"{r['host_ops']} ops ran on the host")
        return "; ".join(why)

    def check(r):
        """' answer ok' or the reason the verdict fails."""
        return "answer ok" if r["ok"] else "answer WRONG"

    for name, limit, what in (("GPT-2 block fp32", 3.0, "<= 3x"), ("GPT-2 block bf16", 3.0, "<= 3x"),
                              ("50-op loop 16x16", 1.0, "< 1x (faster than)")):
        r = by.get(name)
        if r is None:
            continue
        bad = broken(r)
        if "error" in r:
            out.append(f"goal  {name}: tn host {what} eager: NOT met ({bad})")
            continue
        x_min = r["tn_host_ms"][0] / r["eager_ms"][0]
        x_med = r["tn_host_ms"][1] / r["eager_ms"][1]
        fast = x_med < limit if limit == 1.0 else x_med <= limit
        met = fast and r["ok"]
        out.append(f"goal  {name}: tn host {what} eager (median): {x_med:.2f}x (min {x_min:.2f}x), "
                   f"{check(r)}  {'met' if met else 'NOT met'}" + (f" ({bad})" if not r["ok"] else ""))
    for name in ("MLP b64 bf16", "GPT-2 block bf16"):
        r = by.get(name)
        if r is None:
            continue
        bad = broken(r)
        if "error" in r:
            out.append(f"goal  {name}: end-to-end >= {ROOFLINE_GOAL:.0f}% of roofline: NOT met ({bad})")
            continue
        lo, med = r["of_roofline_pct"]
        met = med >= ROOFLINE_GOAL and not bad
        out.append(f"goal  {name}: end-to-end >= {ROOFLINE_GOAL:.0f}% of the HBM/compute roofline: "
                   f"{med:.0f}% (min {lo:.0f}%; MFU {r['mfu_pct'][1]:.1f}% median, {r['mfu_pct'][0]:.1f}% min, "
                   f"of a {r['mfu_ceiling_pct']:.1f}% ceiling; device {r['device_us'][1]:.1f} us median, "
                   f"{r['device_us'][0]:.1f} us min), {check(r)}  {'met' if met else 'NOT met'}"
                   + (f" ({bad})" if bad else "")
                   + f"  [TensorE busy-time efficiency {r['tensore_busy_eff_pct']:.1f}%, not a verdict]")
    wrong = [r["workload"] for r in rows if "error" not in r and not r["ok"]]
    failed = [r["workload"] for r in rows if "error" in r]
    out.append("check every workload's answer vs eager CPU: " + (
        "met" if not wrong and not failed else
        "NOT met (" + "; ".join(filter(None, [("wrong: " + ", ".join(wrong)) if wrong else "",
                                              ("failed: " + ", ".join(failed)) if failed else ""])) + ")"))
    return out


def main(argv=None):
    """Run the benchmark and print the table (optionally write JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows as JSON to this path")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per workload (default 5)")
    ap.add_argument("--only", help="comma-separated substrings of workload names to run")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name, fn, inputs in workloads():
        if args.only and not any(s.strip().lower() in name.lower() for s in args.only.split(",")):
            continue
        print(f"... {name}", file=sys.stderr, flush=True)
        try:
            rows.append(measure(name, fn, inputs, args.repeats, not args.no_compile))
        except Exception as e:  # one broken workload must not hide the others
            rows.append({"workload": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
    print(f"threads: {torch.get_num_threads()}; times are min / median of {args.repeats} interleaved repeats; "
          f"device numbers modelled on trn2")
    print(table(rows))
    for r in rows:
        if r.get("host_op_names"):
            print(f"  {r['workload']}: host fallbacks for {', '.join(r['host_op_names'])}")
        if r.get("compile_error"):
            print(f"  {r['workload']}: torch.compile failed: {r['compile_error']}")
    for line in goals(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
