# OpInfo conformance bench: every float32 OpInfo of torch's op_db through tn.jit, compared with eager PyTorch.
"""Run torch's OpInfo database through ``tn.jit`` and compare with eager.

Usage::

    python bench/coverage.py --mode jit --backend reference [--json PATH] [--ops a,b] [--limit N] [--allow-host]

For every OpInfo in ``torch.testing._internal.common_methods_invocations.op_db``
that supports float32 on CPU, each sample from
``sample_inputs("cpu", torch.float32, requires_grad=False)`` is run eagerly and
through ``tn.jit(f, backend=...)``, where ``f`` takes the sample's tensors as
arguments (non-tensor arguments are closed over). Tensor leaves of the results
are compared with ``torch.testing.assert_close`` (float32: rtol 1e-5,
atol 1e-5; integers and bools exactly; NaNs equal).

An op **passes** only when every sample matches. An op tn refuses with a
clear error (:class:`tn.UnsupportedOpError`, :class:`tn.TracingError`) is
**skipped** with that reason, never passed. Backends other than
``reference`` run in strict mode (``TN_STRICT=1``): an equation the
NeuronCore compiler would run on the host is a refusal, so an op passes on
``neuron`` only when it runs natively (``--allow-host`` counts host
fallbacks as passes instead). A mismatch, or any other exception,
makes it **failed** with the reason. Every op is isolated: whatever it raises
is caught and recorded. Samples that eager PyTorch itself rejects are ignored.
A sample whose eager result changes with the random seed (random ops,
uninitialised memory) is compared by shapes and dtypes only; such ops are
counted as ``passed_random`` as well.

Prints a summary table and the most common reasons (tabulate) and, with
``--json``, writes ``{total, passed, failed, skipped, ops: [{name, variant,
status, reason, samples}]}``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import warnings
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

#: Tolerances per dtype of a result tensor (float32 is what the bench runs).
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.complex64: dict(rtol=1e-5, atol=1e-5),
}

#: Per-op float32 tolerances (name or name.variant -> rtol/atol) for ops whose
#: decomposition legitimately changes rounding; add an entry only with a reason.
OP_TOLERANCES: Dict[str, Dict[str, float]] = {
    # one 2-d convolution over depth-stacked channels sums the 64 products of a 4x4x4 kernel (samples in
    # [-9, 9], partial sums ~500, ulp 6e-5) in another order than eager's kernel: both are ~7e-5 from the
    # float64 result at the worst element, 9e-5 from each other where the result cancels to ~1
    "nn.functional.conv3d": dict(rtol=1e-5, atol=2e-4),
    # one transposed 2-d convolution over depth taps, the taps summed along depth afterwards: another order
    # than eager's kernel (samples' results up to ~900, ulp 6e-5); tn ~9e-5 and eager ~1e-4 from float64 at the
    # worst element, up to 1.2e-4 from each other
    "nn.functional.conv_transpose3d": dict(rtol=1e-5, atol=2e-4),
}

#: Ops whose result values are undefined (uninitialised memory): only shapes
#: and dtypes are compared.
UNDEFINED_VALUES = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                    "empty_permuted"}

SEED = 1234


class OpTimeout(BaseException):
    """A sample took longer than the time limit. A BaseException, so no
    ``except Exception`` in eager code or in tn turns it into another error."""


def op_key(info: Any) -> str:
    """``name`` or ``name.variant`` of an OpInfo, as ``--ops`` takes it."""
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def float32_ops(names: Optional[Sequence[str]] = None) -> List[Any]:
    """OpInfos of op_db that support float32 on CPU (optionally only ``names``:
    matched against ``name`` and ``name.variant``)."""
    from torch.testing._internal.common_methods_invocations import op_db

    wanted = set(names) if names else None
    out = []
    for info in op_db:
        if wanted is not None and info.name not in wanted and op_key(info) not in wanted:
            continue
        try:
            if torch.float32 not in info.supported_dtypes("cpu"):
                continue
        except Exception:  # an OpInfo without dtype info for cpu: not a float32 op here
            continue
        out.append(info)
    return out


def _clone(x: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _first_line(msg: str, limit: int = 300) -> str:
    line = str(msg).strip().splitlines()[0] if str(msg).strip() else ""
    return line[:limit]


def compare(actual: Any, expected: Any, tol: Optional[Dict[str, float]] = None,
            values: bool = True) -> Optional[str]:
    """None when the tensor leaves of ``actual`` match ``expected`` (only their
    shapes and dtypes when ``values`` is false); otherwise why not."""
    a_leaves = [x for x in pytree.tree_leaves(actual) if isinstance(x, torch.Tensor)]
    e_leaves = [x for x in pytree.tree_leaves(expected) if isinstance(x, torch.Tensor)]
    if len(a_leaves) != len(e_leaves):
        return f"mismatch: {len(a_leaves)} tensor results, eager gives {len(e_leaves)}"
    for j, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if a.shape != e.shape or a.dtype != e.dtype:
            return (f"mismatch: result {j} is {a.dtype}{list(a.shape)}, "
                    f"eager gives {e.dtype}{list(e.shape)}")
        if not values:
            continue
        if e.dtype.is_floating_point or e.dtype.is_complex:
            kw = dict(tol if (tol is not None and e.dtype == torch.float32)
                      else TOLERANCES.get(e.dtype, dict(rtol=0, atol=0)))
        else:
            kw = dict(rtol=0, atol=0)
        try:
            torch.testing.assert_close(a.detach().cpu(), e.detach().cpu(), equal_nan=True,
                                       check_device=False, check_stride=False, **kw)
        except AssertionError as err:
            detail = " ".join(str(err).split())
            return f"mismatch: result {j}: {detail[:240]}"
    return None


def run_sample(jit: Any, info: Any, sample: Any, backend: str, tol: Optional[Dict[str, float]]) -> Optional[str]:
    """Run one sample eagerly and through ``jit``; None if they agree, else the reason.

    Raises ``_EagerRejects`` when eager PyTorch itself fails on the sample, and
    lets tn's and other errors propagate to the caller.
    """
    args = (sample.input, *sample.args)
    kwargs = dict(sample.kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    op = info.op

    def f(*tensors: torch.Tensor) -> Any:
        full = list(leaves)
        for p, t in zip(positions, tensors):
            full[p] = t
        a, k = pytree.tree_unflatten(full, spec)
        return op(*a, **k)

    tensors = [leaves[p] for p in positions]
    try:
        torch.manual_seed(SEED)
        expected = f(*_clone(tensors))
        # A second eager run with another seed tells random (or undefined) results apart.
        torch.manual_seed(SEED + 1)
        random = compare(f(*_clone(tensors)), expected) is not None
    except Exception as err:
        raise _EagerRejects(err) from err
    torch.manual_seed(SEED)
    jf = jit(f, backend=backend)
    jit_args = _clone(tensors)
    actual = jf(*jit_args)
    if not random:
        # A program that draws random numbers cannot replay eager's stream (e.g. an
        # OpInfo that calls torch.manual_seed inside the op runs it at trace time).
        random = _draws_random_numbers(jf, jit_args)
    values = not random and info.name not in UNDEFINED_VALUES
    why = compare(actual, expected, tol, values=values)
    if why is None and not values:
        return _RANDOM
    return why


def _draws_random_numbers(jf: Any, args: Sequence[Any]) -> bool:
    """Whether the program tn.jit built for ``args`` contains a random op."""
    from tn.passes import is_impure

    lower = getattr(jf, "lower", None)
    if lower is None:
        return False
    try:
        ir = lower(*args)
    except Exception:  # no IR to look at: treat the program as deterministic
        return False
    return any(is_impure(e.op) for e in ir.eqns)


class _EagerRejects(Exception):
    pass


#: run_sample's result for a sample whose values eager itself does not
#: reproduce (random or uninitialised): shapes and dtypes matched.
_RANDOM = "random"


def _tn_refusals() -> tuple:
    import tn

    return (tn.UnsupportedOpError, tn.TracingError)


def run_op(info: Any, backend: str = "reference", max_samples: Optional[int] = None,
           timeout: float = 0.0) -> Dict[str, Any]:
    """Run every float32 sample of one OpInfo through tn.jit; return its record
    ``{name, variant, status, reason, samples}`` (status: passed/failed/skipped)."""
    import tn

    refusals = _tn_refusals()
    record: Dict[str, Any] = dict(name=info.name, variant=info.variant_test_name or "", status="passed",
                                  reason="", samples=0, random=False)
    tol = OP_TOLERANCES.get(op_key(info)) or OP_TOLERANCES.get(info.name)
    # The limit is CPU time of this process per sample (ITIMER_PROF), so a busy
    # machine does not turn slow-but-correct ops into failures.
    use_alarm = timeout > 0 and hasattr(signal, "SIGPROF")

    def on_alarm(signum: int, frame: Any) -> None:
        raise OpTimeout(f"timeout: sample {ran} took more than {timeout:g} s of CPU time")

    old = signal.signal(signal.SIGPROF, on_alarm) if use_alarm else None
    ran = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = info.sample_inputs("cpu", torch.float32, requires_grad=False)
            for sample in samples:
                if max_samples is not None and ran >= max_samples:
                    break
                if use_alarm:
                    signal.setitimer(signal.ITIMER_PROF, timeout)
                try:
                    why = run_sample(tn.jit, info, sample, backend, tol)
                except _EagerRejects:
                    continue
                finally:
                    if use_alarm:
                        signal.setitimer(signal.ITIMER_PROF, 0)
                ran += 1
                if why is _RANDOM:
                    record["random"] = True
                    continue
                if why is not None:
                    record.update(status="failed", reason=why)
                    break
    except refusals as err:
        record.update(status="skipped", reason=f"{type(err).__name__}: {_first_line(err)}")
    except OpTimeout as err:
        record.update(status="failed", reason=str(err))
    except Exception as err:  # isolate every op: anything else is a failure with its reason
        record.update(status="failed", reason=f"{type(err).__name__}: {_first_line(err)}")
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, old)
    record["samples"] = ran
    if record["status"] == "passed" and ran == 0:
        record.update(status="skipped", reason="no float32 sample that eager PyTorch accepts")
    return record


def reason_key(reason: str) -> str:
    """A reason with numbers, shapes and quoted values blurred, to group similar ones."""
    r = re.sub(r"(^|: )\S+\.py:\d+: `[^`]*`: ", r"\1", reason)  # the user's file:line and code
    r = re.sub(r"\[[^\]]*\]", "[..]", r)
    r = re.sub(r"\(([^()]*)\)", "(..)", r)
    r = re.sub(r"(?<![A-Za-z_0-9])\d+(\.\d+)?(e[-+]?\d+)?", "N", r)
    r = re.sub(r"'[^']*'", "'..'", r)
    return r[:120]


def summarize(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The JSON report: totals plus the per-op records."""
    counts = Counter(r["status"] for r in records)
    random = sum(1 for r in records if r["status"] == "passed" and r.get("random"))
    return dict(total=len(records), passed=counts["passed"], failed=counts["failed"],
                skipped=counts["skipped"], passed_random=random, ops=records)


def print_report(report: Dict[str, Any], top: int = 15, file: Any = None) -> None:
    """Print the summary table and the most common failure/skip reasons."""
    from tabulate import tabulate

    file = file or sys.stdout
    total = max(report["total"], 1)
    rows = [[s, report[s], f"{100.0 * report[s] / total:.1f}%"] for s in ("passed", "failed", "skipped")]
    rows.append(["total", report["total"], ""])
    if report.get("passed_random"):
        rows.append(["(passed, random: only shapes/dtypes compared)", report["passed_random"], ""])
    print(tabulate(rows, headers=["status", "ops", "share"]), file=file)
    for status in ("failed", "skipped"):
        c = Counter(reason_key(r["reason"]) for r in report["ops"] if r["status"] == status)
        if not c:
            continue
        examples: Dict[str, List[str]] = {}
        for r in report["ops"]:
            if r["status"] == status:
                examples.setdefault(reason_key(r["reason"]), []).append(op_key_from_record(r))
        print(file=file)
        table = [[n, k, ", ".join(examples[k][:4]) + (" ..." if len(examples[k]) > 4 else "")]
                 for k, n in c.most_common(top)]
        print(tabulate(table, headers=["ops", f"most common {status} reasons", "e.g."],
                       maxcolwidths=[None, 70, 40]), file=file)


def op_key_from_record(r: Dict[str, Any]) -> str:
    """``name`` or ``name.variant`` of a record."""
    return f"{r['name']}.{r['variant']}" if r["variant"] else r["name"]


def run(backend: str = "reference", names: Optional[Sequence[str]] = None, limit: Optional[int] = None,
        max_samples: Optional[int] = None, timeout: float = 30.0, verbose: bool = False) -> Dict[str, Any]:
    """Run the bench over op_db (or ``names``) and return the report dict."""
    infos = float32_ops(names)
    if limit is not None:
        infos = infos[:limit]
    records = []
    for info in infos:
        t0 = time.perf_counter()
        rec = run_op(info, backend, max_samples=max_samples, timeout=timeout)
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        records.append(rec)
        if verbose:
            print(f"{op_key_from_record(rec):40s} {rec['status']:8s} {rec['reason'][:100]}", flush=True)
    return summarize(records)


#: Modules that register a jit backend when imported.
BACKEND_MODULES = {"neuron": "tn.lower"}


def ensure_backend(name: str) -> None:
    """Import the module that registers backend ``name`` if it is not registered yet;
    exits with a message naming the registered backends if it still is not."""
    import importlib

    from tn.jit import backends

    if name not in backends() and name in BACKEND_MODULES:
        importlib.import_module(BACKEND_MODULES[name])
    if name not in backends():
        raise SystemExit(f"coverage.py: unknown jit backend {name!r}; registered: {', '.join(backends())}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["jit"], default="jit", help="door to test (jit)")
    parser.add_argument("--backend", default="reference", help="tn.jit backend (default: reference)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    parser.add_argument("--ops", help="comma-separated op names (name or name.variant)")
    parser.add_argument("--limit", type=int, help="run only the first N ops")
    parser.add_argument("--max-samples", type=int, help="at most N samples per op")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="CPU seconds per sample before the op fails (0: no limit)")
    parser.add_argument("--verbose", "-v", action="store_true", help="print one line per op as it runs")
    parser.add_argument("--allow-host", action="store_true",
                        help="let a compiling backend run equations on the host (default: strict, such ops skip)")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    if ns.backend != "reference" and not ns.allow_host:
        os.environ["TN_STRICT"] = "1"     # host fallbacks are refusals (skipped), not passes
    ensure_backend(ns.backend)
    names = [n.strip() for n in ns.ops.split(",") if n.strip()] if ns.ops else None
    report = run(ns.backend, names, ns.limit, ns.max_samples, ns.timeout, ns.verbose)
    report["mode"], report["backend"] = ns.mode, ns.backend
    print_report(report)
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
