# The CTC loss (aten._ctc_loss and its backward, int-list and tensor lengths) as static-shape programs: torch's CPU alpha/beta recursions unrolled over time.
"""The connectionist temporal classification loss in core ops.

``F.ctc_loss`` reaches tn as ``aten._ctc_loss`` (the negative log-likelihood per
sample and the log-alphas it keeps for the gradient) and, for the gradient,
``aten._ctc_loss_backward``; with int-list lengths as the ``.default``
overloads (the lengths are compile-time constants), with tensor lengths (a
traced ``tn.jit`` input) as the ``.Tensor`` overloads, whose lengths are
values: every per-sample length becomes a mask computed from them, so either
form is one program with no value read.

The recursions follow torch's CPU kernel (``aten/src/ATen/native/LossCTC.cpp``)
operation for operation, vectorized over the batch and the blank-extended
target positions ``s`` (``E = 2 * max_target_length + 1``: blank, target 0,
blank, target 1, ..., blank), so the float32 results round as torch's do:

- alpha, over ``t = 1 .. T-1``: ``log(exp(a1 - m) + exp(a2 - m) + exp(a3 - m)) + m + lp[t, ext[s]]`` with
  ``a1 = alpha[s]``, ``a2 = alpha[s-1]``, ``a3 = alpha[s-2]`` where ``ext[s-2] != ext[s]`` (else -inf),
  ``m`` their maximum (0 when all are -inf); a sample past its input length keeps its last row;
- the loss: ``-log(exp(l1 - m) + exp(l2 - m)) - m`` of the last two positions at the sample's last step
  (``-alpha[0]`` of an empty target; 0 or inf for an empty input);
- beta, over ``t = T-2 .. 0``, the mirror image; the collected ``log sum alpha * beta`` per class is
  accumulated over ``s`` in torch's (descending) order, one pairwise logsumexp at a time, for all steps at
  once; the gradient is ``(exp(lp) - exp(collected + nll - lp)) * grad``, zero past each input length and,
  with ``zero_infinity``, for samples whose loss is infinite.

For ``torch.compile`` the module also registers, once at import, the shape rules torch lacks (fake
implementations of ``_ctc_loss``, Meta kernels of ``_ctc_loss_backward``, and ``ctc_loss``'s composite in ops
fake tensors can run; see :func:`_register_shape_rules`), so Dynamo captures ``F.ctc_loss`` into a graph
instead of breaking it, and the ops above reach tn's backend.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import _disable_current_modes

from .core import host
from .linalg import _gated_conv
from .table import decomposition, from_aten

aten = torch.ops.aten
Tensor = torch.Tensor
NEG = float("-inf")

# float32 decomposes (below); the loss of other dtypes (float64: the chip has no such arithmetic) is one counted
# host op instead of a recursion of host equations. The gradient and the .Tensor overloads have no meta kernel in
# torch (tn's shape rules below serve torch.compile's fake tensors only: the .Tensor width needs one), so they always
# decompose (float64: equations on the host, counted).
from_aten(host, aten._ctc_loss.default)(_gated_conv(aten._ctc_loss.default))

#: tn's registrations of the shape rules below (kept alive: a Library deregisters what it holds when collected).
_SHAPES_LIB: Optional[torch.library.Library] = None


def _fake_ctc_loss(log_probs: Tensor, targets: Tensor, input_lengths: Sequence[int], target_lengths: Sequence[int],
                   blank: int = 0, zero_infinity: bool = False) -> Tuple[Tensor, Tensor]:
    """Result shapes of ``aten._ctc_loss.default`` (int-list lengths): ``nll [N]`` and ``log_alpha
    [N, T, 2 * max(target_lengths) + 1]``, as torch's own meta kernel allocates them."""
    t_max, n = log_probs.shape[0], log_probs.shape[1]
    smax = 0
    for v in target_lengths:   # lengths are >= 0 (SymInts once Dynamo makes them dynamic)
        smax = torch.sym_max(smax, v)
    return (log_probs.new_empty([n]), log_probs.new_empty([n, t_max, 2 * smax + 1]))


def _fake_ctc_loss_tensor(log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
                          blank: int = 0, zero_infinity: bool = False) -> Tuple[Tensor, Tensor]:
    """Result shapes of ``aten._ctc_loss.Tensor`` (tensor lengths): ``nll [N]`` and ``log_alpha [N, T, E]``
    with ``E = 2 * max(target_lengths) + 1`` in torch's kernel, a size only the values give: a new unbacked
    size here. ``log_alpha`` is read only by ``_ctc_loss_backward``, which takes ``E`` from the tensor it is
    given and reads ``s <= 2 L`` only: tn's decomposition fills it at its static bound ``2 * S + 1`` (``S``
    the padded targets' width, or the concatenated targets' total length), torch's CPU kernel at the exact
    value."""
    t_max, n = log_probs.shape[0], log_probs.shape[1]
    e = torch.library.get_ctx().new_dynamic_size(min=1)
    return (log_probs.new_empty([n]), log_probs.new_empty([n, t_max, e]))


def _fake_ctc_loss_backward(grad: Tensor, log_probs: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Result shape of ``aten._ctc_loss_backward`` (either overload): the gradient is shaped as ``log_probs``
    (contiguous, as torch's kernel allocates it)."""
    return torch.empty_like(log_probs, memory_format=torch.contiguous_format)


@contextlib.contextmanager
def _log_alpha_dropped() -> Iterator[None]:
    """Around a ``_ctc_loss.Tensor`` call whose ``log_alpha`` is dropped: when nothing records the call as a
    graph node (Dynamo running ``ctc_loss`` as one call on fake tensors; no proxy mode), the unbacked width of
    that ``log_alpha`` reaches no output and is discarded, as Dynamo requires to be said. Where the call is
    recorded (AOTAutograd's trace), the node carries the size and the backward reads it."""
    mode = detect_fake_mode()
    if mode is None or mode.shape_env is None or get_proxy_mode() is not None:
        yield
        return
    with mode.shape_env.ignore_fresh_unbacked_symbols():
        yield


def _ctc_loss_composite(log_probs: Tensor, targets: Tensor, input_lengths: Any, target_lengths: Any, blank: int = 0,
                        reduction: int = 1, zero_infinity: bool = False) -> Tensor:
    """``aten.ctc_loss`` (both overloads) as torch's C++ composite computes it (``ctc_loss_impl`` in
    ``LossCTC.cpp``: an unbatched input gains a batch axis, ``_ctc_loss`` with int64 targets, infinite losses
    zeroed with ``zero_infinity``, then the reduction: ``mean`` divides each loss by its target length
    clamped to 1 and averages), in ops fake tensors can run: the C++ composite builds the int-list lengths'
    tensor with ``at::tensor``, which writes host memory a fake tensor does not have. Used only where torch's
    Python dispatcher is on (Dynamo's and AOTAutograd's tracing); eager PyTorch keeps its C++ kernel."""
    batched = log_probs.dim() == 3
    lp = log_probs if batched else aten.unsqueeze.default(log_probs, 1)
    tg = aten._to_copy.default(targets, dtype=torch.int64, device=lp.device)
    if isinstance(input_lengths, Tensor) or isinstance(target_lengths, Tensor):
        with _log_alpha_dropped():
            res = aten._ctc_loss.Tensor(lp, tg, input_lengths, target_lengths, blank, zero_infinity)[0]
    else:
        res = aten._ctc_loss.default(lp, tg, input_lengths, target_lengths, blank, zero_infinity)[0]
    if zero_infinity:
        res = aten.where.self(aten.eq.Scalar(res, float("inf")), aten.zeros_like.default(res), res)
    if reduction == 1:                                                              # mean
        if isinstance(target_lengths, Tensor):
            tl = target_lengths
        else:
            tl = aten.stack.default([aten.scalar_tensor.default(v, dtype=res.dtype, device=res.device)
                                     for v in target_lengths]) if len(target_lengths) else \
                _full([0], 0, res)
        return aten.mean.default(aten.div.Tensor(res, aten.clamp_min.default(tl, 1)))
    if reduction == 2:                                                              # sum
        return aten.sum.default(res)
    return res if batched else aten.squeeze.dim(res, 0)


def _register_shape_rules() -> None:
    """Give the fake tensors of ``torch.compile`` (Dynamo, AOTAutograd) the CTC ops' result shapes, once, at
    import, so ``F.ctc_loss`` is captured into a graph and reaches a backend instead of graph-breaking.

    torch 2.13 has none that fake tensors can use: ``aten._ctc_loss`` (both overloads) is tagged
    ``dynamic_output_shape``, and fake tensors refuse such ops unless a fake implementation is registered
    (torch's C++ meta kernel of ``.default`` is never consulted); ``_ctc_loss_backward`` has no meta kernel at
    all. So: a fake implementation for each ``_ctc_loss`` overload that has none (``torch.library.register_fake``,
    which also installs it as the Meta kernel: for ``.default`` it allocates what torch's C++ meta kernel
    does), and a Meta kernel for each ``_ctc_loss_backward`` overload that has none. A later torch that ships
    its own keeps it: nothing is registered over an existing fake implementation or backward Meta kernel."""
    global _SHAPES_LIB
    if _SHAPES_LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    registry = torch._library.simple_registry.singleton
    for ov, rule in ((aten._ctc_loss.default, _fake_ctc_loss), (aten._ctc_loss.Tensor, _fake_ctc_loss_tensor)):
        if registry.find(ov.name()).fake_impl.kernel is None:
            torch.library.register_fake(ov.name(), rule, lib=lib)
    for ov in (aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(ov.name(), "Meta"):
            lib.impl(ov.name().split("::", 1)[1], _fake_ctc_loss_backward, "Meta")
    for ov in (aten.ctc_loss.IntList, aten.ctc_loss.Tensor):
        if torch._C.DispatchKey.CompositeImplicitAutograd not in ov.py_kernels:
            ov.py_impl(torch._C.DispatchKey.CompositeImplicitAutograd)(_ctc_loss_composite)
    _SHAPES_LIB = lib


_register_shape_rules()


def _full(shape: Sequence[int], value: Any, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A tensor of ``value`` on ``like``'s device (in ``like``'s dtype unless ``dtype`` is given)."""
    return aten.full.default(list(shape), value, dtype=dtype or like.dtype, device=like.device)


def _lse(*xs: Tensor) -> Tensor:
    """``log(sum exp(x - m)) + m`` with ``m`` the elementwise maximum (0 where every term is -inf), the terms
    summed left to right: torch's kernel's logsumexp of two or three terms."""
    m = xs[0]
    for x in xs[1:]:
        m = aten.maximum.default(m, x)
    m = aten.where.self(aten.eq.Scalar(m, NEG), aten.zeros_like.default(m), m)
    s = aten.exp.default(aten.sub.Tensor(xs[0], m))
    for x in xs[1:]:
        s = aten.add.Tensor(s, aten.exp.default(aten.sub.Tensor(x, m)))
    return aten.add.Tensor(aten.log.default(s), m)


def _shift(x: Tensor, k: int) -> Tensor:
    """Along the last axis: ``y[..., s] = x[..., s - k]``, -inf (False for a bool ``x``) where ``s - k``
    falls outside."""
    e = x.shape[-1]
    fill = False if x.dtype == torch.bool else NEG
    if abs(k) >= e:
        return _full(x.shape, fill, x)
    pad = _full(list(x.shape[:-1]) + [abs(k)], fill, x)
    if k > 0:
        return aten.cat.default([pad, aten.slice.Tensor(x, -1, 0, e - k)], -1)
    return aten.cat.default([aten.slice.Tensor(x, -1, -k, e), pad], -1)


def _lengths(v: Any) -> Tuple[Tensor, Optional[List[int]]]:
    """A lengths argument as an int64 ``[N]`` tensor (a constant of the trace for an int list) and, for an
    int list, the Python values."""
    if isinstance(v, Tensor):
        return aten._to_copy.default(v, dtype=torch.int64), None
    vals = [int(a) for a in v]
    with _disable_current_modes():   # a constant of the trace
        t = torch.tensor(vals, dtype=torch.int64)
    return t, vals


class _Setup:
    """What the loss and its gradient share: the lengths as tensors, the blank-extended targets ``ext``
    ``[N, E]``, their log-probabilities ``lpe`` ``[T, N, E]`` and the masks of the recursions."""

    def __init__(self, log_probs: Tensor, targets: Tensor, input_lengths: Any, target_lengths: Any, blank: int,
                 e: Optional[int] = None):
        lp = log_probs
        t_max, n = int(lp.shape[0]), int(lp.shape[1])
        self.t_max, self.n = t_max, n
        self.il, il_vals = _lengths(input_lengths)
        self.tl, tl_vals = _lengths(target_lengths)
        if e is None:
            if tl_vals is not None:
                smax = max(tl_vals) if tl_vals else 0
            elif targets.dim() == 2:
                smax = int(targets.shape[1])       # torch requires targets.size(1) >= every target length
            else:
                smax = int(targets.shape[0])       # concatenated: no target is longer than all of them
            e = 2 * smax + 1
        smax = (e - 1) // 2
        self.e = e
        # the last step that runs the recursion: the input length, or the whole input when lengths are static
        self.t_run = max(il_vals) if il_vals is not None and il_vals else t_max
        tl = aten.view.default(self.tl, [n, 1])
        pos = aten.view.default(aten.arange.default(e, dtype=torch.int64, device=lp.device), [1, e])
        self.svalid = aten.lt.Tensor(pos, aten.add.Tensor(aten.mul.Tensor(tl, 2), 1))       # s <= 2 L
        if smax > 0:
            j = aten.view.default(aten.arange.default(smax, dtype=torch.int64, device=lp.device), [1, smax])
            if targets.dim() == 2:
                tg = aten.slice.Tensor(targets, 1, 0, smax)
            else:                                                    # concatenated: row b starts at sum(L[:b])
                total = int(targets.shape[0])
                offs = aten.sub.Tensor(aten.cumsum.default(self.tl, 0), self.tl)
                rows = aten.add.Tensor(aten.view.default(offs, [n, 1]), j)
                rows = aten.clamp.default(rows, 0, max(total - 1, 0))   # past a target's end: masked below
                tg = aten.index.Tensor(targets, [rows]) if total else _full([n, smax], blank, lp, torch.int64)
            tg = aten._to_copy.default(tg, dtype=torch.int64)
            tg = aten.where.self(aten.lt.Tensor(j, tl), tg, _full([n, smax], blank, lp, torch.int64))
            blanks = _full([n, smax], blank, lp, torch.int64)
            ext = aten.view.default(aten.stack.default([blanks, tg], 2), [n, 2 * smax])
            ext = aten.cat.default([ext, _full([n, 1], blank, lp, torch.int64)], 1)
        else:
            ext = _full([n, 1], blank, lp, torch.int64)
        self.ext = ext
        self.lpe = aten.gather.default(lp, 2, aten.expand.default(aten.unsqueeze.default(ext, 0), [t_max, n, e]))
        # alpha[s] may come from s - 2: s > 1 and a target (not a blank) differing from the one before it
        if e >= 3:
            prev2 = aten.slice.Tensor(ext, 1, 0, e - 2)
            differ = aten.ne.Tensor(aten.slice.Tensor(ext, 1, 2, e), prev2)
            self.skip = aten.cat.default([_full([n, 2], False, lp, torch.bool), differ], 1)
        else:
            self.skip = _full([n, e], False, lp, torch.bool)

    def live(self, t: int) -> Tensor:
        """``[N, 1]``: the samples whose input is longer than ``t``."""
        return aten.view.default(aten.gt.Scalar(self.il, t), [self.n, 1])

    def at_last(self, x: Tensor, t_last: Tensor) -> Tensor:
        """``x[b, s]`` at ``s = t_last[b]`` (``[N]`` int64), clamped into range."""
        idx = aten.view.default(aten.clamp.default(t_last, 0, self.e - 1), [self.n, 1])
        return aten.view.default(aten.gather.default(x, 1, idx), [self.n])


def _forward(log_probs: Tensor, targets: Tensor, input_lengths: Any, target_lengths: Any, blank: int
             ) -> Tuple[Tensor, Tensor]:
    if log_probs.dim() != 3 or not log_probs.dtype.is_floating_point:
        return NotImplemented
    su = _Setup(log_probs, targets, input_lengths, target_lengths, blank)
    n, e, lp = su.n, su.e, log_probs
    neg = _full([n, e], NEG, lp)
    pos = aten.view.default(aten.arange.default(e, dtype=torch.int64, device=lp.device), [1, e])
    first = aten.logical_and.default(aten.lt.Scalar(pos, 2), su.svalid)      # alpha_0: blank and target 0
    alpha = aten.where.self(first, aten.select.int(su.lpe, 0, 0), neg)
    alphas = [alpha]
    for t in range(1, su.t_max):
        if t >= su.t_run:          # static lengths: every sample has stopped; its rows are never read
            alphas.append(alpha)
            continue
        new = _lse(alpha, _shift(alpha, 1), aten.where.self(su.skip, _shift(alpha, 2), neg))
        new = aten.where.self(su.svalid, aten.add.Tensor(new, aten.select.int(su.lpe, 0, t)), neg)
        alpha = aten.where.self(su.live(t), new, alpha)
        alphas.append(alpha)
    l1 = su.at_last(alpha, aten.mul.Tensor(su.tl, 2))
    l2 = su.at_last(alpha, aten.sub.Tensor(aten.mul.Tensor(su.tl, 2), 1))
    ll = aten.where.self(aten.gt.Scalar(su.tl, 0), _lse(l1, l2), l1)    # an empty target: alpha[0] alone
    empty_input = aten.where.self(aten.eq.Scalar(su.tl, 0), _full([n], 0.0, lp), _full([n], NEG, lp))
    ll = aten.where.self(aten.eq.Scalar(su.il, 0), empty_input, ll)
    return aten.neg.default(ll), aten.stack.default(alphas, 1)


@decomposition(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def _ctc_loss(log_probs: Tensor, targets: Tensor, input_lengths: Any, target_lengths: Any, blank: int = 0,
              zero_infinity: bool = False) -> Tuple[Tensor, Tensor]:
    """``(neg_log_likelihood [N], log_alpha [N, T, E])`` of the CTC loss (``zero_infinity`` only matters to
    the gradient, as in torch): torch's alpha recursion unrolled over time, see the module docstring."""
    return _forward(log_probs, targets, input_lengths, target_lengths, blank)


@decomposition(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward(grad: Tensor, log_probs: Tensor, targets: Tensor, input_lengths: Any, target_lengths: Any,
                       nll: Tensor, log_alpha: Tensor, blank: int, zero_infinity: bool = False) -> Tensor:
    """Gradient of the CTC loss with respect to ``log_probs`` ``[T, N, C]``, as torch's kernel computes it
    (beta recursion, the per-class collection in torch's order, the closing formula; see the module
    docstring). ``log_alpha`` is read only where torch's kernel wrote it (``t`` below the input length,
    ``s <= 2 L``)."""
    if log_probs.dim() != 3 or log_alpha.dim() != 3 or not log_probs.dtype.is_floating_point:
        return NotImplemented
    lp = log_probs
    su = _Setup(lp, targets, input_lengths, target_lengths, blank, e=int(log_alpha.shape[2]))
    t_max, n, e = su.t_max, su.n, su.e
    c = int(lp.shape[2])
    neg = _full([n, e], NEG, lp)
    tl2 = aten.view.default(aten.mul.Tensor(su.tl, 2), [n, 1])
    pos = aten.view.default(aten.arange.default(e, dtype=torch.int64, device=lp.device), [1, e])
    ends = aten.logical_and.default(aten.ge.Tensor(pos, aten.sub.Tensor(tl2, 1)), su.svalid)  # s = 2L-1, 2L
    # beta[s] may come from s + 2 when alpha[s + 2] may come from s
    skip_next = _shift(su.skip, -2)
    il1 = aten.view.default(aten.sub.Tensor(su.il, 1), [n, 1])
    betas: List[Tensor] = [neg] * t_max
    beta = neg
    for t in range(min(su.t_run, t_max) - 1, -1, -1):
        lpt = aten.select.int(su.lpe, 0, t)
        rec = _lse(beta, _shift(beta, -1), aten.where.self(skip_next, _shift(beta, -2), neg))
        rec = aten.where.self(su.svalid, aten.add.Tensor(rec, lpt), neg)
        start = aten.where.self(ends, lpt, neg)
        beta = aten.where.self(aten.eq.Scalar(il1, t), start, aten.where.self(aten.gt.Scalar(il1, t), rec, neg))
        betas[t] = beta
    # where torch's kernel wrote log_alpha (t below the input length, s <= 2L); elsewhere beta is -inf anyway
    written = aten.logical_and.default(
        aten.view.default(su.svalid, [n, 1, e]),
        aten.lt.Tensor(aten.view.default(aten.arange.default(t_max, dtype=torch.int64, device=lp.device),
                                         [1, t_max, 1]), aten.view.default(su.il, [n, 1, 1])))
    la = aten.where.self(written, log_alpha, _full([n, t_max, e], NEG, lp))
    ab = aten.add.Tensor(aten.permute.default(la, [1, 0, 2]), aten.stack.default(betas, 0))     # [T, N, E]
    # collected[t, b, c] "log+=" ab[t, b, s] over s = 2L .. 0 (descending: torch's order), all t at once
    lcab = _full([t_max, n, c], NEG, lp)
    classes = aten.view.default(aten.arange.default(c, dtype=torch.int64, device=lp.device), [1, 1, c])
    for s in range(e - 1, -1, -1):
        cls = aten.select.int(su.ext, 1, s)                                              # [N]
        idx = aten.expand.default(aten.view.default(cls, [1, n, 1]), [t_max, n, 1])
        cur = aten.gather.default(lcab, 2, idx)                                          # [T, N, 1]
        x = aten.view.default(aten.select.int(ab, 2, s), [t_max, n, 1])
        new = aten.where.self(aten.eq.Scalar(cur, NEG), x, _lse(cur, x))
        new = aten.where.self(aten.eq.Scalar(x, NEG), cur, new)     # log(exp(0) + 0) + cur is cur exactly
        hit = aten.eq.Tensor(classes, aten.view.default(cls, [1, n, 1]))
        lcab = aten.where.self(hit, new, lcab)
    nl = aten.view.default(nll, [1, n, 1])
    g = aten.mul.Tensor(aten.sub.Tensor(aten.exp.default(lp),
                                        aten.exp.default(aten.sub.Tensor(aten.add.Tensor(lcab, nl), lp))),
                        aten.view.default(grad, [1, n, 1]) if grad.dim() else grad)
    keep = aten.lt.Tensor(aten.view.default(aten.arange.default(t_max, dtype=torch.int64, device=lp.device),
                                            [t_max, 1, 1]), aten.view.default(su.il, [1, n, 1]))
    if zero_infinity:
        keep = aten.logical_and.default(keep, aten.ne.Scalar(nl, float("inf")))
    return aten.where.self(keep, g, aten.zeros_like.default(g))
