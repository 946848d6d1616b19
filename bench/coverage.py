# Conformance bench: PyTorch's OpInfo and ModuleInfo databases through every tn door, compared with eager PyTorch.
"""Run torch's op database (``op_db``) and module database (``module_db``)
through one of tn's doors and compare every result with eager PyTorch on the CPU.

Usage::

    python bench/coverage.py --mode eager|jit|compile|adaptive [--grad] [--dtype float32|bfloat16]
                             [--modules] [--ops a,b] [--max-samples N] [--workers N] [--json PATH]
                             [--crash-only]
    python bench/coverage.py --markdown bench/results/coverage-*.json     # the table of these runs
    python bench/coverage.py --markdown bench/results/coverage-*.json --publish bench/results/coverage.md
    python bench/coverage.py --rank-host bench/results/coverage-*.json    # host ops by items they block

Doors (``--mode``):

* ``eager``: the sample's tensors moved to the ``neuron`` device, the op called there,
* ``jit``: ``tn.jit(f, backend=--backend)`` (default ``neuron``), ``f`` taking the sample's tensors,
* ``compile``: ``torch.compile(f, backend="neuron")`` (a Dynamo graph break means the case did not pass
  through the door: an error),
* ``adaptive``: ``tn.adaptive`` over a module calling ``f``, costs injected so the region compiles.

``--grad`` also compares the gradients of ``sum(out * w)`` (``w`` fixed random weights per result) with
respect to every floating input (for modules: parameters and inputs); in ``jit`` mode the gradient is
computed inside the jitted function (``torch.autograd.grad``), elsewhere by autograd through the door.

Every op (or module) is one *item*; its samples are run by a pool of worker processes (``--workers``).
A worker that dies (SIGSEGV, abort) is replaced and its item counted as a **crash** (with the signal and
the sample it was running); the run goes on. Statuses, worst sample first:

* ``crash``: the process died,
* ``fail``: a wrong answer (values, shape or dtype differ from eager PyTorch),
* ``error``: tn raised (refusals such as data-dependent control flow under ``tn.jit`` included, with
  their reason), or a timeout,
* ``refused``: a refusal by design of the compile door: Dynamo breaks the graph at Python control flow on
  a tensor's values (``if torch.any(var < 0)``) or at a Python number taken from one that an op's schema
  needs as a constant (``1.0 / float(num_batches_tracked)`` as BatchNorm's momentum), which no backend can
  take into a graph. The reason says so and gives Dynamo's own words, found by running the case again with
  ``fullgraph=True`` (the break under the bench's ``functional_call`` hides them). Not a pass,
* ``pass_host``: right answers, but part of the work ran on the host (device fallbacks, host equations
  of a compiled program; counted through ``tn.profile``),
* ``pass``: right answers, everything ran as NeuronCore programs,
* ``skip``: no sample eager PyTorch accepts in that dtype,
* ``excluded``: random or nondeterministic results (two eager runs with different seeds differ, or the
  values are uninitialised memory); the reason is recorded.

Comparison: ``torch.testing.assert_close`` with per-dtype tolerances (:data:`TOLERANCES`, NaNs equal,
integers exact). A ``bfloat16`` run feeds the door bf16 inputs and compares its results with an fp32
computation on the same (bf16-valued) inputs, at bf16 tolerances: a CPU bf16 kernel is not the oracle
(the result's dtype and shape still come from eager bf16). Where the fp32 value is off by more than the bf16
tolerance, a result within that tolerance widened by twice eager bf16's own error passes (eager's error
measured by its kernels and again with ``_log_softmax``, which eager rounds twice, rounded once as the doors
do: :func:`_rounded_eager`). Gradient weights of a bf16 result are bf16 values (the backward gets them in
bf16 on every side), and sort/topk gradients may put the same weights on other equal keys (``stable=False``).

``--crash-only`` runs every sample without comparing (a sweep for crashes). Prints a table per status
and the most common reasons (tabulate); ``--json`` writes the same as
``{mode, grad, dtype, kind, totals: {status: n}, items: [{name, status, reason, samples, ...}]}``.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

STATUSES = ("pass", "pass_host", "fail", "error", "refused", "crash", "skip", "excluded")
#: worse first: an item's status is the worst of its samples'
_RANK = {"crash": 0, "fail": 1, "error": 2, "refused": 3, "pass_host": 4, "pass": 5}

#: How a door's reason starts when the case is a refusal by design (status ``refused``).
REFUSED = "refused by design: "

#: Dynamo's words for a guard on a value only the run knows (a Python branch or a Python number taken from a
#: tensor's values), which it cannot put into a graph whatever the backend.
_DATA_DEPENDENT = ("Could not guard on data-dependent expression", "Data-dependent branching",
                   "data dependent operator", "Data-dependent jump")

#: Tolerances per dtype of a compared tensor. bf16 is compared against an fp32 computation on the same
#: inputs (one bf16 rounding of the result: 2^-8 relative, plus a little for cancellation).
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3),
    torch.float16: dict(rtol=1e-3, atol=1e-4),
    torch.complex64: dict(rtol=1e-5, atol=1e-5),
}
#: Gradients go through more operations than the forward; fp32 gets a little more room.
GRAD_TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.complex64: dict(rtol=1e-4, atol=1e-5)}

#: Per-op float32 tolerances (name or name.variant -> rtol/atol; results and gradients) for ops whose
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
    # a layer norm over one element: x - mean is exactly 0, so the weight's gradient sum(g * xhat) is exactly 0
    # on the device; eager's CPU kernel leaves rounding noise of 1.8e-5 there (and rtol cannot help at 0)
    "nn.functional.layer_norm": dict(rtol=1e-4, atol=3e-5),
    "native_layer_norm": dict(rtol=1e-4, atol=3e-5),   # the same one-element sample
    # forward/back substitution unrolled over the columns (tn.ops.linalg) sums in another order than LAPACK's
    # trsm: the gradient of the 5th sample has an element where terms of ~-86, -1834 and +1919 cancel to 0.72
    # (ulp of the partial sums 1.2e-4); eager's fp32 value is itself 5e-5 from float64 there, tn's 1.0e-4
    # from eager's: two ulps of the partial sums
    "triangular_solve": dict(rtol=1e-4, atol=2.5e-4),
}

#: Ops whose result values are undefined (uninitialised memory): excluded.
UNDEFINED_VALUES = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}

SEED = 1234
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


class OpTimeout(BaseException):
    """A sample took longer than the time limit. A BaseException, so no ``except Exception`` in eager code
    or in tn turns it into another error."""


class _EagerRejects(Exception):
    """Eager PyTorch itself fails on the sample: it is not counted."""


class _Random(Exception):
    """Eager's results change with the seed."""


# --------------------------------------------------------------------------- items and cases

def op_key(info: Any) -> str:
    """``name`` or ``name.variant`` of an OpInfo, as ``--ops`` takes it."""
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def opinfos(dtype: torch.dtype = torch.float32, names: Optional[Sequence[str]] = None) -> List[Any]:
    """OpInfos of op_db that support ``dtype`` on CPU (optionally only ``names``: ``name`` or ``name.variant``)."""
    from torch.testing._internal.common_methods_invocations import op_db

    wanted = set(names) if names else None
    out = []
    for info in op_db:
        if wanted is not None and info.name not in wanted and op_key(info) not in wanted:
            continue
        try:
            if dtype not in info.supported_dtypes("cpu"):
                continue
        except Exception:  # an OpInfo without dtype info for cpu
            continue
        out.append(info)
    return out


def float32_ops(names: Optional[Sequence[str]] = None) -> List[Any]:
    """OpInfos of op_db that support float32 on CPU."""
    return opinfos(torch.float32, names)


def module_key(info: Any, training: bool) -> str:
    """``nn.Linear/train`` or ``nn.Linear/eval``."""
    return f"{info.name}/{'train' if training else 'eval'}"


def moduleinfos(dtype: torch.dtype = torch.float32, names: Optional[Sequence[str]] = None) -> List[Tuple[Any, bool]]:
    """(ModuleInfo, training) pairs of module_db supporting ``dtype`` (train and eval when they differ)."""
    from torch.testing._internal.common_modules import module_db

    out = []
    for info in module_db:
        try:
            if dtype not in info.supported_dtypes("cpu"):
                continue
        except Exception:
            continue
        for training in ((True, False) if info.train_and_eval_differ else (True,)):
            if names and info.name not in names and module_key(info, training) not in names:
                continue
            out.append((info, training))
    return out


class Case:
    """One sample: ``fn(*tensors)`` computes it; ``ties`` (optional) accepts index results that differ from
    eager's only in the order of equal keys (see :data:`TIE_ORDER_OPS`)."""

    __slots__ = ("fn", "tensors", "label", "ties", "fp32_fn")

    def __init__(self, fn: Callable[..., Any], tensors: List[torch.Tensor], label: str,
                 ties: Optional[Callable[[Any, Any], bool]] = None, fp32_fn: Optional[Callable[..., Any]] = None):
        self.fn, self.tensors, self.label, self.ties = fn, tensors, label, ties
        #: the same call with its 16-bit ``dtype=`` keyword made float32: the fp32 computation a 16-bit run is
        #: compared with (``linspace(..., dtype=bf16)`` has no 16-bit input to widen, and its inputs widened alone
        #: would still compute in bf16)
        self.fp32_fn = fp32_fn


#: Ops whose index results may order equal keys either way unless ``stable=True`` (torch documents the order
#: of ties as unspecified; bf16 inputs tie often): name -> (index of the dim argument after the input, its
#: default, index of the indices among the results, whether they permute the whole dim).
#: ``mode``'s index is "the index location of" the mode value (torch's docs), any of them when it repeats (and bf16
#: values repeat often): it must point at an element equal to eager's pick.
TIE_ORDER_OPS = {"sort": (0, -1, 1, True), "argsort": (0, -1, 0, True), "msort": (None, 0, 1, True),
                 "topk": (1, -1, 1, False), "mode": (0, -1, 1, False)}


def _tie_check(name: str, args: tuple, kwargs: Dict[str, Any]) -> Optional[Callable[[Any, Any], bool]]:
    """For a :data:`TIE_ORDER_OPS` sample without ``stable=True``: a check that the indices a door returned
    pick the same keys as eager's (and, for a sort, are a permutation along the dim)."""
    spec = TIE_ORDER_OPS.get(name)
    if spec is None or kwargs.get("stable") or not isinstance(args[0], torch.Tensor):
        return None
    at, dim, which, whole = spec
    if at is not None:
        dim = kwargs.get("dim", args[1 + at] if len(args) > 1 + at else dim)
    x = args[0]
    if name in ("sort", "argsort") and len(args) > 3 and args[3] is True:
        return None    # positional stable=True

    def ok(actual: Any, expected: Any) -> bool:
        a, e = _tensor_leaves(actual)[which], _tensor_leaves(expected)[which]
        a, e = a.detach().cpu(), e.detach().cpu()
        if a.shape != e.shape or x.dim() == 0:
            return bool(torch.equal(a, e))
        xs = x.detach().to(torch.float64 if not x.is_complex() else x.dtype)
        if a.dim() == x.dim() - 1:   # a reduction's indices without keepdim (mode)
            a, e = a.unsqueeze(dim), e.unsqueeze(dim)
        if whole and not torch.equal(a.sort(dim).values, e.sort(dim).values):
            return False
        return bool(torch.equal(xs.gather(dim, a), xs.gather(dim, e)))

    def grads_ok(actual: Any, expected: Any, kw: Dict[str, float]) -> bool:
        # The gradient of sum(values * w) puts w[j] at the input position the j-th result came from: where equal
        # keys are ordered another (valid) way, the same weights land on other positions of the same keys. So
        # per slice along the dim, the gradients sorted by (key, gradient) must match: the same multiset of
        # gradients on every group of equal keys (topk: unselected ones are 0 in both), at the usual tolerance.
        a_leaves, e_leaves = _tensor_leaves(actual), _tensor_leaves(expected)
        if len(a_leaves) != 1 or len(e_leaves) != 1 or x.dim() == 0:
            return False
        a, e = a_leaves[0].detach().cpu(), e_leaves[0].detach().cpu()
        if a.shape != x.shape or e.shape != x.shape:
            return False
        n = x.shape[dim]
        rows = [t.detach().cpu().to(torch.float64).movedim(dim, -1).reshape(-1, n).numpy() for t in (x, a, e)]
        import numpy as np

        sorted_ = [np.take_along_axis(g, np.lexsort((g, rows[0]), axis=-1), -1) for g in rows[1:]]
        try:
            torch.testing.assert_close(torch.from_numpy(sorted_[0]), torch.from_numpy(sorted_[1]),
                                       equal_nan=True, **kw)
        except AssertionError:
            return False
        return True

    ok.grads = grads_ok    # type: ignore[attr-defined]
    return ok


#: op name -> positions (in ``(input, *args)``) of tensor arguments torch requires on the CPU whatever the
#: device of the input (as on CUDA): the case passes them as they are, never moved to the door's device.
HOST_ONLY_ARGS: Dict[str, Tuple[int, ...]] = {
    "tensor_split": (1,),   # tensor_indices_or_sections: "must be ... on the CPU" (torch.tensor_split docs)
}


def _host_only_args(name: str, args: tuple) -> List[torch.Tensor]:
    """The tensors of ``args`` that :data:`HOST_ONLY_ARGS` keeps on the CPU for op ``name``."""
    return [args[i] for i in HOST_ONLY_ARGS.get(name, ()) if i < len(args) and isinstance(args[i], torch.Tensor)]


def _op_cases(info: Any, dtype: torch.dtype, grad: bool) -> Any:
    op = info.op
    for k, sample in enumerate(info.sample_inputs("cpu", dtype, requires_grad=grad)):
        args = (sample.input, *sample.args)
        leaves, spec = pytree.tree_flatten((args, dict(sample.kwargs)))
        host_only = _host_only_args(info.name, args)
        positions = [i for i, x in enumerate(leaves)
                     if isinstance(x, torch.Tensor) and not any(x is h for h in host_only)]

        def fn(*tensors, _leaves=leaves, _spec=spec, _pos=positions):
            full = list(_leaves)
            for p, t in zip(_pos, tensors):
                full[p] = t
            a, kw = pytree.tree_unflatten(full, _spec)
            return op(*a, **kw)

        fp32_fn = None
        if sample.kwargs.get("dtype") in (torch.bfloat16, torch.float16):
            wide = dict(sample.kwargs, dtype=torch.float32)
            fp32_leaves, fp32_spec = pytree.tree_flatten((args, wide))

            def fp32_fn(*tensors, _leaves=fp32_leaves, _spec=fp32_spec, _pos=positions):
                return fn(*tensors, _leaves=_leaves, _spec=_spec, _pos=_pos)

        yield Case(fn, [leaves[p] for p in positions], f"sample {k}",
                   _tie_check(info.name, args, dict(sample.kwargs)), fp32_fn)


def _materialize_lazy(module: torch.nn.Module, forward_input: Any) -> None:
    """Give a lazy module (``nn.LazyConv2d`` and the like) its real parameters, as its first call would: one
    forward on the CPU, without autograd, on a copy of the sample's inputs; running statistics that forward
    updated (a lazy batch norm's) are reset to their initial values. Then every door gets the materialised
    parameters as inputs, like any other module's (``module_db`` makes no samples for a lazy module otherwise:
    its uninitialised parameters cannot be copied)."""
    from torch.nn.modules.lazy import LazyModuleMixin

    if not any(isinstance(sub, LazyModuleMixin) and sub.has_uninitialized_params() for sub in module.modules()):
        return
    args, kwargs = pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x,
                                   (tuple(forward_input.args), dict(forward_input.kwargs)))
    with torch.no_grad():
        module(*args, **kwargs)
    for sub in module.modules():
        if hasattr(sub, "reset_running_stats"):
            sub.reset_running_stats()


def _module_cases(info: Any, training: bool, dtype: torch.dtype, grad: bool) -> Any:
    from torch.func import functional_call

    inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=grad, training=training)
    for k, mi in enumerate(inputs):
        if mi.forward_input is None:
            continue
        torch.manual_seed(SEED)
        c = mi.constructor_input
        m = info.module_cls(*c.args, **c.kwargs).to(dtype)
        m.train(training)
        _materialize_lazy(m, mi.forward_input)
        state = dict(m.named_parameters())
        state.update(dict(m.named_buffers()))
        names = list(state)
        f_in = mi.forward_input
        leaves, spec = pytree.tree_flatten((tuple(f_in.args), dict(f_in.kwargs)))
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [state[n].detach().clone().requires_grad_(grad and state[n].requires_grad
                                                             and state[n].is_floating_point()) for n in names]
        tensors += [leaves[p] for p in positions]

        def fn(*ts, _m=m, _names=names, _leaves=leaves, _spec=spec, _pos=positions):
            full = list(_leaves)
            for p, t in zip(_pos, ts[len(_names):]):
                full[p] = t
            a, kw = pytree.tree_unflatten(full, _spec)
            return functional_call(_m, dict(zip(_names, ts[:len(_names)])), a, kw)

        yield Case(fn, tensors, f"input {k} ({mi.desc or 'default'})")


# --------------------------------------------------------------------------- comparison

def _tensor_leaves(x: Any) -> List[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def compare(actual: Any, expected: Any, tol: Optional[Dict[str, float]] = None, values: bool = True,
            expected_meta: Any = None, tolerances: Optional[Dict[Any, Dict[str, float]]] = None,
            skip_integer: bool = False, oracle: Any = None, promoted: bool = False) -> Optional[str]:
    """None when the tensor leaves of ``actual`` match ``expected`` (only shapes/dtypes when ``values`` is
    false, or for integer results when ``skip_integer``); otherwise why not. ``expected_meta`` (optional, same structure) gives the dtypes and shapes
    ``actual`` must have when ``expected`` holds the values at another precision (bf16 runs). ``oracle``
    (optional, same structure): the float64 results on the same inputs; an fp32 leaf outside the tolerance of
    eager's passes when it is within the tolerance widened by twice eager's own error there (see
    :func:`_within_eager_error`): tn closer to the exact value than eager's kernel is not a wrong answer.
    ``promoted`` (16-bit runs only): the fp32 leaves are fp32 computations that torch's type promotion made of
    16-bit and fp32 inputs; their allowance also covers elements whose exact value is within eager's own fp32
    error of 0 (``near_zero`` of :func:`_within_eager_error`)."""
    a_leaves = _tensor_leaves(actual)
    e_leaves = _tensor_leaves(expected)
    m_leaves = _tensor_leaves(expected_meta) if expected_meta is not None else e_leaves
    o_leaves = _tensor_leaves(oracle) if oracle is not None else []
    if len(o_leaves) != len(e_leaves):
        o_leaves = [None] * len(e_leaves)
    if len(a_leaves) != len(e_leaves) or len(a_leaves) != len(m_leaves):
        return f"mismatch: {len(a_leaves)} tensor results, eager gives {len(m_leaves)}"
    tolerances = tolerances or TOLERANCES
    for j, (a, e, m, o) in enumerate(zip(a_leaves, e_leaves, m_leaves, o_leaves)):
        if a.shape != m.shape or a.dtype != m.dtype:
            return f"mismatch: result {j} is {a.dtype}{list(a.shape)}, eager gives {m.dtype}{list(m.shape)}"
        if not values or skip_integer and not (m.dtype.is_floating_point or m.dtype.is_complex):
            continue
        a = a.detach().cpu().resolve_conj().resolve_neg()
        e = e.detach().cpu().resolve_conj().resolve_neg()
        if a.dtype != e.dtype:
            a = a.to(e.dtype)
        if m.dtype.is_floating_point or m.dtype.is_complex:
            kw = dict(tol if (tol is not None and m.dtype == torch.float32)
                      else tolerances.get(m.dtype, TOLERANCES.get(m.dtype, dict(rtol=0, atol=0))))
        else:
            kw = dict(rtol=0, atol=0)
        try:
            torch.testing.assert_close(a, e, equal_nan=True, check_device=False, check_stride=False, **kw)
        except AssertionError as err:
            if m is not e and m.dtype in (torch.bfloat16, torch.float16) and _within_eager_error(a, e, m, kw):
                continue
            if (o is not None and m.dtype == torch.float32 and o.dtype == torch.float64
                    and _within_eager_error(a, e, o, kw, near_zero=promoted)):
                continue
            detail = " ".join(str(err).split())
            return f"mismatch: result {j}: {detail[:240]}"
    return None


def _within_eager_error(a: torch.Tensor, e: torch.Tensor, m: torch.Tensor, kw: Dict[str, float],
                        near_zero: bool = False) -> bool:
    """Whether a low-precision result ``a`` is, element by element, within the dtype's tolerance of the fp32
    values ``e`` widened by twice eager's own low-precision error ``|m - e|`` there (cancellation, e.g. a
    layer norm's bias undoing its normalised input, makes any bf16 computation lose digits; eager's bf16
    kernel shows how many). For an fp32 result ``e`` is eager's fp32 value and ``m`` the float64 one: the
    allowance is then eager's own fp32 error (ill-conditioned samples, e.g. ``cov`` whose normalisation
    cancels, where another summation order gives another fp32 answer as close to the exact one).

    ``near_zero`` (fp32 leaves of a 16-bit run, see :func:`compare`): at an element whose exact value ``m`` is
    no larger than eager's largest fp32 error over the tensor, the widening is twice that largest error. Such an
    element is a sum that cancels to ~0; eager's error elsewhere in the same tensor measures the terms' ulp,
    which bounds any fp32 summation order, and eager landing on the exact value there is chance (``cov``'s
    gradient of its fp32 ``aweights`` with bf16 observations: exactly 0 and -2e-13, eager fp32 gives 0 and
    -6.1e-5, the device 6.1e-5 and -6.1e-5: one ulp of terms ~10^3 on both elements)."""
    m = m.detach().cpu().to(e.dtype)
    if m.is_complex() or a.shape != e.shape:
        return False
    nan = torch.isnan(e)
    if not torch.equal(torch.isnan(a), nan):
        return False
    err = (m - e).abs()
    allowed = kw["atol"] + kw["rtol"] * e.abs() + 2 * err
    finite = err[torch.isfinite(err)]   # (an inf or NaN of eager's fp32 where float64 is finite measures no ulp)
    if near_zero and finite.numel():
        worst = finite.max()
        allowed = torch.where(m.abs() <= worst, torch.maximum(allowed, kw["atol"] + 2 * worst), allowed)
    ok = ((a - e).abs() <= allowed) | nan | (a == e)
    return bool(ok.all())


def _clone(ts: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None, device: Any = None) -> List[Any]:
    out = []
    for t in ts:
        c = t.detach()
        if dtype is not None and c.is_floating_point():
            c = c.to(dtype)
        c = c.to(device) if device is not None else c.clone()
        if device is not None and c.data_ptr() == t.data_ptr():
            c = c.clone()
        out.append(c.requires_grad_(t.requires_grad and (c.is_floating_point() or c.is_complex())))
    return out


def _grad_weights(outs: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED + 7)
    ws = []
    for o in outs:
        if o.requires_grad and (o.is_floating_point() or o.is_complex()):
            w = torch.rand(tuple(o.shape), generator=g, dtype=torch.float32) + 0.5
            if o.dtype in (torch.bfloat16, torch.float16):
                # representable in the result's dtype: the door's (and eager's) backward receives d loss / d out in
                # that dtype, so a weight rounded there only in the door made the fp32 oracle's upstream gradient
                # another input (matrix_exp's gradient cancels: 0.4% in w was 7% at an element)
                w = w.to(o.dtype).to(torch.float32)
            ws.append(w)
        else:
            ws.append(None)
    return ws


def _loss(out: Any, ws: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    total = None
    for o, w in zip(_tensor_leaves(out), ws):
        if w is None or not o.requires_grad:
            continue
        v = o.abs() if o.is_complex() else o     # (no view_as_real: the loss must trace under tn.jit too)
        v = v if v.dtype == torch.float64 else v.float()     # a float64 run (the oracle) keeps its precision
        term = (v * w.to(device=v.device, dtype=v.dtype)).sum()
        total = term if total is None else total + term
    return total


def _grads(fn: Callable[..., Any], ts: Sequence[torch.Tensor], ws: List[Optional[torch.Tensor]]) -> Any:
    """Gradients of ``sum(fn(*ts) * ws)`` with respect to the tensors of ``ts`` that require grad (None: none)."""
    wanted = [t for t in ts if t.requires_grad]
    out = fn(*ts)
    loss = _loss(out, ws)
    if loss is None or not wanted:
        return out, None
    return out, torch.autograd.grad(loss, wanted, allow_unused=True, materialize_grads=True)


# --------------------------------------------------------------------------- doors

def _host_ops(prof: Any, *more: Dict[str, int]) -> Dict[str, int]:
    """``{op: count}`` of the work that ran on the host: a profile's host ops plus other counters."""
    out: Dict[str, int] = dict(prof.host_ops) if prof is not None else {}
    for d in more:
        for k, n in d.items():
            out[k] = out.get(k, 0) + n
    return out


class _SeededOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records whether any aten op run under it draws random numbers (``nondeterministic_seeded``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and not _draws_nothing(func, args, kwargs or {}):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _draws_nothing(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
    """A seeded op called so that it draws no number: attention with ``dropout_p=0`` (every
    ``nn.Transformer*``/``MultiheadAttention`` in eval mode), dropout with ``train=False`` or ``p=0``."""
    bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
             for i, a in enumerate(func._schema.arguments)}
    if "dropout_p" in bound:
        return bound["dropout_p"] in (0, 0.0, None)
    if func.name().startswith("aten::native_dropout"):
        return bound.get("train") is False or bound.get("p") == 0
    return False


@contextlib.contextmanager
def _seeded_outside_dynamo() -> Any:
    """For the compile door: op_db's seeding wrapper (``wrapper_set_seed``: ``freeze_rng_state`` +
    ``manual_seed(42)`` around the op, for ``item``, dropout, attention...) runs around the compiled call instead
    of inside it, as torch's own ``optests.aot_autograd`` harness does. Inside, Dynamo breaks the graph at
    ``freeze_rng_state``'s ``torch._C._DisableFuncTorch()`` with every backend, so the op never reached the
    door. The seed and the saved generator state are the same; ops that draw random numbers stay excluded."""
    import torch.testing._internal.common_methods_invocations as cmi
    from torch.testing._utils import freeze_rng_state, wrapper_set_seed

    def unwrapped(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return op(*args, **kwargs)

    cmi.wrapper_set_seed = unwrapped
    try:
        with freeze_rng_state():
            torch.manual_seed(42)
            yield
    finally:
        cmi.wrapper_set_seed = wrapper_set_seed


def _run_door(mode: str, backend: str, fn: Callable[..., Any], ts: List[torch.Tensor], grad: bool,
              ws: List[Optional[torch.Tensor]]) -> Tuple[Any, Any, Dict[str, int], Optional[str]]:
    """``(results, grads or None, {host op: count}, error reason or None)`` of one case through ``mode``."""
    import tn

    with tn.profile() as prof:
        if mode == "eager":
            dev = _clone(ts, device="neuron")
            if grad:
                out, g = _grads(fn, dev, ws)
            else:
                out, g = fn(*dev), None
            return out, g, _host_ops(prof, tn.device.fallback_ops()), None
        if mode == "jit":
            if grad:
                def with_grad(*xs):
                    return _grads(fn, xs, ws)
                out, g = tn.jit(with_grad, backend=backend)(*_clone(ts))
            else:
                out, g = tn.jit(fn, backend=backend)(*_clone(ts)), None
            return out, g, _host_ops(prof), None
        if mode == "compile":
            from torch import _dynamo
            from torch._dynamo.utils import counters

            import tn.dynamo_backend as dynamo_backend

            _dynamo.reset()
            counters.clear()
            before = dynamo_backend.graphs_compiled()
            by_op = dynamo_backend.graphs_run_op_by_op()
            old = {id(j) for j in dynamo_backend.compiled_graphs()}
            cf = torch.compile(fn, backend="neuron")
            xs = _clone(ts)
            with _seeded_outside_dynamo():
                out, g = (_grads(cf, xs, ws) if grad else (cf(*xs), None))
            breaks = sum(counters["graph_break"].values())
            if breaks:
                reason = next(iter(counters["graph_break"]))
                return out, g, {}, _data_dependent(fn, ts, grad, ws) or f"graph break: {_first_line(reason)}"
            # a graph tn ran op by op (dynamo_backend._op_by_op) reached tn: its host work is in prof (OP_BY_OP)
            if (dynamo_backend.graphs_compiled() == before and dynamo_backend.graphs_run_op_by_op() == by_op
                    and _tensor_leaves(out)):
                return out, g, {}, (_data_dependent(fn, ts, grad, ws)
                                    or "no graph reached tn (Dynamo ran the code itself)")
            mine = [j for j in dynamo_backend.compiled_graphs() if id(j) not in old]   # this case's graphs only
            return out, g, _host_ops(prof, *(dynamo_backend.host_ops_of(j) for j in mine)), None
        if mode == "adaptive":
            class _Wrap(torch.nn.Module):
                def forward(self, *xs):
                    return fn(*xs)

            m = tn.adaptive(_Wrap(), costs={"eager": 1.0, "compiled": 0.0, "compile": 0.0}, min_calls=1,
                            min_gain=0.0)
            for _ in range(3):   # the first calls decide; the last runs the compiled region
                xs = _clone(ts)
                out, g = (_grads(m, xs, ws) if grad else (m(*xs), None))
            rows = tn.adaptive_report(m, print_table=False)
            if not any(r.get("compiles") for r in rows):
                why = "; ".join(str(r.get("why", "")) for r in rows if r.get("why"))
                return out, g, {}, f"region not compiled: {why or 'stayed eager'}"
            return out, g, _host_ops(prof), None
    raise ValueError(f"unknown mode {mode!r}")


def _data_dependent(fn: Callable[..., Any], ts: List[torch.Tensor], grad: bool,
                    ws: List[Optional[torch.Tensor]]) -> Optional[str]:
    """After a graph break on the compile door: the case again with ``fullgraph=True``, which makes Dynamo
    raise the break's first cause instead of running on. A guard on a data-dependent value gives the
    :data:`REFUSED` reason (Dynamo's words and the call they came from); any other cause gives None."""
    from torch import _dynamo

    _dynamo.reset()
    try:
        with _seeded_outside_dynamo():
            cf = torch.compile(fn, backend="neuron", fullgraph=True)
            _grads(cf, _clone(ts), ws) if grad else cf(*_clone(ts))
    except Exception as err:
        text = str(err)
        words = next((w for w in _DATA_DEPENDENT if w.lower() in text.lower()), None)
        if words is None:
            return None
        caused = re.search(r"Caused by: (.*)", text)
        where = f" ({' '.join(caused.group(1).split())[:160]})" if caused else ""
        return (f"{REFUSED}data-dependent control flow (a branch on, or an op constant from, a tensor's values), "
                f"which Dynamo cannot capture: {_first_line(text, 160)}{where}")
    finally:
        _dynamo.reset()
    return None


# --------------------------------------------------------------------------- one item

def _first_line(msg: Any, limit: int = 300) -> str:
    s = str(msg).strip()
    return (s.splitlines()[0] if s else "")[:limit]


def _float64_oracle(case: Case, grad: bool, ws: List[Optional[torch.Tensor]]) -> Tuple[Any, Any]:
    """``(results, grads)`` of eager PyTorch on the case's fp32 inputs converted to float64 (the exact-ish
    answer an fp32 result's error is measured against); ``(None, None)`` when the op refuses float64."""
    try:
        torch.manual_seed(SEED)
        ts = _clone(case.tensors, torch.float64)
        if grad:
            return _grads(case.fn, ts, ws)
        return case.fn(*ts), None
    except Exception:
        return None, None


#: CPU kernels whose bf16/fp16 results are not the correctly rounded fp32 value (they round in between):
#: ``_log_softmax`` computes ``x - max - log(sum)`` with the difference rounded to bf16 first (-1.1797 where the
#: fp32 value -1.1752 rounds to -1.1719).
_NOT_ROUNDED_ONCE = (torch.ops.aten._log_softmax.default,)


class _RoundedOnce(torch.utils._python_dispatch.TorchDispatchMode):
    """Runs the :data:`_NOT_ROUNDED_ONCE` kernels of 16-bit inputs in fp32 and rounds their results once."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NOT_ROUNDED_ONCE and args[0].dtype in (torch.bfloat16, torch.float16):
            return func(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)


def _rounded_eager(case: Case, grad: bool, ws: List[Optional[torch.Tensor]]) -> Tuple[Any, Any]:
    """``(results, grads)`` of eager PyTorch on the case's 16-bit inputs with the :data:`_NOT_ROUNDED_ONCE`
    kernels rounded once, as the doors compute them: a second measure of eager's own low-precision error for the
    widening rule (:func:`_within_eager_error`). Where a later step cancels (``linear_cross_entropy``'s
    soft-target gradient ``exp(log_softmax) * sum(w t) - w t``), a one-ulp change of the saved log-softmax moves
    the gradient by several of its ulps, and eager's kernel can land closer to fp32 by chance only; the door's
    result is then bit for bit this run's. ``(None, None)`` when it fails."""
    mode = _RoundedOnce()
    try:
        torch.manual_seed(SEED)
        ts = _clone(case.tensors)
        with mode:
            res = _grads(case.fn, ts, ws) if grad else (case.fn(*ts), None)
    except Exception:
        return None, None
    return res


def _eager_reference(case: Case, dtype: torch.dtype, grad: bool) -> Tuple[Any, Any, Any, List]:
    """(values, grads, metas, weights) of eager PyTorch on the CPU; values at fp32 for low-precision dtypes."""
    ref_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else None
    try:
        torch.manual_seed(SEED)
        seeded = _SeededOps()
        with seeded:
            meta_out = case.fn(*_clone(case.tensors))
        if seeded.seen:
            raise _Random(f"random: draws random numbers ({seeded.seen[0]})")
        ws = _grad_weights(_tensor_leaves(meta_out)) if grad else []
        torch.manual_seed(SEED + 1)
        again = case.fn(*_clone(case.tensors))
        if compare(again, meta_out) is not None:
            raise _Random("nondeterministic: two eager runs with different seeds differ")
        if ref_dtype is not None:
            torch.manual_seed(SEED)
            ref_fn = case.fp32_fn or case.fn
            ref_out, ref_g = (_grads(ref_fn, _clone(case.tensors, ref_dtype), ws) if grad
                              else (ref_fn(*_clone(case.tensors, ref_dtype)), None))
        else:
            torch.manual_seed(SEED)
            ref_out, ref_g = (_grads(case.fn, _clone(case.tensors), ws) if grad
                              else (meta_out, None))
        meta_g = ref_g
        if grad and ref_g is not None and ref_dtype is not None:
            _, meta_g = _grads(case.fn, _clone(case.tensors), ws)
    except _Random:
        raise
    except Exception as err:
        raise _EagerRejects(err) from err
    return ref_out, ref_g, (meta_out, meta_g), ws


def run_item(kind: str, key: str, mode: str, backend: str = "neuron", dtype: torch.dtype = torch.float32,
             grad: bool = False, max_samples: Optional[int] = None, timeout: float = 60.0,
             crash_only: bool = False, progress: Optional[Callable[[str], None]] = None,
             info: Any = None) -> Dict[str, Any]:
    """Run every sample of one item (``kind`` ``"op"`` or ``"module"``, ``key`` as :func:`op_key` /
    :func:`module_key`) through ``mode``; returns its record ``{name, status, reason, samples, ...}``."""
    import tn  # noqa: F401  (registers the device and the compile backend)

    rec: Dict[str, Any] = dict(name=key, status="pass", reason="", samples=0, host_samples=0)
    if info is None:
        info = _find(kind, key, dtype)
    tol = OP_TOLERANCES.get(key) or OP_TOLERANCES.get(key.split(".")[0]) if kind == "op" else None
    cases = (_op_cases(info, dtype, grad) if kind == "op"
             else _module_cases(info[0], info[1], dtype, grad))
    if kind == "op" and info.name in UNDEFINED_VALUES and not crash_only:
        rec.update(status="excluded", reason="values are uninitialised memory")
        return rec
    use_alarm = timeout > 0 and hasattr(signal, "SIGPROF")

    def on_alarm(signum: int, frame: Any) -> None:
        raise OpTimeout(f"timeout: a sample took more than {timeout:g} s of CPU time")

    old = signal.signal(signal.SIGPROF, on_alarm) if use_alarm else None
    worst = "pass"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            it = iter(cases)
            while max_samples is None or rec["samples"] < max_samples:
                try:
                    case = next(it)
                except StopIteration:
                    break
                if use_alarm:
                    signal.setitimer(signal.ITIMER_PROF, timeout)
                try:
                    if progress is not None:
                        progress(case.label)
                    status, why = _run_case(case, mode, backend, dtype, grad, tol, crash_only)
                except _EagerRejects:
                    continue
                except _Random as err:
                    rec.update(status="excluded", reason=str(err))
                    return rec
                except OpTimeout as err:
                    status, why = "error", str(err)
                finally:
                    if use_alarm:
                        signal.setitimer(signal.ITIMER_PROF, 0)
                rec["samples"] += 1
                rec["host_samples"] += status == "pass_host"
                if _RANK[status] < _RANK[worst]:
                    worst = status
                    rec.update(reason=f"{case.label}: {why}" if why else "")
                if worst in ("fail", "crash"):
                    break
    except OpTimeout as err:   # raised while making samples
        worst, rec["reason"] = "error", str(err)
    except Exception as err:   # the sample generator itself failed
        if rec["samples"] == 0:
            rec.update(status="skip", reason=f"no samples: {type(err).__name__}: {_first_line(err)}")
            return rec
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, old)
    rec["status"] = worst
    if rec["samples"] == 0:
        rec.update(status="skip", reason=f"no {dtype} sample that eager PyTorch accepts")
    return rec


def _run_case(case: Case, mode: str, backend: str, dtype: torch.dtype, grad: bool,
              tol: Optional[Dict[str, float]], crash_only: bool) -> Tuple[str, str]:
    import tn

    if crash_only:
        ws = []
        try:
            torch.manual_seed(SEED)
            out = case.fn(*_clone(case.tensors))
            ws = _grad_weights(_tensor_leaves(out)) if grad else []
        except Exception as err:
            raise _EagerRejects(err) from err
        done = _door_or_error(mode, backend, case, grad, ws)
        if len(done) == 2:   # ("error" or "refused", reason)
            return done
        _, _, host = done
        return ("pass_host", _host_text(host)) if host else ("pass", "")
    ref_out, ref_g, (meta_out, meta_g), ws = _eager_reference(case, dtype, grad)
    tn.device.tracking.reset_op_counts()
    done = _door_or_error(mode, backend, case, grad, ws)
    if len(done) == 2:   # ("error" or "refused", reason)
        return done
    out, g, host = done
    bad = compare(out, ref_out, tol, expected_meta=meta_out)
    if bad and case.ties is not None and compare(out, ref_out, tol, expected_meta=meta_out,
                                                 skip_integer=True) is None and case.ties(out, meta_out):
        bad = None     # the same keys, equal ones in another order
    oracle = None
    if bad and dtype == torch.float32:
        oracle = _float64_oracle(case, grad, ws)
        bad = compare(out, ref_out, tol, expected_meta=meta_out, oracle=oracle[0])
    rounded = None
    if bad and dtype in (torch.bfloat16, torch.float16):
        rounded = _rounded_eager(case, grad, ws)
        if rounded[0] is not None:
            bad = compare(out, ref_out, tol, expected_meta=rounded[0])
        if bad and _has_fp32(meta_out):
            # an fp32 result of a 16-bit run is an fp32 computation (type promotion: ``cov`` of bf16 observations
            # with fp32 ``aweights`` computes and returns fp32), not a 16-bit one: held to fp32's tolerance, with a
            # float32 run's allowance of eager's own fp32 error against float64 (see _within_eager_error). The bf16
            # tolerance would be 1000x too loose for it; a float32 run never takes this path.
            oracle = _float64_oracle(case, grad, ws)
            bad = compare(out, ref_out, tol, expected_meta=rounded[0] if rounded[0] is not None else meta_out,
                          oracle=oracle[0], promoted=True)
    if bad is None and grad and ref_g is not None:
        if g is None:
            bad = "mismatch: no gradients"
        else:
            grad_tols = {**TOLERANCES, **GRAD_TOLERANCES}
            bad = compare(g, ref_g, tol, expected_meta=meta_g, tolerances=grad_tols)
            if bad and case.ties is not None and compare(g, ref_g, tol, expected_meta=meta_g, values=False) is None:
                gm = _tensor_leaves(meta_g)
                kw = grad_tols.get(gm[0].dtype, TOLERANCES[torch.float32]) if len(gm) == 1 else None
                if kw is not None and case.ties.grads(g, ref_g, dict(tol if tol and gm[0].dtype == torch.float32
                                                                     else kw)):
                    bad = None     # the same gradients on each group of equal keys (see _tie_check)
            if bad and dtype == torch.float32:
                oracle = oracle or _float64_oracle(case, grad, ws)
                bad = compare(g, ref_g, tol, expected_meta=meta_g, tolerances=grad_tols, oracle=oracle[1])
            if bad and dtype in (torch.bfloat16, torch.float16):
                rounded = rounded or _rounded_eager(case, grad, ws)
                if rounded[1] is not None:
                    bad = compare(g, ref_g, tol, expected_meta=rounded[1], tolerances=grad_tols)
                if bad and _has_fp32(meta_g):   # the gradient of an fp32 input: fp32's rule, as the results'
                    oracle = oracle or _float64_oracle(case, grad, ws)
                    bad = compare(g, ref_g, tol, expected_meta=rounded[1] if rounded[1] is not None else meta_g,
                                  tolerances=grad_tols, oracle=oracle[1], promoted=True)
            bad = f"gradient {bad}" if bad else None
    if bad:
        return "fail", bad
    return ("pass_host", _host_text(host)) if host else ("pass", "")


def _has_fp32(meta: Any) -> bool:
    """Whether any tensor leaf of ``meta`` (eager's results or gradients) is float32."""
    return any(t.dtype == torch.float32 for t in _tensor_leaves(meta))


def _door_or_error(mode: str, backend: str, case: Case, grad: bool, ws: List[Optional[torch.Tensor]]) -> tuple:
    """``(results, grads, host ops)`` of the case through the door, or ``("error" or "refused", reason)``."""
    try:
        torch.manual_seed(SEED)
        out, g, host, why = _run_door(mode, backend, case.fn, case.tensors, grad, ws)
    except (OpTimeout, KeyboardInterrupt):
        raise
    except Exception as err:
        return "error", f"{type(err).__name__}: {_first_line(err)}"
    if why:
        return ("refused" if why.startswith(REFUSED) else "error"), why
    return out, g, host


def _host_text(host: Dict[str, int]) -> str:
    return "on the host: " + ", ".join(sorted(host))


def _find(kind: str, key: str, dtype: torch.dtype) -> Any:
    if kind == "op":
        for info in opinfos(dtype, [key]):
            if op_key(info) == key:
                return info
    else:
        for pair in moduleinfos(dtype, [key]):
            if module_key(*pair) == key:
                return pair
    raise KeyError(f"no {kind} named {key!r} supports {dtype}")


# --------------------------------------------------------------------------- worker pool

def _worker(conn: Any, opts: Dict[str, Any], fault_log: Optional[str] = None) -> None:
    torch.set_num_threads(1)
    if fault_log:
        # a fatal signal leaves every thread's Python stack in this file; the pool puts its tail in the crash record
        faulthandler.enable(open(fault_log, "w"), all_threads=True)
    from tn.device import allocator

    allocator.reinit_after_fork()   # a forked worker uses the parent's (host-memory) device on purpose
    os.environ.setdefault("TN_NO_WARMUP", "1")
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        kind, key = task
        t0 = time.perf_counter()
        try:
            rec = run_item(kind, key, progress=lambda label: conn.send(("progress", label)), **opts)
        except Exception as err:
            rec = dict(name=key, status="error", reason=f"bench: {type(err).__name__}: {_first_line(err)}",
                       samples=0, host_samples=0, trace=traceback.format_exc()[-2000:])
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        conn.send(("done", rec))


class _Slot:
    __slots__ = ("proc", "conn", "task", "label", "started", "fault_log")

    def __init__(self, ctx: Any, opts: Dict[str, Any]):
        parent, child = ctx.Pipe()
        fd, self.fault_log = tempfile.mkstemp(prefix="tn-coverage-fault-", suffix=".txt")
        os.close(fd)
        self.proc = ctx.Process(target=_worker, args=(child, opts, self.fault_log), daemon=True)
        self.proc.start()
        child.close()
        self.conn, self.task, self.label, self.started = parent, None, "", 0.0

    def fault_trace(self) -> str:
        """The start of what the dead worker's fault handler wrote (the signal, then the crashing thread's stack,
        most recent call first; empty if nothing); removes the file."""
        try:
            with open(self.fault_log) as f:
                text = f.read()
            os.unlink(self.fault_log)
        except OSError:
            return ""
        return text[:2000]


def run_pool(items: Sequence[Tuple[str, str]], opts: Dict[str, Any], workers: int = 2,
             item_timeout: float = 1800.0, verbose: bool = False) -> List[Dict[str, Any]]:
    """Run ``items`` (``(kind, key)``) in ``workers`` processes; a worker that dies is replaced and its item
    recorded as a crash; an item running longer than ``item_timeout`` wall seconds is killed (an error)."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    todo = list(items)[::-1]
    slots = [_Slot(ctx, opts) for _ in range(max(1, min(workers, len(todo))))]
    records: List[Dict[str, Any]] = []

    def finish(rec: Dict[str, Any]) -> None:
        records.append(rec)
        if verbose:
            print(f"{rec['name']:45s} {rec['status']:9s} {rec.get('reason', '')[:110]}", flush=True)

    def feed(s: _Slot) -> None:
        if todo:
            s.task = todo.pop()
            s.label, s.started = "", time.perf_counter()
            s.conn.send(s.task)
        else:
            s.task = None

    for s in slots:
        feed(s)
    while any(s.task is not None for s in slots):
        busy = [s for s in slots if s.task is not None]
        ready = mp_wait([s.conn for s in busy] + [s.proc.sentinel for s in busy], timeout=5.0)
        now = time.perf_counter()
        for s in busy:
            died = s.proc.sentinel in ready and not s.conn.poll()
            if s.conn in ready or s.conn.poll():
                try:
                    while s.conn.poll():
                        kind, payload = s.conn.recv()
                        if kind == "progress":
                            s.label = payload
                        else:
                            finish(payload)
                            feed(s)
                            break
                    continue
                except (EOFError, OSError):
                    died = True
            timed_out = now - s.started > item_timeout
            if died or timed_out or not s.proc.is_alive():
                if timed_out and not died and s.proc.is_alive():
                    s.proc.kill()
                s.proc.join(10)
                code = s.proc.exitcode
                trace = s.fault_trace()
                if timed_out and not died:
                    rec = dict(name=s.task[1], status="error", reason=f"timeout: more than {item_timeout:g} s "
                               f"wall at {s.label or 'start'}", samples=0, host_samples=0)
                else:
                    sig = -code if code is not None and code < 0 else None
                    what = signal.Signals(sig).name if sig else f"exit code {code}"
                    rec = dict(name=s.task[1], status="crash", reason=f"worker died: {what} at "
                               f"{s.label or 'start'}", samples=0, host_samples=0)
                    if trace:
                        rec["trace"] = trace
                rec["seconds"] = round(now - s.started, 3)
                finish(rec)
                fresh = _Slot(ctx, opts)
                s.proc, s.conn, s.fault_log = fresh.proc, fresh.conn, fresh.fault_log
                feed(s)
    for s in slots:
        try:
            s.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        s.proc.join(10)
        if s.proc.is_alive():
            s.proc.kill()
        s.fault_trace()   # removes the worker's (empty) fault log
    order = {k: i for i, (_, k) in enumerate(items)}
    records.sort(key=lambda r: order.get(r["name"], 0))
    return records


# --------------------------------------------------------------------------- report

def summarize(records: List[Dict[str, Any]], **meta: Any) -> Dict[str, Any]:
    """The JSON report: ``meta`` (mode, grad, dtype ...), totals per status, rates, and the records."""
    counts = Counter(r["status"] for r in records)
    totals = {s: counts.get(s, 0) for s in STATUSES}
    considered = len(records) - totals["excluded"] - totals["skip"]
    rates = {"native": round(totals["pass"] / considered, 4) if considered else 0.0,
             "correct": round((totals["pass"] + totals["pass_host"]) / considered, 4) if considered else 0.0}
    return dict(meta, total=len(records), totals=totals, rates=rates, items=records)


def reason_key(reason: str) -> str:
    """A reason with numbers, shapes and quoted values blurred, to group similar ones."""
    r = re.sub(r"^(sample|input) \d+( \([^)]*\))?: ", "", reason)
    r = re.sub(r"(^|: )\S+\.py:\d+: `[^`]*`: ", r"\1", r)
    r = re.sub(r"\[[^\]]*\]", "[..]", r)
    r = re.sub(r"\(([^()]*)\)", "(..)", r)
    r = re.sub(r"(?<![A-Za-z_0-9])\d+(\.\d+)?(e[-+]?\d+)?", "N", r)
    r = re.sub(r"'[^']*'", "'..'", r)
    return r[:120]


def print_report(report: Dict[str, Any], top: int = 12, file: Any = None) -> None:
    """Print the table per status, the rates and the most common reasons per non-passing status."""
    from tabulate import tabulate

    file = file or sys.stdout
    total = max(report["total"], 1)
    t = report["totals"]
    rows = [[s, t.get(s, 0), f"{100.0 * t.get(s, 0) / total:.1f}%"] for s in STATUSES]
    rows.append(["total", report["total"], ""])
    head = ", ".join(f"{k}={report[k]}" for k in ("kind", "mode", "dtype", "grad") if k in report)
    print(head, file=file)
    print(tabulate(rows, headers=["status", "items", "share"]), file=file)
    print(f"native pass rate (of items not skipped/excluded): {100 * report['rates']['native']:.1f}%, "
          f"correct (incl. host fallback): {100 * report['rates']['correct']:.1f}%", file=file)
    for status in ("crash", "fail", "error", "refused", "pass_host", "excluded", "skip"):
        recs = [r for r in report["items"] if r["status"] == status]
        if not recs:
            continue
        groups: Dict[str, List[str]] = {}
        for r in recs:
            groups.setdefault(reason_key(r.get("reason", "")), []).append(r["name"])
        table = [[len(v), k, ", ".join(v[:4]) + (" ..." if len(v) > 4 else "")]
                 for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:top]]
        print(file=file)
        print(tabulate(table, headers=["items", f"{status}: most common reasons", "e.g."],
                       maxcolwidths=[None, 70, 45]), file=file)


def items_for(kind: str, dtype: torch.dtype, names: Optional[Sequence[str]] = None,
              limit: Optional[int] = None) -> List[Tuple[str, str]]:
    """``(kind, key)`` of every op (or module) supporting ``dtype``."""
    keys = ([op_key(i) for i in opinfos(dtype, names)] if kind == "op"
            else [module_key(*p) for p in moduleinfos(dtype, names)])
    seen, out = set(), []
    for k in keys:       # a few OpInfos share name and variant: run each key once
        if k not in seen:
            seen.add(k)
            out.append((kind, k))
    return out[:limit] if limit else out


def run(mode: str = "jit", backend: str = "neuron", dtype: torch.dtype = torch.float32, grad: bool = False,
        kind: str = "op", names: Optional[Sequence[str]] = None, limit: Optional[int] = None,
        max_samples: Optional[int] = None, timeout: float = 60.0, workers: int = 2, crash_only: bool = False,
        verbose: bool = False, shard: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
    """Run the bench and return the report dict (see the module docstring). ``shard`` ``(k, n)`` runs only
    every n-th item starting at the k-th (1-based): n such runs, merged by :func:`merge_shards`, are one run of
    every item, spread over processes or machines (a full compile-door row is hours of one core)."""
    items = items_for(kind, dtype, names, limit)
    if shard is not None:
        k, n = shard
        if not 1 <= k <= n:
            raise ValueError(f"shard {k}/{n}: want 1 <= k <= n")
        items = items[k - 1::n]
    opts = dict(mode=mode, backend=backend, dtype=dtype, grad=grad, max_samples=max_samples, timeout=timeout,
                crash_only=crash_only)
    t0 = time.perf_counter()
    commit = source_commit()
    records = run_pool(items, opts, workers=workers, verbose=verbose)
    return summarize(records, kind=kind, mode=mode, backend=backend if mode == "jit" else None,
                     dtype=str(dtype).replace("torch.", ""), grad=grad, crash_only=crash_only,
                     max_samples=max_samples, seconds=round(time.perf_counter() - t0, 1),
                     torch=torch.__version__, commit=commit,
                     partial=bool(names or limit or max_samples or shard), ops=list(names) if names else None,
                     limit=limit, shard=f"{shard[0]}/{shard[1]}" if shard else None)


#: Report fields that must agree for shards to be merged into one report.
SHARD_KEYS = ("kind", "mode", "backend", "dtype", "grad", "crash_only", "max_samples", "torch", "ops", "limit")


def merge_shards(reports: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One report of the shard reports of one configuration (``--shard k/n`` runs; see :func:`run`): their
    items together, counted again; ``commit`` lists each shard's commit; ``seconds`` is their sum. The merged
    report is a run of every item only when shards 1..n are all there, and says which ones it has otherwise.
    Raises ValueError for reports of different configurations, unsharded ones or an item in two shards."""
    if not reports:
        raise ValueError("merge_shards: no reports")
    first = reports[0]
    for r in reports:
        diff = [k for k in SHARD_KEYS if r.get(k) != first.get(k)]
        if diff:
            raise ValueError(f"merge_shards: reports differ in {diff}")
        if not r.get("shard"):
            raise ValueError("merge_shards: a report that is not a shard (no --shard)")
    parts = sorted({tuple(int(x) for x in r["shard"].split("/")) for r in reports})
    if len(parts) != len(reports) or len({n for _, n in parts}) != 1:
        raise ValueError(f"merge_shards: shards {[r['shard'] for r in reports]} repeat or differ in n")
    n = parts[0][1]
    records, seen = [], set()
    for r in reports:
        for rec in r["items"]:
            if rec["name"] in seen:
                raise ValueError(f"merge_shards: {rec['name']} is in two shards")
            seen.add(rec["name"])
            records.append(rec)
    every = [k for k, _ in parts] == list(range(1, n + 1))
    commits = list(dict.fromkeys(r.get("commit", "unknown") for r in reports))
    meta = {k: first.get(k) for k in SHARD_KEYS}
    return summarize(records, **meta, seconds=round(sum(r.get("seconds", 0.0) for r in reports), 1),
                     commit=",".join(commits),
                     partial=bool(first.get("ops") or first.get("limit") or first.get("max_samples")
                                  or not every),
                     shard=None if every else f"{','.join(str(k) for k, _ in parts)}/{n}")


def source_commit() -> str:
    """The checkout's commit (short hash), with ``+dirty`` when tracked files differ from it."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def scope_text(report: Dict[str, Any]) -> str:
    """``full`` for a run of every item and sample, else ``partial (...)`` saying what was cut."""
    cut = []
    if report.get("ops"):
        cut.append(f"{len(report['ops'])} named items")
    if report.get("limit"):
        cut.append(f"first {report['limit']} items")
    if report.get("max_samples"):
        cut.append(f"<= {report['max_samples']} samples/item")
    if report.get("crash_only"):
        cut.append("crash-only, not compared")
    if report.get("shard"):
        cut.append(f"shard {report['shard']} of the items")
    return f"partial ({', '.join(cut)})" if cut else "full"


def markdown_table(reports: Sequence[Dict[str, Any]]) -> str:
    """One markdown row per report (door, what ran, full or partial, commit, counts per status, native and
    correct rates)."""
    head = ["kind", "door", "dtype", "grad", "scope", "commit"] + list(STATUSES) + ["total", "native", "correct"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in reports:
        t = r["totals"]
        row = [r.get("kind", "op"), r["mode"] + (f" ({r['backend']})" if r.get("backend") else ""), r["dtype"],
               "yes" if r.get("grad") else "no", scope_text(r), r.get("commit", "unknown")]
        row += [str(t.get(s, 0)) for s in STATUSES] + [str(r["total"]), f"{100 * r['rates']['native']:.1f}%",
                                                f"{100 * r['rates']['correct']:.1f}%"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


TABLE_BEGIN, TABLE_END = "<!-- coverage table: bench/coverage.py --publish -->", "<!-- end of coverage table -->"


def publish(markdown_path: str, reports: Sequence[Dict[str, Any]]) -> None:
    """Write :func:`markdown_table` of ``reports`` into ``markdown_path`` between :data:`TABLE_BEGIN` and
    :data:`TABLE_END` (the lines are appended first if the file lacks them); the rest of the page is kept."""
    text = open(markdown_path).read() if os.path.exists(markdown_path) else ""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        text = text.rstrip("\n") + ("\n\n" if text else "") + TABLE_BEGIN + "\n" + TABLE_END + "\n"
    before, rest = text.split(TABLE_BEGIN, 1)
    after = rest.split(TABLE_END, 1)[1]
    with open(markdown_path, "w") as fh:
        fh.write(before + TABLE_BEGIN + "\n" + markdown_table(reports) + TABLE_END + after)


def _host_op_names(reason: str) -> List[str]:
    m = re.search(r"on the host: (.*)$", reason)
    return [n.strip() for n in m.group(1).split(", ") if n.strip()] if m else []


def rank_host_ops(reports: Sequence[Dict[str, Any]]) -> List[Tuple[str, int, List[str]]]:
    """Host ops by how many ``pass_host`` items they keep off the NeuronCore, over ``reports``:
    ``[(op, items, [item names (door)])]``, most first. An item names the host ops of its worst sample."""
    seen: Dict[str, Dict[str, None]] = {}
    for r in reports:
        door = r["mode"] + ("+grad" if r.get("grad") else "")
        for rec in r["items"]:
            if rec["status"] == "pass_host":
                for op in _host_op_names(rec.get("reason", "")):
                    seen.setdefault(op, {})[f"{rec['name']} ({door})"] = None
    return sorted(((op, len(v), list(v)) for op, v in seen.items()), key=lambda t: (-t[1], t[0]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["eager", "jit", "compile", "adaptive"], default="jit")
    p.add_argument("--backend", default="neuron", help="tn.jit backend for --mode jit (default: neuron)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--grad", action="store_true", help="also compare gradients")
    p.add_argument("--modules", action="store_true", help="run module_db (ModuleInfo) instead of op_db")
    p.add_argument("--ops", help="comma-separated names (op name, name.variant, or module name)")
    p.add_argument("--limit", type=int, help="only the first N items")
    p.add_argument("--max-samples", type=int, help="at most N samples per item")
    p.add_argument("--timeout", type=float, default=60.0, help="CPU seconds per sample (0: no limit)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--crash-only", action="store_true", help="run without comparing: a sweep for crashes")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    p.add_argument("--verbose", "-v", action="store_true", help="one line per item as it finishes")
    p.add_argument("--markdown", nargs="+", metavar="JSON",
                   help="print a markdown table of these JSON reports (nothing is run)")
    p.add_argument("--publish", metavar="MD",
                   help="with --markdown: write the table into this page between its table markers")
    p.add_argument("--rank-host", nargs="+", metavar="JSON",
                   help="rank the host ops of these JSON reports by the items they keep on the host")
    p.add_argument("--shard", metavar="K/N", help="run only every N-th item starting at the K-th (1-based); "
                                                   "merge the N reports with --merge")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge these --shard reports of one configuration into the report --json names")
    ns = p.parse_args(argv)
    if ns.merge:
        if not ns.json:
            p.error("--merge needs --json (where the merged report goes)")
        reports = []
        for path in ns.merge:
            with open(path) as fh:
                reports.append(json.load(fh))
        merged = merge_shards(reports)
        print_report(merged)
        with open(ns.json, "w") as fh:
            json.dump(merged, fh, indent=1)
        return 0
    shard = None
    if ns.shard:
        m = re.fullmatch(r"(\d+)/(\d+)", ns.shard)
        if not m:
            p.error("--shard wants K/N, e.g. 2/4")
        shard = (int(m.group(1)), int(m.group(2)))
    if ns.markdown or ns.rank_host:
        reports = []
        for path in ns.markdown or ns.rank_host:
            with open(path) as fh:
                reports.append(json.load(fh))
        if ns.rank_host:
            for op, n, names in rank_host_ops(reports):
                print(f"{n:4d}  {op:40s} {', '.join(names[:6])}{' ...' if n > 6 else ''}")
        elif ns.publish:
            publish(ns.publish, reports)
        else:
            print(markdown_table(reports), end="")
        return 0
    torch.set_num_threads(1)
    names = [n.strip() for n in ns.ops.split(",") if n.strip()] if ns.ops else None
    report = run(ns.mode, ns.backend, DTYPES[ns.dtype], ns.grad, "module" if ns.modules else "op", names,
                 ns.limit, ns.max_samples, ns.timeout, ns.workers, ns.crash_only, ns.verbose, shard)
    print_report(report)
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
