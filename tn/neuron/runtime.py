# Runs encoded NeuronCore programs on the native engine with HBM bindings and reports results, timing and traffic.
"""Run NeuronCore programs.

:func:`run` binds HBM tensors to host memory (numpy arrays or CPU torch
tensors, by pointer, without copying), gives the program fresh SBUF/PSUM,
executes the encoded stream natively (validation, math and timing in one
pass, see ``_native/engine.pyx``) and returns a :class:`RunResult`.

Repeated runs of one program go through :meth:`Encoded.prepare_call
<tn.neuron.program.Encoded.prepare_call>` (a :class:`PreparedCall`: values
bound by position, per-program arrays and checks prepared once, a CPU torch
tensor of the right dtype and size bound after a few attribute reads);
:func:`run` is a thin layer over it. A caller that binds the same HBM tensors
every run and checks its values itself (the compiler's executables) uses a
:class:`BoundPlan` of it: the pointer array and the allocated block's layout
are precomputed, nothing is looked up per HBM tensor.

Unbound outputs and scratch tensors read as zeros wherever the program does not
write them, but their block (reused from call to call) is not cleared whole:
:mod:`tn.neuron.zeroing` finds once per program the bytes a run may read before
writing them and those it never writes, and only they are zeroed (see
:class:`_Carved`): a compiled training step writes its ~10 MB of scratch before
reading it and zeroes none of it.

Every run is reported to the active profilers (:func:`tn.profile` pushes one
with :func:`add_listener`), whatever door started it.

bfloat16 on the host: numpy has no bf16, so bf16 HBM tensors bind to torch
``bfloat16`` tensors or to ``uint16`` numpy arrays holding the raw bits
(:func:`to_bf16` / :func:`from_bf16` convert, rounding to nearest even).
"""
from __future__ import annotations

import re
import sys
import threading
import time
import weakref

import numpy as np
import torch

from .. import config
from .._native import _kernels, engine
from ..errors import NeuronError
from . import isa
from . import timeline as _timeline
from .arch import NUM_ENGINES
from .program import Encoded, Program, register_runtime
from .zeroing import block_ranges, zero_ranges

__all__ = ["run", "RunResult", "PreparedCall", "BoundPlan", "simulate_timing", "to_bf16", "from_bf16", "add_listener",
           "remove_listener", "active_listeners"]

# Process-wide, not per thread: autograd runs a device's backward pass in its own worker thread, and a
# profiler around `loss.backward()` must see those runs too (like torch.profiler, it sees every thread).
_LISTENERS: tuple = ()
_LISTENERS_LOCK = threading.Lock()


def add_listener(fn):
    """Call ``fn(result)`` for every program run in the process until :func:`remove_listener` (returns its token).

    Listeners see runs from every thread, so a profiler around ``loss.backward()``
    also sees the backward programs autograd runs in its worker thread.
    """
    global _LISTENERS
    token = object()
    with _LISTENERS_LOCK:
        _LISTENERS = _LISTENERS + ((token, fn),)
    return token


def remove_listener(token):
    """Undo :func:`add_listener` (its token)."""
    global _LISTENERS
    with _LISTENERS_LOCK:
        _LISTENERS = tuple(entry for entry in _LISTENERS if entry[0] is not token)


def listening() -> bool:
    """True while any listener (a ``tn.profile()`` block) is registered: a fast check for hot paths."""
    return bool(_LISTENERS)


def active_listeners() -> tuple:
    """The listener functions registered now (empty when no profiler is active)."""
    return tuple(fn for _, fn in _LISTENERS)


def to_bf16(a) -> np.ndarray:
    """float array -> uint16 array of bfloat16 bits (round to nearest even, NaN kept)."""
    src = np.ascontiguousarray(a, dtype=np.float32)
    out = np.empty(src.shape, dtype=np.uint16)
    ffi = _kernels.ffi
    _kernels.lib.tn_cvt_f32_to_bf16(ffi.from_buffer("float[]", src), ffi.from_buffer("uint16_t[]", out), src.size)
    return out


def from_bf16(bits) -> np.ndarray:
    """uint16 array of bfloat16 bits -> float32 array (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


class RunResult:
    """What a program run produced: outputs, modelled time, engine use, traffic and a per-instruction trace.

    Fields: ``name``, ``arch``, ``total_ns``, ``busy_ns`` (queue name -> busy
    ns), ``counts`` (queue name -> instructions), ``hbm_read_bytes``,
    ``hbm_write_bytes``, ``sbuf_peak_bytes`` / ``psum_peak_bytes`` (per
    partition), ``matmul_flops``, ``outputs`` (HBM tensor name -> bound or
    allocated array), ``times`` ((n, 2) start/end ns per instruction),
    ``queues`` / ``opcodes`` ((n,) per instruction), ``wall_s`` (host time of
    the simulation), ``host_ns`` ((n, 2) host ns per instruction in the engine,
    [validation + timing model, C kernel], when :data:`HOST_TIMES` is on; else
    None; see :meth:`host_ns_by_opcode`). ``busy_ns``, ``counts`` and
    ``outputs`` are built on first access (a run only keeps the engine's arrays).
    ``core``, ``queue`` and ``start_ns``: where the run was placed on the
    modelled machine (:mod:`tn.neuron.timeline`; ``start_ns`` None for a result
    not placed, e.g. :func:`simulate_timing`).
    """

    __slots__ = ("name", "arch", "total_ns", "hbm_read_bytes", "hbm_write_bytes", "sbuf_peak_bytes",
                 "psum_peak_bytes", "matmul_flops", "times", "queues", "opcodes", "wall_s", "host_ns",
                 "core", "queue", "start_ns", "_busy", "_counts", "_arrays", "_lazy")
    # "_arrays" (the outputs dict) sorts before "_lazy": CPython clears __slots__ in name order, so a dropped result
    # frees the arrays made from its block before its _Carved, which then sees the block unused and gives it back

    def __init__(self, name, arch, total_ns, busy_ns, counts, hbm_read_bytes, hbm_write_bytes, sbuf_peak_bytes,
                 psum_peak_bytes, matmul_flops, outputs=None, times=None, queues=None, opcodes=None, wall_s=0.0):
        self.name = name
        self.arch = arch
        self.total_ns = total_ns
        self._busy = busy_ns
        self._counts = counts
        self.hbm_read_bytes = hbm_read_bytes
        self.hbm_write_bytes = hbm_write_bytes
        self.sbuf_peak_bytes = sbuf_peak_bytes
        self.psum_peak_bytes = psum_peak_bytes
        self.matmul_flops = matmul_flops
        self._arrays = {} if outputs is None else outputs
        self.times = times
        self.queues = queues
        self.opcodes = opcodes
        self.wall_s = wall_s
        self.host_ns = None
        self.core = self.queue = 0
        self.start_ns = None
        self._lazy = None

    @classmethod
    def _of_run(cls, call, total, times, busy, counts, hbm, values, wall):
        """A run's result from the engine's arrays (the dicts are built when first read)."""
        r = object.__new__(cls)
        r.name = call.name
        r.arch = call.arch
        r.total_ns = float(total)
        r.hbm_read_bytes, r.hbm_write_bytes = hbm.tolist()
        r.sbuf_peak_bytes = call.sbuf_peak_bytes
        r.psum_peak_bytes = call.psum_peak_bytes
        r.matmul_flops = call.matmul_flops
        r.times = times
        r.queues = call.queues
        r.opcodes = call.opcodes
        r.wall_s = wall
        r.host_ns = None
        r.core = r.queue = 0
        r.start_ns = None
        r._busy = r._counts = r._arrays = None
        r._lazy = (call, busy, counts, values)
        return r

    @property
    def busy_ns(self) -> dict:
        """Busy ns per queue name (engines and DMA queues)."""
        d = self._busy
        if d is None:
            call, busy = self._lazy[0], self._lazy[1]
            d = self._busy = dict(zip(call.queue_names, busy.tolist()))
        return d

    @busy_ns.setter
    def busy_ns(self, value):
        self._busy = value

    @property
    def counts(self) -> dict:
        """Instructions per queue name."""
        d = self._counts
        if d is None:
            call, counts = self._lazy[0], self._lazy[2]
            d = self._counts = dict(zip(call.queue_names, counts.tolist()))
        return d

    @counts.setter
    def counts(self, value):
        self._counts = value

    @property
    def outputs(self) -> dict:
        """HBM tensor name -> the array bound (or allocated) for it, every HBM tensor of the program."""
        d = self._arrays
        if d is None:
            call, values = self._lazy[0], self._lazy[3]
            if values and type(values[-1]) is _Carved:
                values = values[-1].fill(call, values[:-1])
            d = self._arrays = dict(zip(call.names, values))
        return d

    @outputs.setter
    def outputs(self, value):
        self._arrays = value

    def __repr__(self) -> str:
        n = len(self.opcodes) if self.opcodes is not None else 0
        return (f"<RunResult {self.name!r} ({self.arch.name}): {n} instructions, {self.total_ns / 1e3:.3f} us "
                f"modelled, HBM read {self.hbm_read_bytes} B / written {self.hbm_write_bytes} B>")

    @property
    def total_us(self) -> float:
        """Modelled time in microseconds."""
        return self.total_ns / 1e3

    @property
    def total_cycles(self) -> int:
        """Modelled time in TensorE clock cycles."""
        return int(round(self.total_ns * self.arch.clock_hz["pe"] / 1e9))

    @property
    def utilisation(self) -> dict:
        """Busy fraction of the run per queue (engines and DMA queues)."""
        t = self.total_ns or 1.0
        return {q: b / t for q, b in self.busy_ns.items()}

    @property
    def busy_cycles(self) -> dict:
        """Busy time per compute engine in that engine's cycles."""
        return {self.arch.queue_name(q): int(round(self.busy_ns[self.arch.queue_name(q)] *
                                                   self.arch.queue_clock_hz(q) / 1e9))
                for q in range(NUM_ENGINES)}

    @property
    def tensor_utilisation(self) -> float:
        """Matmul FLOPs / (TensorE bf16 peak x total time): the fraction of peak TensorE throughput achieved."""
        if self.total_ns <= 0:
            return 0.0
        return self.matmul_flops / (self.arch.peak_flops_bf16 * self.total_ns * 1e-9)

    @property
    def hbm_utilisation(self) -> float:
        """HBM bytes moved / (the core's HBM bandwidth x total time)."""
        if self.total_ns <= 0:
            return 0.0
        return (self.hbm_read_bytes + self.hbm_write_bytes) / (self.arch.hbm_bytes_per_s * self.total_ns * 1e-9)

    @property
    def tflops(self) -> float:
        """Achieved matmul TFLOP/s in modelled time."""
        return self.matmul_flops / (self.total_ns * 1e-9) / 1e12 if self.total_ns > 0 else 0.0

    def host_ns_by_opcode(self) -> dict:
        """Engine host time of this run per opcode name: ``{name: (instructions, validation_ns, kernel_ns)}``
        (from :attr:`host_ns`; empty unless the run had :data:`HOST_TIMES` on)."""
        if self.host_ns is None:
            return {}
        out = {}
        for o, (v, k) in zip(self.opcodes.tolist(), self.host_ns.tolist()):
            name = isa.OPCODE_NAMES.get(int(o), str(o))
            c, a, b = out.get(name, (0, 0.0, 0.0))
            out[name] = (c + 1, a + v, b + k)
        return out

    def instructions(self):
        """Per-instruction records ``(queue name, start_ns, end_ns, opcode name)``."""
        return [(self.arch.queue_name(int(q)), float(s), float(e), isa.OPCODE_NAMES.get(int(o), str(o)))
                for q, (s, e), o in zip(self.queues, self.times, self.opcodes)]

    def summary(self) -> dict:
        """Flat dict of the headline numbers."""
        return {
            "program": self.name, "arch": self.arch.name, "instructions": int(len(self.opcodes)),
            "time_us": self.total_us, "cycles": self.total_cycles, "hbm_read": self.hbm_read_bytes,
            "hbm_write": self.hbm_write_bytes, "sbuf_peak": self.sbuf_peak_bytes, "psum_peak": self.psum_peak_bytes,
            **{f"util_{k}": v for k, v in self.utilisation.items() if self.counts.get(k)},
        }


#: torch device types whose tensors live in host memory the engine can address (tn's neuron device
#: allocates its storage on the host, registered as PrivateUse1 renamed to "neuron").
_HOST_DEVICES = ("cpu", "neuron", "privateuseone")

_TORCH_DTYPES = {"torch.float32": 0, "torch.bfloat16": 1, "torch.float16": 2, "torch.int32": 3, "torch.int64": 4,
                 "torch.uint8": 5, "torch.bool": 6}


def _bind(t, value, want, np_dtype):
    """Address of `value` checked against HBM tensor `t` (dtype, size, contiguity)."""
    if type(value) is np.ndarray:
        if value.dtype != np_dtype:
            hint = " (bf16 binds as uint16 bits: use tn.neuron.runtime.to_bf16)" if want == 1 else ""
            raise NeuronError(f"HBM tensor {t.name!r} is {t.dtype} but the bound array is {value.dtype}{hint}")
        flags = value.flags
        if not flags.c_contiguous:
            raise NeuronError(f"HBM tensor {t.name!r}: bound array is not C-contiguous; pass np.ascontiguousarray(a)")
        if t.kind != "input" and not flags.writeable:
            raise NeuronError(f"HBM tensor {t.name!r} is written by the program but the bound array is read-only")
        nbytes = value.nbytes
        ptr = value.__array_interface__["data"][0]
    elif hasattr(value, "data_ptr") and hasattr(value, "is_contiguous"):  # a torch tensor, duck-typed
        code = _TORCH_DTYPES.get(str(value.dtype))
        if value.device.type not in _HOST_DEVICES:
            raise NeuronError(f"HBM tensor {t.name!r}: bound tensor is on {value.device}; bind a CPU (or neuron "
                              f"device) tensor")
        if code != want:
            raise NeuronError(f"HBM tensor {t.name!r} is {t.dtype} but the bound tensor is {value.dtype}")
        if not value.is_contiguous():
            raise NeuronError(f"HBM tensor {t.name!r}: bound tensor is not contiguous; pass .contiguous()")
        nbytes = value.numel() * value.element_size()
        ptr = value.data_ptr()
        if not ptr and nbytes:  # a tensor without storage (a wrapper subclass, e.g. a tracer's): nothing to read
            raise NeuronError(f"HBM tensor {t.name!r}: the bound {type(value).__name__} has no memory (null "
                              f"address); bind a tensor that holds its values")
    elif isinstance(value, tuple) and len(value) == 2 and all(isinstance(x, int) for x in value):
        ptr, nbytes = value  # raw (address, nbytes): the caller keeps the memory alive during the run
        if ptr <= 0:
            raise NeuronError(f"HBM tensor {t.name!r}: raw binding has a null address")
    else:
        raise NeuronError(f"HBM tensor {t.name!r}: cannot bind a {type(value).__name__}; pass a numpy array, "
                          f"a CPU torch tensor or an (address, nbytes) tuple")
    if nbytes != t.nbytes:
        raise NeuronError(f"HBM tensor {t.name!r} needs {t.nbytes} bytes ({t.dtype}{list(t.shape)}) but the bound "
                          f"value has {nbytes}")
    return ptr


def _with_source(e, enc):
    msg = str(e)

    m = re.match(r"instruction #(\d+)", msg)
    if m and enc.sources:
        k = int(m.group(1))
        if k < len(enc.sources) and enc.sources[k]:
            return NeuronError(f"{msg} [program {enc.name!r}, emitted at {enc.sources[k]}]")
    return NeuronError(f"{msg} [program {enc.name!r}]")


def _matmul_flops(recs):
    mm = recs[recs[:, isa.H_OPCODE] == isa.OPCODES["matmul"]]
    if not len(mm):
        return 0
    s = isa.OPERAND_BASE + isa.OPERAND_WIDTH      # stationary
    m_ = isa.OPERAND_BASE + 2 * isa.OPERAND_WIDTH  # moving
    k = mm[:, s + isa.O_PCOUNT]
    M = np.prod(mm[:, s + isa.O_NUM0:s + isa.O_NUM0 + 8:2], axis=1)
    N = np.prod(mm[:, m_ + isa.O_NUM0:m_ + isa.O_NUM0 + 8:2], axis=1)
    return int(np.sum(2 * k * M * N))


def _prepare(enc):
    """Per-program constants of a run (see Encoded.prepared)."""
    arch = enc.arch
    n = len(enc)
    specs = []
    for t in enc.hbm:
        code = isa.dtype_code(t.dtype)
        specs.append((t, code, np.dtype(isa.numpy_dtype(code))))
    return {
        "records": np.ascontiguousarray(enc.records, dtype=np.int64).reshape(n, isa.REC_WIDTH),
        "deps": np.ascontiguousarray(enc.deps, dtype=np.int64),
        "aux": np.ascontiguousarray(enc.aux, dtype=np.int64),
        "limits": arch.limits_vector(),
        "timing": arch.timing_vector(),
        "specs": specs,
        "index": {t.name: t.index for t in enc.hbm},
        "sizes": np.array([t.nbytes for t in enc.hbm], dtype=np.int64),
        "names": [arch.queue_name(q) for q in range(arch.num_queues)],
        "flops": _matmul_flops(enc.records),
        "queues": enc.records[:, isa.H_QUEUE].copy(),
        "opcodes": enc.records[:, isa.H_OPCODE].copy(),
    }


_ENGINE = []


def _engine():
    """The native engine, imported on first use."""
    if not _ENGINE:
        _ENGINE.append(engine)
    return _ENGINE[0]


_MEMORIES = threading.local()
#: Host bytes added to every SBUF/PSUM partition row (the engine addresses partition p at row p; bounds are the
#: architecture's). The partition sizes are multiples of 4 KiB, so the same offset of every partition would fall
#: into one host L1 cache set and a few L2 sets: kernels that walk across partitions (matmul packing, transposes,
#: DMA rows) evict their own lines. 64 bytes apart, the rows spread over the sets (2-19% on those kernels).
_ROW_PAD = 64


def _mem_shapes(arch):
    """Shapes of the SBUF and PSUM arrays of a run on ``arch`` (rows padded by :data:`_ROW_PAD`)."""
    return ((arch.partitions, arch.sbuf_partition_bytes + _ROW_PAD),
            (arch.partitions, arch.psum_partition_bytes + _ROW_PAD))


def _memories(arch, fresh):
    """SBUF and PSUM arrays for a run: reused per thread and architecture (like a chip's memories, they keep
    what the previous program left), or zeroed ones with ``fresh``."""
    shape_s, shape_p = _mem_shapes(arch)
    if fresh:
        return np.zeros(shape_s, dtype=np.uint8), np.zeros(shape_p, dtype=np.uint8)
    cache = getattr(_MEMORIES, "by_arch", None)
    if cache is None:
        cache = _MEMORIES.by_arch = {}
    mem = cache.get(arch.name)
    if mem is None or mem[0].shape != shape_s or mem[1].shape != shape_p:
        mem = cache[arch.name] = (np.zeros(shape_s, dtype=np.uint8), np.zeros(shape_p, dtype=np.uint8))
    return mem


#: byte alignment of each unbound output/scratch tensor inside the block one call allocates for them
_ALIGN = 64
#: blocks of unbound outputs/scratch a program keeps for reuse (more than one: threads and overlapping results)
_SPARE_BLOCKS = 2
_getrefcount = sys.getrefcount


class _Carved:
    """The unbound outputs/scratch of one run: the ``block`` the run allocated for all of them (at host address
    ``addr``), the HBM tensor indices ``carve`` and their byte offsets (after ``shift``, the block's alignment);
    the last entry of the run's value list (the arrays are made only if :attr:`RunResult.outputs` is read).
    ``at``: None when the value list is positional (one entry per HBM tensor), else the HBM tensor index of each
    of its entries (a :class:`BoundPlan` run; ``block`` is None when it carves nothing).

    The block is not zeroed whole: before the run only the bytes the program may read before writing them and
    the bytes of outputs it never writes are (:class:`_Layout`); ``late`` are the byte ranges (from the aligned
    start) of scratch tensors the program never writes, zeroed when the arrays are first made (:meth:`fill`,
    :meth:`BoundPlan.first`), so every carved tensor reads as if it had started as zeros.

    When the run's result is dropped and no array made from the block is alive, the block goes back to its
    program's ``spare`` list, and the program's next run reuses it instead of allocating a new one: a compiled
    training step carves ~10 MB of scratch per call, and a fresh allocation costs the call a page fault per
    4 KiB page the engine then touches (several ms per GPT-2 step)."""

    __slots__ = ("block", "addr", "shift", "carve", "offsets", "spare", "at", "late")

    def __init__(self, block, addr, shift, carve, offsets, spare=None, at=None, late=()):
        self.block = block
        self.addr = addr
        self.shift = shift
        self.carve = carve
        self.offsets = offsets
        self.spare = spare
        self.at = at
        self.late = late

    def zero_late(self):
        """Zero the never-written scratch ranges (:attr:`late`) now, once: before anyone looks at the block."""
        if self.late:
            _zero_ranges(self.block, self.shift, self.late)
            self.late = ()

    def __del__(self):
        spare = self.spare
        # refcount 2: this slot and getrefcount's argument; an output array made from the block holds a third
        try:
            if spare is not None and len(spare) < _SPARE_BLOCKS and _getrefcount(self.block) == 2:
                spare.append((self.block, self.addr))
        except TypeError:   # interpreter shutdown: module globals already cleared
            pass

    def fill(self, call, values: list) -> list:
        """``values`` (without this entry) as one value per HBM tensor, with each carved tensor's numpy array
        (its dtype and shape) in place."""
        if self.at is None:
            values = list(values)
        else:
            full = [None] * len(call.names)
            for i, v in zip(self.at, values):
                full[i] = v
            values = full
        if self.late:
            self.zero_late()
        for i, o in zip(self.carve, self.offsets):
            t, _, np_dtype, _ = call._specs[i]
            o += self.shift
            values[i] = self.block[o:o + call._fast[i][1]].view(np_dtype).reshape(tuple(t.shape))
        return values


def _unbound(program: str, t) -> NeuronError:
    """The error for HBM tensor ``t`` of ``program`` left unbound where the run cannot allocate it (an input)."""
    return NeuronError(f"program {program!r}: {t.kind} HBM tensor {t.name!r} ({t.dtype}{list(t.shape)}) is not "
                       f"bound; pass it in bindings")


def _zero_ranges(block, shift, ranges):
    """Zero the byte ``ranges`` (``(start, stop)`` from the block's first aligned byte, ``shift``) of ``block``."""
    for a, b in ranges:
        block[shift + a:shift + b] = 0


def _take_block(spare, size, zero):
    """``(block, address)``: a uint8 block of ``size`` bytes, a spare one of that size when there is one, with
    the byte ranges ``zero`` (from its first :data:`_ALIGN`-aligned byte) zeroed, or all of it when ``zero`` is
    None; the other bytes hold whatever they held."""
    while spare:
        try:
            block, addr = spare.pop()   # atomic: two threads never get the same block
        except IndexError:
            break
        if block.nbytes == size:
            if zero is None:
                block.fill(0)
            elif zero:
                _zero_ranges(block, -addr % _ALIGN, zero)
            return block, addr
    if zero is None:
        block = np.zeros(size, np.uint8)
        return block, block.__array_interface__["data"][0]
    # not np.zeros: a freed block of this size raises glibc's mmap threshold, so the next one comes from the heap
    # and calloc would clear all of it
    block = np.empty(size, np.uint8)
    addr = block.__array_interface__["data"][0]
    _zero_ranges(block, -addr % _ALIGN, zero)
    return block, addr


def _carve_offsets(fast, carve):
    """Byte offsets of the carved HBM tensors ``carve`` in their block (each aligned to :data:`_ALIGN`), and the
    block's size (one alignment more, for the block's own alignment)."""
    offsets = []
    off = 0
    for i in carve:
        offsets.append(off)
        off += (fast[i][1] + _ALIGN - 1) & -_ALIGN
    return offsets, off + _ALIGN


#: zero ranges of a block less than this many bytes apart are zeroed as one (with the gap the program writes)
_MERGE_GAP = 4096
#: a slice assignment's fixed cost in bytes of memset: a block whose ranges cost about as much as zeroing all of it
#: (bytes + this per range) is zeroed whole, in one call
_RANGE_COST = 8192
#: carve layouts a PreparedCall remembers (one per set of HBM tensors left unbound)
_MAX_LAYOUTS = 16


class _Layout:
    """Where a run's unbound outputs/scratch ``carve`` (HBM indices) go in their block, and what of it to zero:
    ``offsets`` (bytes from the block's aligned start), ``size`` (the block's), ``zero`` (byte ranges zeroed
    before the run, or None for the whole block), ``late`` (ranges of never-written scratch, zeroed when the
    arrays are made; see :class:`_Carved`) and ``late_at`` (the HBM indices of the tensors ``late`` covers).
    Made once per program and set of unbound tensors, from :meth:`PreparedCall.zero_ranges`."""

    __slots__ = ("carve", "offsets", "size", "zero", "late", "late_at")

    def __init__(self, call, carve):
        offsets, size = _carve_offsets(call._fast, carve)
        ranges = call.zero_ranges()
        kinds = call.kinds
        before = {}
        late = {}
        for i in carve:          # only outputs and scratch tensors are carved: each has its ranges
            r = ranges[i]
            if kinds[i] == "scratch":
                before[i] = r.read_first
                late[i] = r.unwritten
            else:
                before[i] = r.read_first + r.unwritten
        zero = block_ranges(before, carve, offsets, _MERGE_GAP)
        if sum(b - a + _RANGE_COST for a, b in zero) >= size:
            zero = None
        self.carve = tuple(carve)
        self.offsets = tuple(offsets)
        self.size = size
        self.zero = zero
        self.late = block_ranges(late, carve, offsets, _MERGE_GAP) if zero is not None else ()
        self.late_at = tuple(i for i in carve if late.get(i)) if zero is not None else ()


class PreparedCall:
    """One encoded program made ready for repeated runs with positional bindings (the fast entry).

    Get it with :meth:`tn.neuron.program.Encoded.prepare_call` (made once per
    program and shared: it holds no per-run state, so threads may use it
    together). ``call(values)`` runs the program like :func:`run` with
    ``values[i]`` bound to the i-th HBM tensor (declaration order, see
    :attr:`names`): a numpy array, a contiguous CPU (or neuron-device) torch
    tensor or a raw ``(address, nbytes)`` tuple, used in place; ``None`` (or a
    shorter list) leaves an output/scratch tensor to be allocated (zeros), and
    an input unbound, which is an error. A torch tensor of the expected dtype
    and size, contiguous, on the CPU costs a few attribute reads; anything else
    goes through the full checks of :func:`run` and fails with the same
    :class:`tn.NeuronError` (wrong dtype, size, device, layout). The call keeps
    what it runs but not the program object (``enc`` is a weak reference).
    """

    __slots__ = ("_enc", "name", "sources", "arch", "names", "kinds", "_specs", "_fast", "_args", "_n", "_nq",
                 "queue_names", "queues", "opcodes", "sbuf_peak_bytes", "psum_peak_bytes", "matmul_flops",
                 "_engine_run", "_mem_shapes", "_times_shape", "_spare", "_hbm", "_zero", "_layouts")

    def __init__(self, enc):
        _TENSOR[0] = torch.Tensor
        prep = enc.prepared()
        self._enc = weakref.ref(enc)  # the program caches this object: no reference cycle back to it
        self.name = enc.name
        self.sources = enc.sources
        self.arch = enc.arch
        self.names = tuple(t.name for t in enc.hbm)
        self.kinds = tuple(t.kind for t in enc.hbm)
        tdt = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16, 3: torch.int32, 4: torch.int64,
               5: torch.uint8, 6: torch.bool}
        self._specs = tuple((t, code, np_dtype, t.kind in ("output", "scratch")) for t, code, np_dtype in prep["specs"])
        # (torch dtype, nbytes) a CPU tensor needs to take the fast path
        self._fast = tuple((tdt.get(code), t.nbytes) for t, code, _ in prep["specs"])
        self._args = (prep["records"], prep["deps"], prep["aux"], prep["sizes"], prep["limits"], prep["timing"])
        self._n = len(enc)
        self._nq = len(prep["names"])
        self.queue_names = tuple(prep["names"])
        self.queues = prep["queues"]
        self.opcodes = prep["opcodes"]
        self.sbuf_peak_bytes = int(enc.sbuf_peak_bytes)
        self.psum_peak_bytes = int(enc.psum_peak_bytes)
        self.matmul_flops = prep["flops"]
        self._engine_run = _engine().run
        arch = enc.arch
        self._mem_shapes = _mem_shapes(arch)
        self._times_shape = (self._n or 1, 2)
        self._spare = []  # blocks of unbound outputs/scratch given back by dropped results (see _Carved)
        self._hbm = tuple(enc.hbm)
        self._zero = None     # zero_ranges() of the program, on first use
        self._layouts = {}    # carve tuple -> _Layout

    def zero_ranges(self) -> dict:
        """:func:`tn.neuron.zeroing.zero_ranges` of the program (computed on first use, then kept): per output
        and scratch tensor, the bytes a run may read before writing them and the bytes it never writes."""
        z = self._zero
        if z is None:
            z = self._zero = zero_ranges(self._args[0], self._hbm)
        return z

    def _layout(self, carve) -> "_Layout":
        """The :class:`_Layout` of a run leaving the HBM tensors ``carve`` (a tuple) unbound (made once)."""
        lay = self._layouts.get(carve)
        if lay is None:
            lay = _Layout(self, carve)
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[carve] = lay
        return lay

    @property
    def enc(self):
        """The :class:`~tn.neuron.program.Encoded` program (None once it is gone)."""
        return self._enc()

    def __repr__(self):
        return f"<PreparedCall {self.name!r}: {', '.join(f'{n} ({k})' for n, k in zip(self.names, self.kinds))}>"

    def _pointers(self, values):
        """``(pointers, values)``: the checked address of every HBM tensor for ``values`` (allocating unbound
        outputs/scratch), and the list of bound/allocated arrays (keep it alive while the run uses them).

        The unbound outputs/scratch of one call share one block (one allocation instead of one ``np.zeros``
        and one address check per tensor: a compiled program has dozens of scratch tensors), zeroed where the
        program could tell (see :class:`_Carved`); their entries in the list are None and one :class:`_Carved`
        at its end says where they are (the arrays are made when :attr:`RunResult.outputs` is read)."""
        specs = self._specs
        if len(values) != len(specs):
            if len(values) > len(specs):
                raise NeuronError(f"{len(values)} values bound but program {self.name!r} declares "
                                  f"{len(specs)} HBM tensors")
            values = list(values) + [None] * (len(specs) - len(values))
        ptrs = []
        bound = []
        carve = None
        tensor = _TENSOR[0]
        for (t, code, np_dtype, alloc), (tdt, nbytes), v in zip(specs, self._fast, values):
            if type(v) is tensor and v.dtype is tdt and v.is_cpu and v.is_contiguous() and v.nbytes == nbytes:
                ptrs.append(v.data_ptr())
            elif v is None:
                if not alloc:
                    raise _unbound(self.name, t)
                if carve is None:
                    carve = []
                carve.append(len(ptrs))
                ptrs.append(0)
                bound.append(None)
                continue
            else:
                ptrs.append(_bind(t, v, code, np_dtype))
            bound.append(v)
        if carve is not None:
            lay = self._layout(tuple(carve))
            block, addr = _take_block(self._spare, lay.size, lay.zero)
            shift = -addr % _ALIGN
            base = addr + shift
            for i, o in zip(carve, lay.offsets):
                ptrs[i] = base + o
            bound.append(_Carved(block, addr, shift, lay.carve, lay.offsets, self._spare, None, lay.late))
        return ptrs, bound

    def __call__(self, values=(), *, report: bool = True, fresh_memory: bool = False) -> RunResult:
        """Run once with ``values`` bound positionally (see the class docstring); returns the :class:`RunResult`
        (reported to active profilers unless ``report=False``)."""
        ptrs, bound = self._pointers(values)
        return self._run(np.array(ptrs, _I64), bound, report, fresh_memory)

    def plan(self, indices) -> "BoundPlan":
        """A :class:`BoundPlan` of this program binding the HBM tensors ``indices`` (in that order), every other
        output/scratch tensor allocated (zeros) by each run. Raises :class:`tn.NeuronError` when an input is
        left out or an index is repeated or out of range."""
        return BoundPlan(self, indices)

    def _run(self, ptrs, bound, report, fresh_memory):
        """Run with the HBM addresses ``ptrs`` (an int64 array) while ``bound`` keeps the memory alive; the
        :class:`RunResult` (``bound`` becomes its lazy ``outputs``), placed on the current queue and reported."""
        mem = None
        if not fresh_memory:
            cache = getattr(_MEMORIES, "by_arch", None)
            if cache is not None:
                mem = cache.get(self.arch.name)
                if mem is not None and (mem[0].shape != self._mem_shapes[0] or mem[1].shape != self._mem_shapes[1]):
                    mem = None
        sbuf, psum = mem if mem is not None else _memories(self.arch, fresh_memory)
        n = self._n
        nq = self._nq
        times = np.empty(self._times_shape)
        busy = np.empty(nq)
        counts = np.empty(nq, _I64)
        hbm = np.empty(2, _I64)
        recs, deps, aux, sizes, limits, timing = self._args
        host = np.zeros(self._times_shape) if HOST_TIMES[0] else None
        t0 = _perf_counter()
        try:
            total = self._engine_run(recs, deps, aux, sbuf, psum, ptrs, sizes, limits, timing,
                                     times, busy, counts, hbm, 1, host)
        except NeuronError as e:
            raise _with_source(e, self) from None
        wall = _perf_counter() - t0
        res = RunResult._of_run(self, total, times if n else times[:0], busy, counts, hbm, bound, wall)
        if host is not None:
            res.host_ns = host[:n]
        q = _current_queue()
        res.core = q.core
        res.queue = q.id
        res.start_ns = _advance(res.total_ns, queue=q)[0]
        if report:
            for _, fn in _LISTENERS:
                fn(res)
        return res


class BoundPlan:
    """A :class:`PreparedCall` with a fixed set of bound HBM tensors: the entry of callers that bind the same
    tensors every run and have checked the values themselves (the compiler's executables).

    Made by :meth:`PreparedCall.plan` (immutable: threads may share it). ``at`` is the HBM tensor index of each
    bound value; every other tensor is an output or scratch tensor the run allocates (zeros, one block per run as
    in :meth:`PreparedCall.__call__`, reused when a dropped result gives it back). Per run nothing is looked
    up or checked per HBM tensor: the pointer array is a precomputed template of the allocated tensors' offsets
    plus the block's address, with the bound addresses stored over it.

    ``plan(values, ptrs)`` runs once: ``values[k]`` is the value bound to HBM tensor ``at[k]`` (kept alive by
    the result and shown in its ``outputs``) and ``ptrs[k]`` its address, which the caller has checked as
    :func:`run` would (host memory, dtype, size, contiguity; :meth:`fast` gives the expected torch dtype and
    size, :meth:`address` runs the full check with :func:`run`'s errors).
    """

    __slots__ = ("call", "at", "_at", "_specs", "fast", "_carve", "_offsets", "_size", "_tmpl", "_pos", "_order",
                 "_zero", "_late", "_late_at")

    def __init__(self, call, indices):
        at = tuple(int(i) for i in indices)
        n = len(call._specs)
        if len(set(at)) != len(at) or any(not 0 <= i < n for i in at):
            raise NeuronError(f"program {call.name!r}: a plan binds HBM tensors {list(at)}: each index once, "
                              f"below {n}")
        taken = set(at)
        carve = tuple(i for i in range(n) if i not in taken)
        for i in carve:
            t, _, _, alloc = call._specs[i]
            if not alloc:
                raise _unbound(call.name, t)
        self.call = call
        self.at = at
        self._at = np.array(at, _I64)
        self._specs = tuple(call._specs[i] for i in at)
        #: (torch dtype, nbytes) of each bound value, in plan order
        self.fast = tuple(call._fast[i] for i in at)
        lay = call._layout(carve) if carve else None
        offsets = lay.offsets if carve else []
        self._carve = carve
        self._offsets = tuple(offsets)
        self._size = lay.size if carve else 0
        self._zero = lay.zero if carve else ()
        self._late = lay.late if carve else ()
        self._late_at = frozenset(lay.late_at) if carve else frozenset()
        tmpl = np.zeros(n, _I64)
        tmpl[list(carve)] = offsets
        self._tmpl = tmpl
        self._pos = {i: k for k, i in enumerate(carve)}
        # nothing carved: the addresses in HBM order are a permutation of the bound ones (None: the same order)
        self._order = None if carve or at == tuple(range(n)) else tuple(at.index(i) for i in range(n))

    def __repr__(self):
        return f"<BoundPlan {self.call.name!r}: binds {[self.call.names[i] for i in self.at]}>"

    def address(self, k, value) -> int:
        """The address of ``value`` bound as the plan's ``k``-th value, checked as :func:`run` checks a binding
        (same :class:`tn.NeuronError` when it does not fit)."""
        t, code, np_dtype, _ = self._specs[k]
        return _bind(t, value, code, np_dtype)

    def __call__(self, values, ptrs, *, report: bool = True) -> RunResult:
        """Run once with ``values`` at ``ptrs`` (see the class docstring); the :class:`RunResult` (reported to
        active profilers unless ``report=False``)."""
        call = self.call
        if len(ptrs) != len(self.at):
            raise NeuronError(f"program {call.name!r}: {len(ptrs)} addresses for a plan binding {len(self.at)}")
        if self._size:
            spare = call._spare
            block, addr = _take_block(spare, self._size, self._zero)
            shift = -addr % _ALIGN
            arr = self._tmpl + (addr + shift)
            carved = _Carved(block, addr, shift, self._carve, self._offsets, spare, self.at, self._late)
            arr[self._at] = ptrs
        else:       # one numpy call: fewer distinct code paths touched per run (they are cold after the engine)
            order = self._order
            arr = np.array(ptrs if order is None else [ptrs[k] for k in order], _I64)
            carved = _Carved(None, 0, 0, (), (), None, self.at)
        bound = list(values)
        bound.append(carved)
        return call._run(arr, bound, report, False)

    def first(self, res, index):
        """The first element (a numpy scalar) of the allocated HBM tensor ``index`` in ``res``, a run of this
        plan (without making every output array as :attr:`RunResult.outputs` does)."""
        carved = res._lazy[3][-1]
        if carved.late and index in self._late_at:    # a never-written scratch tensor: zeros, as promised
            carved.zero_late()
        k = self._pos[index]
        o = carved.shift + self._offsets[k]
        np_dtype = self.call._specs[index][2]
        return carved.block[o:o + np_dtype.itemsize].view(np_dtype)[0]


_I64 = np.dtype(np.int64)
_perf_counter = time.perf_counter
_current_queue = _timeline.current_queue
_advance = _timeline.advance
#: ``HOST_TIMES[0]``: runs record the engine's host ns per instruction in ``RunResult.host_ns`` (profiling the
#: simulator itself; two clock reads per instruction). Set by ``TN_ENGINE_HOST_TIMES=1`` or assigned directly.
HOST_TIMES = [config.get("engine_host_times")]
_TENSOR = [None]  # torch.Tensor, set on first use (the fast binding path compares types exactly)


def simulate_timing(enc):
    """Validate the whole encoded program and model its timing without any data (returns a RunResult
    without outputs). Raises :class:`tn.NeuronError` on any rule violation."""
    call = enc.prepare_call()
    prep = enc.prepared()
    n, nq = call._n, call._nq
    times = np.zeros((max(n, 1), 2), dtype=np.float64)
    busy = np.zeros(nq, dtype=np.float64)
    counts = np.zeros(nq, dtype=np.int64)
    hbm = np.zeros(2, dtype=np.int64)
    dummy = np.zeros((1, 1), dtype=np.uint8)
    try:
        total = call._engine_run(prep["records"], prep["deps"], prep["aux"], dummy, dummy,
                                 np.zeros(len(enc.hbm), dtype=np.int64), prep["sizes"], prep["limits"],
                                 prep["timing"], times, busy, counts, hbm, 0)
    except NeuronError as e:
        raise _with_source(e, enc) from None
    return RunResult._of_run(call, total, times[:n], busy, counts, hbm, (), 0.0)


def run(program, bindings=None, *, report: bool = True, fresh_memory: bool = False) -> RunResult:
    """Run a :class:`~tn.neuron.program.Program` or :class:`~tn.neuron.program.Encoded` program.

    ``bindings``: dict HBM-tensor name -> numpy array, CPU (or neuron-device)
    torch tensor or raw ``(address, nbytes)`` tuple (or a list in declaration
    order). Inputs must be bound; unbound outputs and
    scratch tensors are allocated (zeros) and returned in ``outputs``. Bound
    arrays are used in place: outputs written by the program appear in them.
    ``report``: notify active profilers (``tn.profile``). ``fresh_memory``:
    start from zeroed SBUF/PSUM (by default they are reused per thread, so a
    program reading memory it never wrote sees what an earlier run left, as
    on the chip). For repeated runs of one program,
    :meth:`~tn.neuron.program.Encoded.prepare_call` skips the per-call set-up.
    """
    enc = program.build(check=False) if isinstance(program, Program) else program
    if not isinstance(enc, Encoded):
        raise NeuronError(f"run() needs a Program or an Encoded program, not {type(program).__name__}")
    call = enc.prepare_call()
    if bindings is None:
        values = ()
    elif isinstance(bindings, (list, tuple)):
        values = bindings   # checked by the call (at most one value per HBM tensor)
    else:
        index = enc.prepared()["index"]
        if len(bindings) > len(enc.hbm) or any(k not in index for k in bindings):
            unknown = set(bindings) - {t.name for t in enc.hbm}
            raise NeuronError(f"program {enc.name!r} has no HBM tensor named {sorted(unknown)}; declared: "
                              f"{[t.name for t in enc.hbm]}")
        get = bindings.get
        values = [get(name) for name in call.names]
    return call(values, report=report, fresh_memory=fresh_memory)


register_runtime(prepare=_prepare, PreparedCall=PreparedCall, run=run, simulate_timing=simulate_timing)
