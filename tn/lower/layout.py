# Weight layouts: Linear weights kept in HBM pre-transposed and tiled for TensorE, made once by a layout program and cached.
"""Device layouts of weights (the *layout cache*).

A ``Linear`` layer multiplies by ``W^T`` where ``W`` is ``[out, in]``. TensorE
contracts over the partition axis, so the matmul needs ``W^T`` with ``in`` on
the partitions; ``W`` as it lies in HBM has ``out`` on the rows, and reading it
transposed by DMA moves one element per descriptor. Without help every call
transposes every 128x128 block of every weight on TensorE (as many TensorE
cycles as the matmuls themselves at 128 tokens, twice as many at 64).

A compiler that owns the weights' device memory lays them out once in the
layout its kernels want (XLA's parameter layouts on TPU, neuronx-cc's weight
pre-layout, JAX's ``Layout.AUTO``). tn does the same at run time:

* **Layout** (:func:`b_layout`): ``W`` ``[N, K]`` (``N = out``, ``K = in``)
  becomes ``T[g, p, kc, j] = W[g*ngw + j, kc*128 + p]``, shape
  ``[NG, KP, KC, ngw]`` (``KP = min(128, K)``, ``KC = ceil(K/128)``, groups
  of ``ngw`` output columns, zero padded). Group ``g`` is the matmul's
  B panel ``[KP (k), KC, ngw]`` (B = W^T) exactly as it sits in SBUF: one DMA
  of one contiguous run per partition (``KC*ngw*itemsize`` bytes, >= 8 KiB when
  the weight allows), no TensorE transposes.
* **Layout program** (:func:`layout_program`): a NeuronCore program that reads
  ``W``, transposes its blocks on TensorE and writes ``T``. It runs on the
  device like any program, so its time and traffic show in ``tn.profile()``
  when (and only when) it runs.
* **Cache** (:func:`lookup` / :func:`make`): ``T`` is kept per source tensor,
  keyed weakly by its storage (the entry dies with the weight), and is valid
  while the tensor has the same storage, offset, shape, strides, version
  counter (``tensor._version``: every in-place op, optimizer step,
  ``load_state_dict`` bumps it) and a sampled fingerprint of its values
  (catches writes through ``.data``, which bypass the version counter).
  A stale entry is replaced by the next layout of that weight;
  :func:`clear` empties the cache.

When the compiled program uses the cached layout is decided per call by
:class:`LayoutPolicy` (see there): the plain program, which transposes on
chip, stays in use while the weights change between calls (training).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import ArgumentValueError
from ..neuron import Program, get_arch, isa
from ..neuron.arch import NUM_ENGINES
from ..neuron.runtime import run
from .base import NEURON_DTYPES

__all__ = ["BLayout", "b_layout", "layout_program", "lookup", "make", "clear", "cache_info", "LayoutPolicy"]

_P = 128
_RUN_BYTES = 8192    # target contiguous bytes per partition of one layout group


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BLayout:
    """Tiled ``W^T`` layout of a ``[N, K]`` weight: HBM shape ``[NG, KP, KC, ngw]`` (see the module docstring)."""

    __slots__ = ("N", "K", "dtype", "ngw", "KP", "KC", "NG")

    def __init__(self, N: int, K: int, dtype: str, ngw: int):
        self.N, self.K, self.dtype, self.ngw = int(N), int(K), dtype, int(ngw)
        self.KP = min(_P, self.K)
        self.KC = _cdiv(self.K, _P)
        self.NG = _cdiv(self.N, self.ngw)

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """HBM shape of the laid-out tensor."""
        return (self.NG, self.KP, self.KC, self.ngw)

    @property
    def key(self) -> tuple:
        """Hashable identity of the layout."""
        return ("bT", self.N, self.K, self.dtype, self.ngw)

    def __repr__(self) -> str:
        return f"BLayout(N={self.N}, K={self.K}, {self.dtype}, ngw={self.ngw}, shape={self.shape})"


def b_layout(N: int, K: int, dtype: str) -> BLayout:
    """The layout used for a ``[N, K]`` weight read as ``B = W^T`` by a matmul.

    ``ngw``: a multiple of 128 giving runs of at least 8 KiB per partition (a
    multiple of 512, whole PSUM banks, when that keeps a group within 16 KiB per
    partition), at most ``N`` rounded up to 128.
    """
    isz = isa.DTYPE_SIZES[isa.dtype_code(dtype)]
    KC = _cdiv(K, _P)
    if N <= _P:
        ngw = N
    else:
        ngw = _cdiv(max(1, _RUN_BYTES // (KC * isz)), _P) * _P
        if N >= 512 and KC * 512 * isz <= 2 * _RUN_BYTES:
            ngw = _cdiv(ngw, 512) * 512
        ngw = min(ngw, _cdiv(N, _P) * _P)
    return BLayout(N, K, dtype, ngw)


# --------------------------------------------------------------------------- the layout program

#: (weight dtype, layout dtype) pairs a layout program converts while laying out: a weight the program casts for
#: its matmul (``convert(W)`` under autocast) is laid out already cast.
CAST_LAYOUTS = frozenset({("float32", "bfloat16"), ("float32", "float16")})
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_PROGRAMS: Dict[tuple, Any] = {}
_PROG_LOCK = threading.Lock()


def layout_program(lay: BLayout, arch: Any = None, src_dtype: Optional[str] = None) -> Any:
    """The encoded program ``wt = layout(w)`` (HBM ``w`` ``[N, K]`` input, ``wt`` ``lay.shape`` output), cached.

    ``src_dtype``: the dtype of ``w`` when it is not the layout's (an fp32 weight a program converts to bf16
    before its matmul, as under autocast): each staged block is converted on VectorE (rounded as the program's
    ``convert`` rounds) before the transposes, so the layout holds exactly what the program would transpose."""
    arch = get_arch(arch)
    src_dtype = src_dtype or lay.dtype
    key = (lay.key, src_dtype, arch.name)
    with _PROG_LOCK:
        enc = _PROGRAMS.get(key)
    if enc is not None:
        return enc

    N, K, dt, ngw, KP, KC, NG = lay.N, lay.K, lay.dtype, lay.ngw, lay.KP, lay.KC, lay.NG
    isz = isa.DTYPE_SIZES[isa.dtype_code(dt)]
    cast = src_dtype != dt
    prog = Program(f"tn_layout_w{N}x{K}_{src_dtype + '_to_' if cast else ''}{dt}", arch, record_sources=False)
    w = prog.hbm("w", (N, K), src_dtype, kind="input")
    wt = prog.hbm("wt", lay.shape, dt, kind="output")
    G = max(1, min(arch.psum_bank_bytes // (_P * isz), 8))   # transposes per PSUM bank
    tiles = []

    def sb(shape, name):
        t = prog.sbuf(shape, dt, name=name)
        tiles.append(t)
        return t

    out_bufs = [sb((KP, KC, ngw), f"lay_out{i}") for i in range(2)]
    stages = [sb((_P, K), f"lay_stage{i}") for i in range(3)]
    raw = []
    if cast:
        raw = [prog.sbuf((_P, K), src_dtype, name=f"lay_raw{i}") for i in range(2)]
        tiles.extend(raw)
    tps = [prog.psum((_P, G, _P), dt, name=f"lay_tp{i}") for i in range(2)]
    ns = nt = no = nc = 0
    pad_k = K % _P != 0 and KC > 1
    for g in range(NG):
        n0 = g * ngw
        nw = min(ngw, N - n0)
        T = out_bufs[no % 2]
        no += 1
        if pad_k or nw < ngw:
            prog.memset(T, 0.0, engine="gpsimd")
        for s0 in range(0, nw, _P):
            sp = min(_P, nw - s0)
            st = stages[ns % 3]
            ns += 1
            step = G * _P
            land = raw[ns % 2] if cast else st
            for c0 in range(0, K, step):     # one DMA per PSUM bank of transposes: the first start early
                c1 = min(K, c0 + step)
                prog.dma_copy(land[:sp, c0:c1], w[n0 + s0:n0 + s0 + sp, c0:c1])
                if cast:
                    prog.tensor_copy(st[:sp, c0:c1], land[:sp, c0:c1], engine="vector")
            for q0 in range(0, KC, G):
                q1 = min(KC, q0 + G)
                tp = tps[nt % 2]
                nt += 1
                for q in range(q0, q1):
                    kp = min(_P, K - q * _P)
                    prog.transpose(tp[:kp, q - q0, :sp], st[:sp, q * _P:q * _P + kp])
                r0 = q0
                while r0 < q1:       # one copy per run of equal-height blocks
                    kp = min(_P, K - r0 * _P)
                    r1 = r0 + 1
                    while r1 < q1 and min(_P, K - r1 * _P) == kp:
                        r1 += 1
                    nc += 1
                    prog.tensor_copy(T[:kp, r0:r1, s0:s0 + sp], tp[:kp, r0 - q0:r1 - q0, :sp],
                                     engine="vector" if nc % 2 else "scalar")
                    r0 = r1
        prog.dma_copy(wt[g], T)
    for t in tps:
        prog.free(t)
    for t in reversed(tiles):
        prog.free(t)
    enc = prog.build(check=True)
    with _PROG_LOCK:
        _PROGRAMS[key] = enc
    return enc


# --------------------------------------------------------------------------- the cache

_FP_SAMPLES = 64


class _Entry:
    __slots__ = ("meta", "version", "fp", "value")

    def __init__(self, meta, version, fp, value):
        self.meta, self.version, self.fp, self.value = meta, version, fp, value


_CACHE: Dict[int, Dict[tuple, _Entry]] = {}     # id(storage) -> {(meta, layout key): entry}
_REFS: Dict[int, Any] = {}                        # id(storage) -> weakref to the storage (drops the entries)
_LOCK = threading.Lock()
_STATS = {"hits": 0, "layouts": 0, "stale": 0}


def _meta(t: torch.Tensor) -> tuple:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A few values sampled across ``t`` (as raw bits), compared on every lookup."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= _FP_SAMPLES:
        s = flat.clone()
    else:
        # integer spacing: a float32 linspace rounds n - 1 up past the end for n > 2**24
        idx = torch.arange(_FP_SAMPLES, dtype=torch.int64) * (n - 1) // (_FP_SAMPLES - 1)
        s = flat[idx]
    if s.device.type != "cpu":
        s = s.cpu()
    return s.view(torch.int16) if s.element_size() == 2 else (s.view(torch.int32) if s.element_size() == 4 else s)


def _storage(t: torch.Tensor) -> Any:
    return t.untyped_storage()


def _drop(sid: int) -> None:
    with _LOCK:
        _CACHE.pop(sid, None)
        _REFS.pop(sid, None)


def lookup(t: torch.Tensor, lay: BLayout) -> Optional[torch.Tensor]:
    """The cached layout of ``t`` if it is still valid (same storage, view, version and fingerprint), else None."""
    st = _storage(t)
    sid = id(st)
    with _LOCK:
        ref = _REFS.get(sid)
        if ref is None or ref() is not st:
            return None
        e = _CACHE.get(sid, {}).get((_meta(t), lay.key))
    if e is None:
        return None
    if e.version != t._version or not torch.equal(e.fp, fingerprint(t)):
        _STATS["stale"] += 1
        with _LOCK:        # the weight changed: free the old layout now
            d = _CACHE.get(sid)
            if d is not None:
                d.pop((_meta(t), lay.key), None)
        return None
    _STATS["hits"] += 1
    return e.value


def make(t: torch.Tensor, lay: BLayout, arch: Any = None) -> Tuple[torch.Tensor, Any]:
    """Run the layout program on ``t`` and cache the result: ``(laid-out tensor, RunResult)``."""
    src_dtype = NEURON_DTYPES.get(t.dtype)
    if tuple(t.shape) != (lay.N, lay.K) or not (src_dtype == lay.dtype or (src_dtype, lay.dtype) in CAST_LAYOUTS):
        raise ArgumentValueError(f"layout {lay} does not match tensor {tuple(t.shape)} {t.dtype}")
    src = t.detach()
    if src.device.type not in ("cpu", "neuron", "privateuseone"):
        src = src.cpu()
    if not src.is_contiguous():
        src = src.contiguous()
    out = torch.zeros(lay.shape, dtype=t.dtype if src_dtype == lay.dtype else TORCH_DTYPES[lay.dtype])
    res = run(layout_program(lay, arch, src_dtype), {"w": src, "wt": out})
    st = _storage(t)
    sid = id(st)
    with _LOCK:
        ref = _REFS.get(sid)
        if ref is None or ref() is not st:
            _CACHE[sid] = {}
            _REFS[sid] = weakref.ref(st, lambda _r, sid=sid: _drop(sid))
        _CACHE[sid][(_meta(t), lay.key)] = _Entry(_meta(t), t._version, fingerprint(t), out)
    _STATS["layouts"] += 1
    return out, res


def clear() -> None:
    """Forget every cached layout (the next call of a compiled program lays its weights out again)."""
    with _LOCK:
        _CACHE.clear()
        _REFS.clear()


def cache_info() -> dict:
    """``{"tensors", "bytes", "hits", "layouts", "stale"}``: cached weights, their bytes, and counters."""
    with _LOCK:
        n = sum(len(d) for d in _CACHE.values())
        nbytes = sum(e.value.numel() * e.value.element_size() for d in _CACHE.values() for e in d.values())
    return {"tensors": n, "bytes": nbytes, **_STATS}


# --------------------------------------------------------------------------- when to use it

class LayoutPolicy:
    """Per executable: decides on each call whether the laid-out variant runs.

    ``inputs``: ``(input index, BLayout)`` of the weights the variant reads laid
    out. A weight is *steady* on a call when

    * its cached layout is valid (same tensor, unchanged), or
    * it is the same unchanged tensor (storage, view, version) as on this
      executable's previous call, or
    * it is an ``nn.Parameter`` that this executable has not yet seen change
      (parameters are weights until proven otherwise).

    When every weight is steady the missing layouts are made (a layout program
    per weight, counted in the profile) and the laid-out variant runs; otherwise
    the plain program runs (it transposes on chip: no extra HBM traffic while
    weights change every call, as in training) and the call is remembered.
    """

    def __init__(self, inputs: List[Tuple[int, BLayout]]):
        self.inputs = list(inputs)
        self._seen: Dict[int, tuple] = {}
        self._changed: set = set()

    @staticmethod
    def _state(t: torch.Tensor) -> tuple:
        return (weakref.ref(_storage(t)), _meta(t), t._version)

    def _same(self, i: int, t: torch.Tensor) -> bool:
        s = self._seen.get(i)
        return s is not None and s[0]() is _storage(t) and s[1] == _meta(t) and s[2] == t._version

    def choose(self, tensors, arch: Any) -> Optional[Tuple[List[torch.Tensor], list]]:
        """``(laid-out tensors in ``inputs`` order, RunResults of layout programs run)`` or None (plain)."""
        found: List[Optional[torch.Tensor]] = []
        steady = True
        for i, lay in self.inputs:
            t = tensors[i]
            v = lookup(t, lay)
            found.append(v)
            if v is not None:
                continue
            if self._same(i, t):
                continue
            if i in self._seen:
                self._changed.add(i)
            if isinstance(t, torch.nn.Parameter) and i not in self._changed:
                continue
            steady = False
        for i, _ in self.inputs:
            t = tensors[i]
            self._seen[i] = self._state(t)
        if not steady:
            return None
        runs = []
        out = []
        for (i, lay), v in zip(self.inputs, found):
            if v is None:
                v, res = make(tensors[i], lay, arch)
                runs.append(res)
            out.append(v)
        return out, runs


# --------------------------------------------------------------------------- streaming laid-out weights

class WeightStream:
    """The laid-out weight groups a program multiplies by, streamed through a ring of SBUF slots.

    The compiler plans, per program, the order in which lowerings will consume
    laid-out weight groups (``seq``: ``(key, BLayout, group)``, ``key`` any hashable
    naming the weight) and reserves ``nslots`` slots of the largest group at the
    program's start (as many as fit in ``budget`` bytes per partition, at least 3
    and at most ``2 * (ahead + 1)``: slots beyond those are never in flight together
    and would only take SBUF from the lowerings, whose matmuls then split K into
    panels and stop reading the stream; BERT-base b1 s128 on trn1: 2.71 -> 2.33 ms
    going from ten 12 KiB slots to four), so the slots never alias the tiles of other lowerings (weights
    are named by their HbmTensor, compared by ``index``). A
    consumer calls :meth:`get` for the next group it multiplies by; the stream then
    issues the DMAs of that group and of the next ``ahead`` ones.

    Why many slots but a short lookahead: the DMA pipe serves transfers in
    program order (an earlier-emitted DMA has priority), so a weight DMA emitted
    long before its use would delay the activation traffic of the lowerings in
    between. Emitted shortly before its use, into a slot that was freed long ago
    (``nslots`` groups earlier), on a DMA queue that is not waiting for compute,
    it starts early anyway and fills the pipe's idle time: the weights of the
    next lowering arrive while this one computes, behind its own traffic.
    Contract: a consumer reads group ``s`` only until it asks for group
    ``s + nslots - ahead`` (the slot of ``s`` is refilled then; the program's
    dependency tracking orders the refill after every read emitted before it).

    DMAs of the stream go to the DMA queue whose last instruction does not wait
    for a compute engine, directly or through the DMAs it waits for (queues
    execute in order: a weight load queued behind a store that waits for an
    epilogue would wait too, and so would one behind a load of what that store
    writes; BERT-base b1 s128 on trn1: 1.654 -> 1.566 ms looking through DMAs).
    """

    def __init__(self, prog: Any, seq: List[Tuple[Any, BLayout, int]], budget: int = 96 * 1024, ahead: int = 1):
        self.prog = prog
        self.seq = list(seq)
        self.pos = {(k.index, g): i for i, (k, _, g) in enumerate(self.seq)}
        self.dtype = self.seq[0][1].dtype
        isz = isa.DTYPE_SIZES[isa.dtype_code(self.dtype)]
        self.slot_elems = max(lay.KC * lay.ngw for _, lay, _ in self.seq)
        nslots = min(budget // (self.slot_elems * isz), 2 * (max(1, ahead) + 1))
        self.nslots = max(2, min(max(3, nslots), len(self.seq)))
        self.ahead = max(1, min(ahead, self.nslots - 1))
        self.slots = [prog.sbuf((_P, self.slot_elems), self.dtype, name=f"wstream{i}") for i in range(self.nslots)]
        self.slot_bytes = self.slot_elems * isz
        self.hbm: Dict[Any, Any] = {}        # key -> HbmTensor of the laid-out weight (set by the consumer)
        self.issued: Dict[int, Any] = {}
        self.next = 0                          # next position to hand out
        self._scan = 0
        self._last: Dict[int, int] = {}

    def close(self) -> None:
        """Free the slots (at the end of the program)."""
        for t in reversed(self.slots):
            self.prog.free(t)
        self.slots = []

    def _queue(self) -> int:
        """A DMA queue (0-based) whose last instruction does not wait for a compute engine, directly or through
        the DMAs it waits for (:meth:`_waits_compute`), least recently used."""
        prog = self.prog
        recs = prog._recs
        for i in range(self._scan, len(recs)):
            q = recs[i][isa.H_QUEUE]
            if q >= NUM_ENGINES:
                self._last[q - NUM_ENGINES] = i
        self._scan = len(recs)
        best = None
        for q in range(prog.arch.dma_queues):
            i = self._last.get(q, -1)
            blocked = i >= 0 and self._waits_compute(i)
            key = (blocked, i)
            if best is None or key < best[0]:
                best = (key, q)
        return best[1]

    def _waits_compute(self, i: int, depth: int = 4) -> bool:
        """Whether DMA ``i`` waits, directly or through up to ``depth`` DMAs it waits for, for a compute engine
        (queues run in order: a weight load queued behind it would wait for that compute too)."""
        recs, deps = self.prog._recs, self.prog._deps
        todo, seen = [(i, 0)], set()
        while todo:
            j, d = todo.pop()
            for k in deps[j]:
                if recs[k][isa.H_QUEUE] < NUM_ENGINES:
                    return True
                if d + 1 < depth and k not in seen:
                    seen.add(k)
                    todo.append((k, d + 1))
        return False

    def _issue(self, s: int) -> None:
        if s >= len(self.seq) or s in self.issued:
            return
        key, lay, g = self.seq[s]
        src = self.hbm.get(key.index, key)
        if src is None:
            return      # its consumer has not named the tensor yet: loaded when asked for
        slot = self.slots[s % self.nslots]
        view = slot[:, :lay.KC * lay.ngw].reshape(_P, lay.KC, lay.ngw)
        nw = min(lay.ngw, lay.N - g * lay.ngw)
        kp = min(_P, lay.K)
        self.prog.dma_copy(view[:kp, :, :nw], src[g, :kp, :, :nw], queue=self._queue())
        self.issued[s] = view

    def bind(self, key: Any, hbm: Any) -> None:
        """Name the HBM tensor of weight ``key`` (its groups can be prefetched from now on)."""
        self.hbm.setdefault(key.index, hbm)

    def get(self, key: Any, g: int) -> Optional[Any]:
        """The SBUF view ``[128, KC, ngw]`` of group ``g`` of weight ``key`` (None when not the stream's next)."""
        s = self.pos.get((key.index, g))
        if s is None or s < self.next:
            return None
        self.next = s + 1
        for t in range(s, s + 1 + self.ahead):
            self._issue(t)
        return self.issued.pop(s, None)
