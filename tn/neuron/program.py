# The builder API of NeuronCore programs: declare HBM tensors, allocate SBUF/PSUM tiles, emit instructions, encode.
"""Build NeuronCore programs: the target of tn's compiler and of hand-written kernels.

A :class:`Program` holds HBM tensor declarations, an SBUF and a PSUM
allocator, and a list of instructions on engine and DMA queues. Each
instruction is validated as it is emitted (the same native checks the engine
runs, see :mod:`tn.neuron.isa`), and its dependencies are derived from operand
overlap: read-after-write, write-after-read and write-after-write on any byte
of HBM, SBUF or PSUM become semaphore waits, so a program written in
sequential order runs correctly while the engines overlap as much as the data
allows. ``build()`` encodes everything into compact int64 arrays
(:class:`Encoded`), which :func:`tn.neuron.runtime.run` executes natively.

Worked example: ``y = relu(x @ w + b)`` for ``x`` 128x64, ``w`` 64x256::

    import numpy as np
    from tn.neuron import Program

    prog = Program("linear_relu")                      # trn2 by default
    x = prog.hbm("x", (128, 64), "float32")            # inputs ...
    w = prog.hbm("w", (64, 256), "float32")
    b = prog.hbm("b", (128, 1), "float32")
    y = prog.hbm("y", (128, 256), "float32", kind="output")

    xT = prog.sbuf((64, 128), "float32")               # K on partitions: stationary = x^T
    wt = prog.sbuf((64, 256), "float32")
    bt = prog.sbuf((128, 1), "float32")
    prog.dma_copy(xT, x.T)                             # strided DMA does the transpose
    prog.dma_copy(wt, w)
    prog.dma_copy(bt, b)
    acc = prog.psum((128, 256))                        # fp32, one PSUM bank
    prog.matmul(acc, xT, wt)                           # acc = xT^T @ wt
    out = prog.sbuf((128, 256), "float32")
    prog.activation(out, acc, "relu", bias=bt)         # ScalarE reads PSUM, adds bias, relu
    prog.dma_copy(y, out)

    res = prog.run({"x": xs, "w": ws, "b": bs})        # -> tn.neuron.runtime.RunResult
    res.outputs["y"], res.total_us, res.utilisation["TensorE"]

Views. ``Tile`` (SBUF/PSUM) and ``HbmView`` support numpy-style basic
indexing (ints, slices with positive or negative steps), no-copy
``reshape``, ``permute`` (``.T`` for HBM views) and ``broadcast_to`` (stride
0). For a tile, axis 0 is the partition axis and stays first; for an HBM
view, axis 0 becomes the partition axis of the DMA and the remaining axes (at
most 4 after merging contiguous ones) the free axes. Views never change the
dtype: DMA copies need the same dtype on both sides, casts are
``tensor_copy``/``activation`` outputs.

Printing an :class:`Encoded` program (``print(prog.build())``) lists every
instruction with its queue, operand patterns and semaphore waits.

Explicit ordering: every emit method returns the instruction's index; pass
``deps=[...]`` to add waits, or build with ``Program(auto_deps=False)`` and
give them all yourself.
"""
from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass, field

import numpy as np

from .._native import engine
from ..errors import NeuronError, OnChipMemoryError
from . import isa
from .arch import NUM_ENGINES, Arch, get_arch

__all__ = ["Program", "Tile", "HbmTensor", "HbmView", "Encoded", "ENGINE_ALIASES"]

#: Accepted engine names -> queue id.
ENGINE_ALIASES = {
    "pe": 0, "tensor": 0, "tensore": 0, "act": 1, "scalar": 1, "scalare": 1, "dve": 2, "vector": 2,
    "vectore": 2, "pool": 3, "gpsimd": 3,
}

_MAX_FREE_DIMS = 4


def _norm_index(idx, ndim):
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(i is Ellipsis for i in idx):
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (ndim - len(idx) + 1) + idx[k + 1:]
    if len(idx) > ndim:
        raise NeuronError(f"too many indices ({len(idx)}) for a view of rank {ndim}")
    return idx + (slice(None),) * (ndim - len(idx))


def _index_dims(dims, idx, what):
    """Apply basic indexing to [(num, stride), ...]; returns (element offset, new dims, kept-axis flags)."""
    off = 0
    out = []
    kept = []
    for (num, stride), ix in zip(dims, idx):
        if isinstance(ix, slice):
            start, stop, step = ix.indices(num)
            n = len(range(start, stop, step))   # negative steps become negative strides
            if n == 0:
                raise NeuronError(f"{what}: slice {ix} selects no elements of an axis of size {num}")
            off += start * stride
            out.append((n, stride * step))
            kept.append(True)
        else:
            try:
                i = int(ix)
            except TypeError:
                raise NeuronError(f"{what}: index {ix!r} is not an int or a slice") from None
            if i < 0:
                i += num
            if not 0 <= i < num:
                raise NeuronError(f"{what}: index {ix} out of range for an axis of size {num}")
            off += i * stride
            kept.append(False)
    return off, out, kept


def _reshape_dims(dims, new_shape, what):
    """numpy-style no-copy reshape of [(num, stride)] into new_shape (raises when a copy would be needed)."""
    old = [(n, s) for n, s in dims if n != 1]
    total = int(np.prod([n for n, _ in dims])) if dims else 1
    new_shape = list(new_shape)
    if -1 in new_shape:
        k = new_shape.index(-1)
        rest = int(np.prod([n for j, n in enumerate(new_shape) if j != k])) or 1
        new_shape[k] = total // rest
    if int(np.prod(new_shape)) != total:
        raise NeuronError(f"{what}: cannot reshape {tuple(n for n, _ in dims)} ({total} elements) to {tuple(new_shape)}")
    out = []
    oi = 0
    ni = 0
    new_nz = [(j, n) for j, n in enumerate(new_shape)]
    strides = [0] * len(new_shape)
    # group old and new dims into chunks of equal products
    while ni < len(new_nz):
        j, n = new_nz[ni]
        if n == 1:
            strides[j] = 0
            ni += 1
            continue
        grp_new = [(j, n)]
        pn = n
        grp_old = []
        po = 1
        if oi < len(old):
            grp_old.append(old[oi]); po = old[oi][0]; oi += 1
        while pn != po:
            if pn < po:
                ni += 1
                if ni >= len(new_nz):
                    break
                grp_new.append(new_nz[ni]); pn *= new_nz[ni][1]
            else:
                if oi >= len(old):
                    break
                grp_old.append(old[oi]); po *= old[oi][0]; oi += 1
        ni += 1
        for (n1, s1), (n2, s2) in zip(grp_old, grp_old[1:]):
            if s1 != n2 * s2:
                raise NeuronError(f"{what}: cannot reshape a strided view {tuple(n for n, _ in dims)} to "
                                  f"{tuple(new_shape)} without a copy; copy it to a contiguous tile first")
        s = grp_old[-1][1] if grp_old else 0
        for jj, nn in reversed(grp_new):
            strides[jj] = s
            s *= nn
    out = [(n, strides[j]) for j, n in enumerate(new_shape)]
    return out


def _merge_dims(dims):
    """Drop size-1 dims and merge contiguous neighbours (for encoding at most 4 free dims)."""
    d = [(n, s) for n, s in dims if n != 1]
    out = []
    for n, s in d:
        if out and out[-1][1] == n * s:
            pn, _ = out[-1]
            out[-1] = (pn * n, s)
        else:
            out.append((n, s))
    return out


def _joint_free_dims(dims_a, dims_b):
    """Encode two equal-size free patterns over one common shape (so the engine copies whole rows).

    Refines both patterns to shared axis sizes, merges axes contiguous on both
    sides and pads to 4 axes; returns ``None`` when no common refinement exists.
    """
    stacks = [list(reversed([d for d in dims if d[0] != 1])) for dims in (dims_a, dims_b)]
    out = [[], []]
    while stacks[0] and stacks[1]:
        m = min(stacks[0][0][0], stacks[1][0][0])
        if stacks[0][0][0] % m or stacks[1][0][0] % m:
            return None
        for k in (0, 1):
            n, st = stacks[k][0]
            out[k].append((m, st))
            if n == m:
                stacks[k].pop(0)
            else:
                stacks[k][0] = (n // m, st * m)
    if stacks[0] or stacks[1]:
        return None
    a, b = list(reversed(out[0])), list(reversed(out[1]))
    ma, mb = [], []
    for (na, sa), (nb, sb) in zip(a, b):
        if ma and ma[-1][1] == na * sa and mb[-1][1] == nb * sb:
            ma[-1] = (ma[-1][0] * na, sa)
            mb[-1] = (mb[-1][0] * nb, sb)
        else:
            ma.append((na, sa))
            mb.append((nb, sb))
    if len(ma) > _MAX_FREE_DIMS:
        return None
    pad = [(1, 0)] * (_MAX_FREE_DIMS - len(ma))
    return pad + ma, pad + mb


def _encode_with_dims(view, dims4):
    """Operand encoding of a tile or HBM view with an explicit 4-axis free pattern."""
    if isinstance(view, Tile):
        return view.encode_dims(dims4)
    rec = view.encode()
    for d, (n, s) in enumerate(dims4):
        rec[8 + 2 * d] = n
        rec[9 + 2 * d] = s
    return rec


def _free_dims(view):
    if isinstance(view, HbmTensor):
        view = view.view()
    if isinstance(view, Tile):
        return view.dims
    return view.dims[1:] if view.dims else []


class _View:
    """Shared view machinery: dtype, element offset, dims as (num, stride) pairs."""

    __slots__ = ()

    @property
    def dtype(self) -> str:
        """NeuronCore dtype name (``float32``, ``bfloat16``, ...)."""
        return isa.DTYPES[self._dt]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return isa.DTYPE_SIZES[self._dt]

    @property
    def shape(self) -> tuple:
        """Shape of the view (for tiles, axis 0 is the partition axis)."""
        return tuple(n for n, _ in self._all_dims())

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self._all_dims())

    @property
    def T(self):
        """Reverse all axes (a 2-D transpose as a strided view; tiles cannot move their partition axis)."""
        return self.permute(*reversed(range(self.ndim)))


@dataclass
class HbmTensor:
    """A named HBM buffer of the program (an input, output, inout or scratch tensor)."""

    index: int
    name: str
    shape: tuple
    dtype: str
    kind: str

    def __post_init__(self):
        n = 1
        for d in self.shape:
            n *= int(d)
        self._nbytes = n * isa.DTYPE_SIZES[isa.dtype_code(self.dtype)]

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self._nbytes

    def view(self) -> "HbmView":
        """The whole tensor as a row-major view."""
        dims = []
        s = 1
        for n in reversed(self.shape):
            dims.append((int(n), s))
            s *= int(n)
        return HbmView(self, 0, list(reversed(dims)))

    def __getitem__(self, idx):
        return self.view()[idx]

    @property
    def T(self):
        """Transposed (reversed-axes) view."""
        return self.view().T

    def reshape(self, *shape):
        """Reshaped view."""
        return self.view().reshape(*shape)

    def permute(self, *axes):
        """View with axes permuted."""
        return self.view().permute(*axes)


class HbmView(_View):
    """A strided view of an HBM tensor: element offset and (num, stride) per axis."""

    __slots__ = ("tensor", "offset", "dims", "_dt")

    def __init__(self, tensor: HbmTensor, offset: int, dims):
        self.tensor = tensor
        self.offset = int(offset)
        self.dims = [(int(n), int(s)) for n, s in dims]
        self._dt = isa.dtype_code(tensor.dtype)

    def _all_dims(self):
        return self.dims

    def __getitem__(self, idx):
        idx = _norm_index(idx, len(self.dims))
        off, dims, _ = _index_dims(self.dims, idx, f"HBM tensor '{self.tensor.name}'")
        return HbmView(self.tensor, self.offset + off, dims)

    def reshape(self, *shape):
        """No-copy reshape (raises if the strides do not allow it)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return HbmView(self.tensor, self.offset, _reshape_dims(self.dims, shape, f"HBM tensor '{self.tensor.name}'"))

    def permute(self, *axes):
        """Axes reordered."""
        if sorted(axes) != list(range(len(self.dims))):
            raise NeuronError(f"permute{axes} is not a permutation of {len(self.dims)} axes")
        return HbmView(self.tensor, self.offset, [self.dims[a] for a in axes])

    def broadcast_to(self, shape):
        """Size-1 axes repeated with stride 0 (DMA reads the same elements again)."""
        return HbmView(self.tensor, self.offset, _broadcast(self.dims, shape, "HBM view"))

    def encode(self):
        """The 16-int64 operand encoding (axis 0 = partition axis, the rest <= 4 free axes)."""
        dims = self.dims
        if not dims:
            dims = [(1, 0)]
        p = dims[0]
        free = _merge_dims(dims[1:])
        if len(free) > _MAX_FREE_DIMS:
            raise NeuronError(f"HBM view of '{self.tensor.name}' has {len(free)} free axes after merging "
                              f"contiguous ones; at most {_MAX_FREE_DIMS} are encodable: split the DMA")
        free = [(1, 0)] * (_MAX_FREE_DIMS - len(free)) + free
        rec = [isa.MEM_HBM, self.tensor.index, self._dt, 0, p[0], p[1], self.offset, 0]
        for n, s in free:
            rec += [n, s]
        return rec

    def __repr__(self):
        return f"HbmView({self.tensor.name}, {self.dtype}{list(self.shape)}, offset={self.offset})"


def _broadcast(dims, shape, what):
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(dims):
        raise NeuronError(f"{what}: broadcast_to{shape} needs rank {len(dims)}")
    out = []
    for (n, s), m in zip(dims, shape):
        if n == m:
            out.append((n, s))
        elif n == 1:
            out.append((m, 0))
        else:
            raise NeuronError(f"{what}: cannot broadcast an axis of size {n} to {m}")
    return out


class Tile(_View):
    """An SBUF or PSUM operand: partitions ``[pstart, pstart+pcount)``, byte offset and free-axis pattern."""

    __slots__ = ("mem", "pstart", "pcount", "offset", "dims", "_dt", "name", "_alloc")

    def __init__(self, mem, pstart, pcount, offset, dtype, dims, name=None, alloc=None):
        self.mem = mem
        self.pstart = int(pstart)
        self.pcount = int(pcount)
        self.offset = int(offset)
        self._dt = isa.dtype_code(dtype)
        self.dims = [(int(n), int(s)) for n, s in dims]
        self.name = name
        self._alloc = alloc

    def _all_dims(self):
        return [(self.pcount, None)] + self.dims

    def _derive(self, pstart=None, pcount=None, offset=None, dims=None, dtype=None):
        return Tile(self.mem, self.pstart if pstart is None else pstart, self.pcount if pcount is None else pcount,
                    self.offset if offset is None else offset, self._dt if dtype is None else dtype,
                    self.dims if dims is None else dims, self.name, self._alloc)

    def __getitem__(self, idx):
        idx = _norm_index(idx, 1 + len(self.dims))
        p = idx[0]
        what = f"tile {self.name or ''}".strip()
        if isinstance(p, slice):
            start, stop, step = p.indices(self.pcount)
            if step != 1 or stop <= start:
                raise NeuronError(f"{what}: partition slices must be contiguous and non-empty (got {p})")
            pstart, pcount = self.pstart + start, stop - start
        else:
            i = int(p) + (self.pcount if int(p) < 0 else 0)
            if not 0 <= i < self.pcount:
                raise NeuronError(f"{what}: partition index {p} out of range 0..{self.pcount - 1}")
            pstart, pcount = self.pstart + i, 1
        off, dims, _ = _index_dims(self.dims, idx[1:], what)
        return self._derive(pstart=pstart, pcount=pcount, offset=self.offset + off * self.itemsize, dims=dims)

    def reshape(self, *shape):
        """No-copy reshape; the partition count must stay the first entry of ``shape``."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if int(shape[0]) != self.pcount:
            raise NeuronError(f"tile reshape{tuple(shape)}: the partition axis ({self.pcount}) cannot be reshaped; "
                              f"keep it first")
        return self._derive(dims=_reshape_dims(self.dims, shape[1:], "tile"))

    def permute(self, *axes):
        """Free axes reordered; axis 0 (partitions) must stay first."""
        if sorted(axes) != list(range(1 + len(self.dims))) or axes[0] != 0:
            raise NeuronError(f"tile permute{axes}: must be a permutation keeping axis 0 (partitions) first; "
                              f"use the transpose instruction to move data across partitions")
        return self._derive(dims=[self.dims[a - 1] for a in axes[1:]])

    @property
    def T(self):
        """Not available for tiles: use ``Program.transpose`` (TensorE) or a strided DMA."""
        raise NeuronError("a tile's partition axis cannot be transposed by a view; use Program.transpose "
                          "(TensorE) or a strided dma_copy")

    def broadcast_to(self, shape):
        """Size-1 free axes repeated with stride 0."""
        shape = tuple(shape)
        if shape[0] != self.pcount:
            raise NeuronError(f"tile broadcast_to{shape}: the partition count ({self.pcount}) cannot broadcast")
        return self._derive(dims=_broadcast(self.dims, shape[1:], "tile"))

    def encode(self):
        """The 16-int64 operand encoding."""
        free = _merge_dims(self.dims)
        if len(free) > _MAX_FREE_DIMS:
            raise NeuronError(f"tile has {len(free)} free axes after merging contiguous ones; at most "
                              f"{_MAX_FREE_DIMS} are encodable")
        free = [(1, 0)] * (_MAX_FREE_DIMS - len(free)) + free
        rec = [self.mem, 0, self._dt, self.pstart, self.pcount, 0, self.offset, 0]
        for n, s in free:
            rec += [n, s]
        return rec

    def encode_dims(self, dims4):
        """Encoding with an explicit 4-D free pattern (used by tensor_reduce)."""
        rec = [self.mem, 0, self._dt, self.pstart, self.pcount, 0, self.offset, 0]
        for n, s in dims4:
            rec += [n, s]
        return rec

    def __repr__(self):
        m = isa.MEM_NAMES[self.mem]
        return (f"Tile({m}{'' if self.name is None else ' ' + self.name}, {self.dtype}{list(self.shape)}, "
                f"partitions {self.pstart}..{self.pstart + self.pcount - 1}, byte {self.offset})")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._alloc is not None:
            self._alloc[0].free(self)
        return False


class _Allocator:
    """First-fit allocator of byte ranges inside every partition of SBUF or PSUM."""

    def __init__(self, mem, capacity, align, what):
        self.mem = mem
        self.capacity = capacity
        self.align = align
        self.what = what
        self.live = {}  # offset -> size
        self.in_use = 0
        self.peak = 0

    def alloc(self, nbytes):
        """Byte offset of a new range of ``nbytes`` (rounded up to the alignment) in every partition."""
        size = -(-nbytes // self.align) * self.align
        pos = 0
        for off in sorted(self.live):
            if off - pos >= size:
                break
            pos = max(pos, off + self.live[off])
        if pos + size > self.capacity:
            raise OnChipMemoryError(
                f"{self.what} is full: a tile of {nbytes} bytes per partition does not fit ({self.in_use} of "
                f"{self.capacity} bytes per partition in use); free tiles you no longer need or use smaller tiles")
        self.live[pos] = size
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return pos

    def free(self, off):
        """Release the range starting at ``off``."""
        size = self.live.pop(off, None)
        if size is None:
            raise NeuronError(f"{self.what}: tile at byte {off} is not allocated (freed twice?)")
        self.in_use -= size


@dataclass
class Encoded:
    """A built program: the compact arrays the native engine runs, plus the HBM table and metadata."""

    name: str
    arch: Arch
    records: np.ndarray        # (n, isa.REC_WIDTH) int64
    deps: np.ndarray           # int64 indices of earlier instructions (semaphore waits)
    aux: np.ndarray            # int64 side data (partition_shuffle permutations)
    hbm: list                  # [HbmTensor] in buffer-index order
    sbuf_peak_bytes: int       # per partition
    psum_peak_bytes: int       # per partition
    sources: list = field(default_factory=list)  # "file:line" of the code that emitted each instruction

    def __len__(self):
        return int(self.records.shape[0])

    def prepared(self) -> dict:
        """Arrays and per-tensor facts the runtime needs on every run, computed once per program."""
        prep = self.__dict__.get("_prep")
        if prep is None:
            prep = self.__dict__["_prep"] = _RUNTIME["prepare"](self)
        return prep

    def prepare_call(self):
        """The fast entry for repeated runs: a :class:`tn.neuron.runtime.PreparedCall` (made once, cached)
        taking one value per HBM tensor in declaration order; ``enc.prepare_call()(values)`` is
        ``tn.neuron.run(enc, values)`` without the per-call set-up."""
        call = self.__dict__.get("_call")
        if call is None:
            call = self.__dict__["_call"] = _RUNTIME["PreparedCall"](self)
        return call

    def run(self, bindings=None, **kwargs):
        """Run on the software NeuronCore (see :func:`tn.neuron.runtime.run`)."""
        return _RUNTIME["run"](self, bindings, **kwargs)

    def listing(self, limit: int = None) -> str:
        """Readable text of the program, one instruction per line (queue, opcode, operands, waits)."""
        names = {t.index: t.name for t in self.hbm}
        lines = [f"program {self.name!r} ({self.arch.name}): {len(self)} instructions, HBM "
                 + ", ".join(f"{t.name}: {t.dtype}{list(t.shape)} {t.kind}" for t in self.hbm)]
        n = len(self) if limit is None else min(limit, len(self))
        for i in range(n):
            r = self.records[i]
            op = isa.OPCODE_NAMES.get(int(r[isa.H_OPCODE]), f"op{int(r[isa.H_OPCODE])}")
            slots = isa.OPERAND_NAMES.get(op, ())
            parts = []
            for k, nm in enumerate(slots):
                f = r[isa.OPERAND_BASE + k * isa.OPERAND_WIDTH:isa.OPERAND_BASE + (k + 1) * isa.OPERAND_WIDTH]
                if f[isa.O_MEM] == isa.MEM_NONE:
                    continue
                dims = [int(f[isa.O_NUM0 + 2 * d]) for d in range(4)]
                strides = [int(f[isa.O_NUM0 + 2 * d + 1]) for d in range(4)]
                free = [(n_, s_) for n_, s_ in zip(dims, strides) if n_ != 1] or [(1, 1)]
                dt = isa.DTYPES.get(int(f[isa.O_DTYPE]), "?")
                if f[isa.O_MEM] == isa.MEM_HBM:
                    where = f"{names.get(int(f[isa.O_BUF]), int(f[isa.O_BUF]))}@{int(f[isa.O_OFFSET])}"
                    pdim = f"{int(f[isa.O_PCOUNT])}:{int(f[isa.O_PSTRIDE])}"
                else:
                    where = f"{isa.MEM_NAMES[int(f[isa.O_MEM])]}+{int(f[isa.O_OFFSET])}"
                    pdim = f"p{int(f[isa.O_PSTART])}..{int(f[isa.O_PSTART] + f[isa.O_PCOUNT] - 1)}"
                shape = ",".join(f"{n_}:{s_}" for n_, s_ in free)
                parts.append(f"{nm}={dt}[{pdim} | {shape}]@{where}")
            d0, dn = int(r[isa.H_DEP_START]), int(r[isa.H_DEP_COUNT])
            waits = f"  waits {self.deps[d0:d0 + dn].tolist()}" if dn else ""
            lines.append(f"#{i:<4d} {self.arch.queue_name(int(r[isa.H_QUEUE])):8s} {op:17s} {' '.join(parts)}{waits}")
        if n < len(self):
            lines.append(f"... {len(self) - n} more")
        return "\n".join(lines)

    def __str__(self):
        return self.listing(limit=200)

    def opcode_counts(self) -> dict:
        """Instruction count per opcode name."""
        ops, counts = np.unique(self.records[:, isa.H_OPCODE], return_counts=True)
        return {isa.OPCODE_NAMES.get(int(o), str(o)): int(c) for o, c in zip(ops, counts)}


_HERE = os.path.dirname(os.path.abspath(__file__))
_PACK_F64 = struct.Struct("<d")
_UNPACK_I64 = struct.Struct("<q")


#: A dependency-tracker bucket (the accesses of one memory region) holding more entries than this is folded
#: (see :func:`_fold_entries`); the newest ``_BUCKET_KEEP`` entries stay exact.
_BUCKET_MAX = 256
_BUCKET_KEEP = 128
#: Folded entries are merged per 1/_FOLD_GRAINS of the bucket's bytes (finer: fewer needless waits).
_FOLD_GRAINS = 64


def _fold_entries(entries, grain):
    """Fold the oldest entries of a crowded tracker bucket into barrier entries, one per (queue, read/write,
    partition range, ``grain`` bytes where the access starts).

    A barrier keeps the latest instruction of its queue among the folded entries (queues run in order, so that
    instruction ends no earlier than the others) and the union of their access boxes, so a later access that
    overlapped any folded entry still waits for one that ends no earlier: the fold only adds waits, it never
    drops one. The newest ``_BUCKET_KEEP`` entries are kept as they are.
    """
    old, recent = entries[:-_BUCKET_KEEP], entries[-_BUCKET_KEEP:]
    barriers = {}
    for ei, eq, ew, ep0, ep1, eb0, eb1 in old:
        group = (eq, ew, ep0, ep1, eb0 // grain)
        b = barriers.get(group)
        if b is None:
            barriers[group] = [ei, eq, ew, ep0, ep1, eb0, eb1]
        else:
            b[0] = max(b[0], ei)
            b[3], b[4], b[5], b[6] = min(b[3], ep0), max(b[4], ep1), min(b[5], eb0), max(b[6], eb1)
    folded = sorted((tuple(b) for b in barriers.values()), key=lambda e: e[0])
    return folded + recent


def _f64_bits(v) -> int:
    """int64 bit pattern of float64 v (how immediates are encoded)."""
    return _UNPACK_I64.unpack(_PACK_F64.pack(float(v)))[0]


#: The runtime's entry points (:mod:`tn.neuron.runtime`, the layer that runs programs, sits above this module and
#: registers them when it is imported; ``import tn.neuron`` imports it): ``prepare``, ``PreparedCall``, ``run``,
#: ``simulate_timing``.
_RUNTIME: dict = {}


def register_runtime(**entry_points) -> None:
    """Called by :mod:`tn.neuron.runtime` at import: the functions :class:`Encoded`'s conveniences (``run``,
    ``prepare_call``, ``prepared``) and ``Program.build(check=True)`` call, so this module never imports it."""
    _RUNTIME.update(entry_points)


_ENGINE = []


def _engine():
    if not _ENGINE:
        _ENGINE.append(engine)
    return _ENGINE[0]


def _caller_site():
    f = sys._getframe(2)
    while f is not None and os.path.dirname(os.path.abspath(f.f_code.co_filename)) == _HERE:
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


class Program:
    """A NeuronCore program under construction (see the module docstring for a worked example).

    ``arch``: ``"trn2"`` (default), ``"trn1"`` or an :class:`Arch`.
    ``auto_deps``: derive semaphore waits from operand overlap (default True).
    ``record_sources``: remember the emitting file:line per instruction for error messages.
    """

    def __init__(self, name: str = "program", arch=None, *, auto_deps: bool = True, record_sources: bool = True):
        self.name = name
        self.arch = get_arch(arch)
        self.auto_deps = auto_deps
        self.record_sources = record_sources
        self._limits = self.arch.limits_vector()
        self._hbm_sizes = np.zeros(0, dtype=np.int64)
        self._recs = []
        self._deps = []      # list of lists
        self._aux = []
        self._sources = []
        self._hbm = []
        self._hbm_names = {}
        self._sbuf = _Allocator(isa.MEM_SBUF, self.arch.sbuf_partition_bytes, 64, "SBUF")
        self._psum = _Allocator(isa.MEM_PSUM, self.arch.psum_partition_bytes, self.arch.psum_bank_bytes, "PSUM")
        self._dma_rr = 0
        self._buckets = {}
        self._queues = []

    # ------------------------------------------------------------------ memories
    def hbm(self, name: str, shape, dtype="float32", kind: str = "input") -> HbmTensor:
        """Declare an HBM tensor. ``kind``: ``input`` (must be bound), ``output``/``scratch`` (allocated
        by the runtime when not bound) or ``inout``."""
        if name in self._hbm_names:
            raise NeuronError(f"HBM tensor {name!r} is declared twice in program {self.name!r}")
        if kind not in ("input", "output", "inout", "scratch"):
            raise NeuronError(f"HBM tensor {name!r}: kind {kind!r} must be input, output, inout or scratch")
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if any(s < 1 for s in shape):
            raise NeuronError(f"HBM tensor {name!r}: shape {shape} must have positive sizes")
        t = HbmTensor(len(self._hbm), name, shape, isa.DTYPES[isa.dtype_code(dtype)], kind)
        self._hbm.append(t)
        self._hbm_names[name] = t
        self._hbm_sizes = np.array([x.nbytes for x in self._hbm], dtype=np.int64)
        return t

    def _tile(self, alloc, mem, shape, dtype, name):
        shape = tuple(int(s) for s in shape)
        if len(shape) < 1:
            raise NeuronError("a tile shape needs at least the partition axis")
        p = shape[0]
        if not 1 <= p <= self.arch.partitions:
            raise NeuronError(f"tile {name or ''} of shape {shape}: {p} partitions; the limit is "
                              f"{self.arch.partitions} (put the larger axis on the free side or tile it)")
        code = isa.dtype_code(dtype)
        free = shape[1:]
        nfree = int(np.prod(free)) if free else 1
        off = alloc.alloc(nfree * isa.DTYPE_SIZES[code])
        dims = []
        s = 1
        for n in reversed(free):
            dims.append((n, s))
            s *= n
        t = Tile(mem, 0, p, off, code, list(reversed(dims)) or [(1, 1)], name, (alloc, off))
        if not free:
            t.dims = [(1, 1)]
        return t

    def sbuf(self, shape, dtype="float32", name: str = None) -> Tile:
        """Allocate an SBUF tile of ``shape = (partitions, *free)`` (same byte range in every partition)."""
        return self._tile(self._sbuf, isa.MEM_SBUF, shape, dtype, name)

    def psum(self, shape, dtype="float32", name: str = None) -> Tile:
        """Allocate a PSUM tile (rounded up to whole 2 KiB banks; a 128x512 fp32 tile is one bank)."""
        return self._tile(self._psum, isa.MEM_PSUM, shape, dtype, name)

    def free(self, tile: Tile):
        """Release a tile's memory (later tiles may reuse it; dependencies keep the order right)."""
        if tile._alloc is None:
            raise NeuronError(f"{tile!r} was not allocated by this program")
        tile._alloc[0].free(tile._alloc[1])

    # ------------------------------------------------------------------ emission
    def _queue(self, engine):
        if isinstance(engine, int):
            return engine
        q = ENGINE_ALIASES.get(str(engine).lower())
        if q is None:
            raise NeuronError(f"unknown engine {engine!r}: use one of {sorted(ENGINE_ALIASES)}")
        return q

    def _dma_queue(self, queue):
        if queue is None:
            q = self._dma_rr
            self._dma_rr = (self._dma_rr + 1) % self.arch.dma_queues
            return NUM_ENGINES + q
        if not 0 <= int(queue) < self.arch.dma_queues:
            raise NeuronError(f"DMA queue {queue} does not exist: use 0..{self.arch.dma_queues - 1}")
        return NUM_ENGINES + int(queue)

    @staticmethod
    def _enc(v):
        if v is None:
            return [0] * isa.OPERAND_WIDTH
        if isinstance(v, HbmTensor):
            v = v.view()
        if not isinstance(v, (Tile, HbmView)):
            raise NeuronError(f"operand {v!r} is not a tile or HBM view")
        return v.encode()

    def _emit(self, opcode, queue, operands, subop=0, flags=0, imm=(), deps=(), aux=(), reads=(), writes=(),
              encoded=None):
        rec = [0] * isa.REC_WIDTH
        rec[isa.H_OPCODE] = isa.OPCODES[opcode]
        rec[isa.H_QUEUE] = queue
        rec[isa.H_SUBOP] = subop
        rec[isa.H_FLAGS] = flags
        for j, v in enumerate(imm):
            rec[isa.H_IMM + j] = _f64_bits(v)
        for k, v in enumerate(operands):
            enc = encoded[k] if encoded is not None and encoded[k] is not None else self._enc(v)
            base = isa.OPERAND_BASE + k * isa.OPERAND_WIDTH
            rec[base:base + isa.OPERAND_WIDTH] = enc
        rec[isa.H_AUX_COUNT] = len(aux)
        try:
            _engine().check(rec, self._limits, self._hbm_sizes, aux if len(aux) else None)
        except NeuronError as e:
            raise NeuronError(f"{e} [program {self.name!r}, instruction #{len(self._recs)}]") from None
        i = len(self._recs)
        dep_set = {}
        if self.auto_deps:
            # reads first: a write operand prunes the entries it covers, and an in-place instruction's read
            # must still see the earlier write it depends on
            order = sorted(range(len(operands)), key=lambda k: k == 0 or k in writes)
            for k in order:
                if operands[k] is None:
                    continue
                w = k == 0 or k in writes
                self._track(i, queue, rec, k, w, dep_set)
        for d in deps:
            d = int(d)
            if not 0 <= d < i:
                raise NeuronError(f"{opcode}: explicit dependency {d} is not an earlier instruction (0..{i - 1})")
            q = self._recs[d][isa.H_QUEUE]
            dep_set[q] = max(dep_set.get(q, -1), d)
        if aux is not None and len(aux):
            rec[isa.H_AUX_START] = len(self._aux)
            self._aux.extend(int(a) for a in aux)
        self._recs.append(rec)
        self._deps.append(sorted(dep_set.values()))
        self._sources.append(_caller_site() if self.record_sources else "")
        return i

    def _regions(self, rec, k):
        """Conservative (key, p0, p1, b0, b1) access box of operand k of an encoded record (a list)."""
        base = isa.OPERAND_BASE + k * isa.OPERAND_WIDTH
        f = rec[base:base + isa.OPERAND_WIDTH]
        mem = f[isa.O_MEM]
        es = isa.DTYPE_SIZES[f[isa.O_DTYPE]]
        lo = hi = 0
        for d in range(8, 16, 2):
            n, s = f[d], f[d + 1]
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        off = f[isa.O_OFFSET]
        if mem == isa.MEM_HBM:
            pc, ps = f[isa.O_PCOUNT], f[isa.O_PSTRIDE]
            if ps >= 0:
                hi += (pc - 1) * ps
            else:
                lo += (pc - 1) * ps
            return ("hbm", f[isa.O_BUF]), 0, 1, (off + lo) * es, (off + hi + 1) * es
        p0 = f[isa.O_PSTART]
        return (mem,), p0, p0 + f[isa.O_PCOUNT], off + lo * es, off + (hi + 1) * es

    def _track(self, i, queue, rec, k, write, dep_set):
        key, p0, p1, b0, b1 = self._regions(rec, k)
        chunk = 1 << 20 if key[0] == "hbm" else 4096
        for c in range(b0 // chunk, (b1 - 1) // chunk + 1):
            bucket = self._buckets.setdefault(key + (c,), [])
            keep = []
            for ent in bucket:
                ei, eq, ew, ep0, ep1, eb0, eb1 = ent
                overlap = ep0 < p1 and p0 < ep1 and eb0 < b1 and b0 < eb1
                if overlap and (write or ew) and ei != i:
                    # on the same in-order queue only a read after a write waits (for the write's access
                    # latency); write-after-read and write-after-write are ordered by the queue itself
                    if eq == queue and (write or not ew):
                        pass
                    elif dep_set.get(eq, -1) < ei:
                        dep_set[eq] = ei
                # an entry covered by this access is redundant when this is a write (later accesses wait on
                # the write, which waited on the entry) or a read on the same in-order queue as an older read
                if (overlap and (write or (not ew and eq == queue)) and p0 <= ep0 and ep1 <= p1 and b0 <= eb0
                        and eb1 <= b1 and ei != i):
                    continue
                keep.append(ent)
            keep.append((i, queue, write, p0, p1, b0, b1))
            if len(keep) > _BUCKET_MAX:
                keep = _fold_entries(keep, chunk // _FOLD_GRAINS)
            self._buckets[key + (c,)] = keep

    # ------------------------------------------------------------------ DMA
    def dma_copy(self, dst, src, *, queue=None, deps=()):
        """``dst = src`` (HBM<->SBUF, SBUF<->SBUF, HBM<->HBM); same dtype, partition count and free size."""
        enc = None
        if isinstance(dst, (Tile, HbmView, HbmTensor)) and isinstance(src, (Tile, HbmView, HbmTensor)):
            j = _joint_free_dims(_free_dims(dst), _free_dims(src))
            if j is not None:
                dst = dst.view() if isinstance(dst, HbmTensor) else dst
                src = src.view() if isinstance(src, HbmTensor) else src
                enc = [_encode_with_dims(dst, j[0]), _encode_with_dims(src, j[1])]
        return self._emit("dma_copy", self._dma_queue(queue), [dst, src], deps=deps, encoded=enc)

    def dma_gather(self, dst, table, indices, *, queue=None, deps=()):
        """``dst[p, :] = table[indices[p], :]``: table an HBM view (axis 0 = rows), indices an int32/int64
        SBUF tile ``[P, 1]``; every index is checked against the table's rows when it runs."""
        return self._emit("dma_gather", self._dma_queue(queue), [dst, table, indices], deps=deps)

    def dma_scatter(self, table, src, indices, *, accumulate=False, queue=None, deps=()):
        """``table[indices[p], :] = src[p, :]`` (``+=`` with ``accumulate``, in fp32, partition order):
        table an HBM view (axis 0 = rows), src an SBUF tile ``[P, D]``, indices int32/int64 ``[P, 1]``."""
        return self._emit("dma_scatter", self._dma_queue(queue), [table, src, indices],
                          flags=isa.FLAG_ACCUMULATE if accumulate else 0, deps=deps)

    # ------------------------------------------------------------------ TensorE
    def matmul(self, psum, stationary, moving, *, accumulate=False, stop=False, deps=()):
        """``psum[M, N] (+)= stationary[K, M]^T @ moving[K, N]`` on TensorE.

        ``accumulate=False`` starts an accumulation group in the PSUM bank
        (overwrite); ``accumulate=True`` adds to it. The group owns its bank
        until its result is read or a matmul with ``stop=True`` closes it.
        """
        flags = (isa.FLAG_ACCUMULATE if accumulate else 0) | (isa.FLAG_STOP if stop else 0)
        return self._emit("matmul", 0, [psum, stationary, moving], flags=flags, deps=deps)

    def transpose(self, psum, src, *, deps=()):
        """``psum[F, P] = src[P, F]^T`` on TensorE (P, F <= 128)."""
        return self._emit("transpose", 0, [psum, src], deps=deps)

    # ------------------------------------------------------------------ ScalarE
    def activation(self, out, src, func="identity", *, scale=1.0, bias=None, reduce_op=None, reduce_out=None,
                   deps=()):
        """``out = func(src * scale + bias)`` on ScalarE.

        ``scale``: float or ``[P, 1]`` tile; ``bias``: float or ``[P, 1]`` tile.
        ``reduce_op`` (add/max/min/multiply/...) with ``reduce_out`` (``[P, 1]``)
        reduces the result along all free axes in the same instruction.
        """
        if func not in isa.ACT_FUNCS:
            raise NeuronError(f"activation: unknown function {func!r}; use one of {sorted(isa.ACT_FUNCS)}")
        red = 0
        if reduce_op is not None:
            red = self._reduce_code(reduce_op, "activation")
        bias_t = bias if isinstance(bias, Tile) else None
        bias_v = 0.0 if (bias is None or bias_t is not None) else float(bias)
        scale_t = scale if isinstance(scale, Tile) else None
        scale_v = 1.0 if scale_t is not None else float(scale)
        return self._emit("activation", 1, [out, src, bias_t, scale_t, reduce_out],
                          subop=isa.ACT_FUNCS[func] | (red << 8), imm=(scale_v, bias_v), writes=(4,), deps=deps)

    # ------------------------------------------------------------------ VectorE
    @staticmethod
    def _alu(op, what):
        if op not in isa.ALU_OPS:
            raise NeuronError(f"{what}: unknown ALU op {op!r}; use one of {sorted(isa.ALU_OPS)}")
        return isa.ALU_OPS[op]

    @staticmethod
    def _reduce_code(op, what):
        if op not in isa.REDUCE_OPS or op == "none":
            names = sorted(k for k in isa.REDUCE_OPS if k != "none")
            raise NeuronError(f"{what}: unknown reduce op {op!r}; use one of {names}")
        return isa.REDUCE_OPS[op]

    def tensor_tensor(self, out, in0, in1, op, *, engine="vector", deps=()):
        """``out = in0 <op> in1`` elementwise (op from :data:`tn.neuron.isa.ALU_OPS`)."""
        return self._emit("tensor_tensor", self._queue(engine), [out, in0, in1], subop=self._alu(op, "tensor_tensor"),
                          deps=deps)

    def tensor_scalar(self, out, src, op0, operand0, op1=None, operand1=None, *, reverse0=False, reverse1=False,
                      engine="vector", deps=()):
        """``out = (src <op0> operand0) <op1> operand1``; operands are floats or ``[P, 1]`` tiles.

        ``reverse0``/``reverse1`` swap the sides (``operand0 <op0> src``).
        """
        c0 = self._alu(op0, "tensor_scalar")
        c1 = 0 if op1 is None else self._alu(op1, "tensor_scalar")
        t0 = operand0 if isinstance(operand0, Tile) else None
        t1 = operand1 if isinstance(operand1, Tile) else None
        v0 = 0.0 if t0 is not None else float(operand0)
        v1 = 0.0 if (t1 is not None or operand1 is None) else float(operand1)
        flags = (isa.FLAG_REV0 if reverse0 else 0) | (isa.FLAG_REV1 if reverse1 else 0)
        return self._emit("tensor_scalar", self._queue(engine), [out, src, t0, t1], subop=c0 | (c1 << 8),
                          flags=flags, imm=(v0, v1), deps=deps)

    def tensor_reduce(self, out, src, op, axis=-1, *, engine="vector", deps=()):
        """Reduce ``src`` along free ``axis`` (int or tuple of tile axes >= 1; -1 = last) into ``out``.

        ``out``'s shape is ``src``'s without the reduced axes (size-1 axes are ignored).
        """
        code = self._reduce_code(op, "tensor_reduce")
        nd = 1 + len(src.dims)
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        axes = sorted({a + nd if a < 0 else a for a in axes})
        if not axes or any(not 1 <= a < nd for a in axes):
            raise NeuronError(f"tensor_reduce: axis {axis} must name free axes 1..{nd - 1} of a rank-{nd} tile")
        kept = [src.dims[a - 1] for a in range(1, nd) if a not in axes]
        red = [src.dims[a - 1] for a in axes]
        kept_m = _merge_dims(kept)
        red_m = _merge_dims(red) or [(1, 0)]
        if len(kept_m) + len(red_m) > 4:
            raise NeuronError("tensor_reduce: more than 4 free axes after merging; reshape the tile first")
        in_dims = [(1, 0)] * (4 - len(kept_m) - len(red_m)) + kept_m + red_m
        nred = len(red_m)
        nkept = int(np.prod([n for n, _ in kept])) if kept else 1
        out_free = [(n, s) for n, s in _merge_dims(out.dims)]
        ototal = int(np.prod([n for n, _ in out.dims])) if out.dims else 1
        if ototal != nkept:
            raise NeuronError(f"tensor_reduce: out has {ototal} free elements but the kept axes of src have {nkept}")
        # out's pattern must follow the kept axes in order: reshape it to the kept (merged) shape
        out_k = _reshape_dims(out_free or [(1, 1)], [n for n, _ in kept_m] or [1], "tensor_reduce out")
        out_dims = [(1, 0)] * (4 - len(out_k)) + out_k
        enc = [out.encode_dims(out_dims), src.encode_dims(in_dims)]
        return self._emit("tensor_reduce", self._queue(engine), [out, src], subop=code, imm=(float(nred),),
                          encoded=enc, deps=deps)

    def tensor_copy(self, out, src, *, engine="vector", deps=()):
        """``out = src`` with dtype conversion (e.g. PSUM fp32 -> SBUF bf16); VectorE, ScalarE or GpSimd."""
        enc = None
        if isinstance(out, Tile) and isinstance(src, Tile) and out._dt == src._dt:
            j = _joint_free_dims(out.dims, src.dims)   # same dtype: a byte copy, fastest over one pattern
            if j is not None:
                enc = [out.encode_dims(j[0]), src.encode_dims(j[1])]
        return self._emit("tensor_copy", self._queue(engine), [out, src], deps=deps, encoded=enc)

    def select(self, out, pred, on_true, on_false, *, deps=()):
        """``out = pred != 0 ? on_true : on_false`` elementwise on VectorE."""
        return self._emit("select", 2, [out, pred, on_true, on_false], deps=deps)

    def bn_stats(self, out, src, *, deps=()):
        """``out[P, 3] = [count, mean, var]`` of ``src`` (free size <= 512) per partition."""
        return self._emit("bn_stats", 2, [out, src], deps=deps)

    def bn_aggr(self, out, src, *, deps=()):
        """``out[P, 2] = [mean, var]`` combining the bn_stats triples laid out along ``src``'s free axis."""
        return self._emit("bn_aggr", 2, [out, src], deps=deps)

    # ------------------------------------------------------------------ GpSimd
    @staticmethod
    def _affine(base, channel_multiplier, pattern, out):
        pattern = list(pattern or [])
        nfree = len(out.dims)
        if len(pattern) > nfree:
            raise NeuronError(f"affine pattern has {len(pattern)} multipliers but the tile has {nfree} free axes")
        pattern = [0] * (nfree - len(pattern)) + pattern
        if len(out.dims) > 4:
            raise NeuronError(f"iota/affine_select: the tile has {len(out.dims)} free axes; at most 4 can carry "
                              f"pattern multipliers")
        full = [(n, s, m) for (n, s), m in zip(out.dims, pattern)]
        full = [(1, 0, 0)] * (4 - len(full)) + full
        dims4 = [(n, s) for n, s, _ in full]
        mults = [float(m) for _, _, m in full]
        return dims4, (float(base), float(channel_multiplier), *mults)

    def iota(self, out, *, base=0, channel_multiplier=0, pattern=(), deps=()):
        """``out[p, i...] = base + channel_multiplier*p + sum_d pattern[d]*i_d`` (p relative to the tile)."""
        dims4, imm = self._affine(base, channel_multiplier, pattern, out)
        return self._emit("iota", 3, [out], imm=imm, encoded=[out.encode_dims(dims4)], deps=deps)

    def affine_select(self, out, src, *, cmp="is_ge", base=0, channel_multiplier=0, pattern=(), fill=0.0,
                      deps=()):
        """``out = (base + cm*p + sum_d pattern[d]*i_d) <cmp> 0 ? src : fill`` (causal/band masks).

        Causal mask of scores ``[q, k]``: ``affine_select(out, s, cmp="is_ge", channel_multiplier=1,
        pattern=[-1], fill=-inf)`` keeps ``k <= q``.
        """
        if cmp not in isa.CMP_OPS:
            raise NeuronError(f"affine_select: unknown comparison {cmp!r}; use one of {sorted(isa.CMP_OPS)}")
        dims4, imm = self._affine(base, channel_multiplier, pattern, out)
        sd = src.dims
        if [n for n, _ in sd] != [n for n, _ in out.dims]:
            raise NeuronError(f"affine_select: src free shape {[n for n, _ in sd]} differs from out's "
                              f"{[n for n, _ in out.dims]}")
        sd4 = [(1, 0)] * (4 - len(sd)) + list(sd)
        return self._emit("affine_select", 3, [out, src], subop=isa.CMP_OPS[cmp], imm=(*imm, float(fill)),
                          encoded=[out.encode_dims(dims4), src.encode_dims(sd4)], deps=deps)

    def memset(self, out, value, *, engine="gpsimd", deps=()):
        """``out = value`` (GpSimd by default, VectorE allowed)."""
        return self._emit("memset", self._queue(engine), [out], imm=(float(value),), deps=deps)

    def partition_reduce(self, out, src, op="add", *, deps=()):
        """``out[p, f] = reduce over partitions q of src[q, f]``, written to every partition of ``out``."""
        return self._emit("partition_reduce", 3, [out, src], subop=self._reduce_code(op, "partition_reduce"),
                          deps=deps)

    def partition_shuffle(self, out, src, perm, *, deps=()):
        """``out[p, :] = src[perm[p], :]`` (cross-partition shuffle on GpSimd)."""
        return self._emit("partition_shuffle", 3, [out, src], aux=[int(x) for x in perm], deps=deps)

    # ------------------------------------------------------------------ output
    def add_dep(self, after: int, before: int):
        """Make instruction ``after`` wait for instruction ``before`` (an explicit semaphore wait)."""
        if not 0 <= before < after < len(self._recs):
            raise NeuronError(f"add_dep({after}, {before}): need 0 <= before < after < {len(self._recs)}")
        if self._recs[before][isa.H_QUEUE] != self._recs[after][isa.H_QUEUE] and before not in self._deps[after]:
            self._deps[after] = sorted(self._deps[after] + [before])

    def __len__(self):
        return len(self._recs)

    def build(self, *, check: bool = True) -> Encoded:
        """Encode the program into compact arrays (:class:`Encoded`).

        With ``check`` (default) the whole stream is validated natively once,
        without data, including PSUM accumulation-group ownership.
        """
        n = len(self._recs)
        recs = np.zeros((n, isa.REC_WIDTH), dtype=np.int64)
        flat = []
        for i, (r, d) in enumerate(zip(self._recs, self._deps)):
            recs[i] = r
            recs[i, isa.H_DEP_START] = len(flat)
            recs[i, isa.H_DEP_COUNT] = len(d)
            flat.extend(d)
        enc = Encoded(
            name=self.name, arch=self.arch, records=recs, deps=np.array(flat, dtype=np.int64),
            aux=np.array(self._aux, dtype=np.int64), hbm=list(self._hbm),
            sbuf_peak_bytes=self._sbuf.peak, psum_peak_bytes=self._psum.peak, sources=list(self._sources),
        )
        if check:
            _RUNTIME["simulate_timing"](enc)
        return enc

    def run(self, bindings=None, **kwargs):
        """Build and run (see :func:`tn.neuron.runtime.run`)."""
        return self.build(check=False).run(bindings, **kwargs)
