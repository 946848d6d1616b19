# Runs encoded NeuronCore programs on the native engine with HBM bindings and reports results, timing and traffic.
"""Run NeuronCore programs.

:func:`run` binds HBM tensors to host memory (numpy arrays or CPU torch
tensors, by pointer, without copying), gives the program fresh SBUF/PSUM,
executes the encoded stream natively (validation, math and timing in one
pass, see ``_native/engine.pyx``) and returns a :class:`RunResult`.

Every run is reported to the active profilers (:func:`tn.profile` pushes one
with :func:`add_listener`), whatever door started it.

bfloat16 on the host: numpy has no bf16, so bf16 HBM tensors bind to torch
``bfloat16`` tensors or to ``uint16`` numpy arrays holding the raw bits
(:func:`to_bf16` / :func:`from_bf16` convert, rounding to nearest even).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import NeuronError
from . import isa
from .arch import NUM_ENGINES, Arch

__all__ = ["run", "RunResult", "simulate_timing", "to_bf16", "from_bf16", "add_listener", "remove_listener",
           "active_listeners"]

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


def active_listeners() -> tuple:
    """The listener functions registered now (empty when no profiler is active)."""
    return tuple(fn for _, fn in _LISTENERS)


def to_bf16(a) -> np.ndarray:
    """float array -> uint16 array of bfloat16 bits (round to nearest even, NaN kept)."""
    from .._native import _kernels

    src = np.ascontiguousarray(a, dtype=np.float32)
    out = np.empty(src.shape, dtype=np.uint16)
    ffi = _kernels.ffi
    _kernels.lib.tn_cvt_f32_to_bf16(ffi.from_buffer("float[]", src), ffi.from_buffer("uint16_t[]", out), src.size)
    return out


def from_bf16(bits) -> np.ndarray:
    """uint16 array of bfloat16 bits -> float32 array (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


@dataclass
class RunResult:
    """What a program run produced: outputs, modelled time, engine use, traffic and a per-instruction trace."""

    name: str
    arch: Arch
    total_ns: float
    busy_ns: dict                 # queue name -> busy ns
    counts: dict                  # queue name -> instructions
    hbm_read_bytes: int
    hbm_write_bytes: int
    sbuf_peak_bytes: int          # per partition
    psum_peak_bytes: int          # per partition
    matmul_flops: int
    outputs: dict = field(default_factory=dict)   # HBM tensor name -> bound or allocated array
    times: np.ndarray = None      # (n, 2) start/end ns per instruction
    queues: np.ndarray = None     # (n,) queue id
    opcodes: np.ndarray = None    # (n,) opcode
    wall_s: float = 0.0           # host time of the simulation

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


def _bind(t, value, keep, want, np_dtype):
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
    keep.append(value)
    return ptr


def _with_source(e, enc):
    msg = str(e)
    import re

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


_LAZY = {}


def _lazy():
    """Modules imported on first use (the native engine; program.py imports this module)."""
    if not _LAZY:
        from .._native import engine
        from .program import Encoded, Program

        _LAZY.update(engine=engine, Encoded=Encoded, Program=Program)
    return _LAZY


def _execute(enc, ptrs, execute, sbuf=None, psum=None):
    engine = _lazy()["engine"]
    prep = enc.prepared()
    n = len(enc)
    nq = len(prep["names"])
    times = np.zeros((max(n, 1), 2), dtype=np.float64)
    busy = np.zeros(nq, dtype=np.float64)
    counts = np.zeros(nq, dtype=np.int64)
    hbm = np.zeros(2, dtype=np.int64)
    if sbuf is None:
        sbuf = np.zeros((1, 1), dtype=np.uint8)
        psum = np.zeros((1, 1), dtype=np.uint8)
    try:
        total = engine.run(prep["records"], prep["deps"], prep["aux"], sbuf, psum,
                           np.asarray(ptrs, dtype=np.int64), prep["sizes"],
                           prep["limits"], prep["timing"], times, busy, counts, hbm, execute)
    except NeuronError as e:
        raise _with_source(e, enc) from None
    return total, times[:n], busy, counts, hbm


def simulate_timing(enc):
    """Validate the whole encoded program and model its timing without any data (returns a RunResult
    without outputs). Raises :class:`tn.NeuronError` on any rule violation."""
    total, times, busy, counts, hbm = _execute(enc, [0] * len(enc.hbm), 0)
    return _result(enc, total, times, busy, counts, hbm, {}, 0.0)


def _result(enc, total, times, busy, counts, hbm, outputs, wall):
    prep = enc.prepared()
    names = prep["names"]
    return RunResult(
        name=enc.name, arch=enc.arch, total_ns=float(total),
        busy_ns=dict(zip(names, busy.tolist())),
        counts=dict(zip(names, counts.tolist())),
        hbm_read_bytes=int(hbm[0]), hbm_write_bytes=int(hbm[1]),
        sbuf_peak_bytes=int(enc.sbuf_peak_bytes), psum_peak_bytes=int(enc.psum_peak_bytes),
        matmul_flops=prep["flops"], outputs=outputs, times=times,
        queues=prep["queues"], opcodes=prep["opcodes"], wall_s=wall,
    )


_MEMORIES = threading.local()


def _memories(arch, fresh):
    """SBUF and PSUM arrays for a run: reused per thread and architecture (like a chip's memories, they keep
    what the previous program left), or zeroed ones with ``fresh``."""
    shape_s = (arch.partitions, arch.sbuf_partition_bytes)
    shape_p = (arch.partitions, arch.psum_partition_bytes)
    if fresh:
        return np.zeros(shape_s, dtype=np.uint8), np.zeros(shape_p, dtype=np.uint8)
    cache = getattr(_MEMORIES, "by_arch", None)
    if cache is None:
        cache = _MEMORIES.by_arch = {}
    mem = cache.get(arch.name)
    if mem is None or mem[0].shape != shape_s or mem[1].shape != shape_p:
        mem = cache[arch.name] = (np.zeros(shape_s, dtype=np.uint8), np.zeros(shape_p, dtype=np.uint8))
    return mem


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
    on the chip).
    """
    lz = _lazy()
    Encoded, Program = lz["Encoded"], lz["Program"]
    enc = program.build(check=False) if isinstance(program, Program) else program
    if not isinstance(enc, Encoded):
        raise NeuronError(f"run() needs a Program or an Encoded program, not {type(program).__name__}")
    if bindings is None:
        bindings = {}
    if isinstance(bindings, (list, tuple)):
        if len(bindings) > len(enc.hbm):
            raise NeuronError(f"{len(bindings)} values bound but program {enc.name!r} declares {len(enc.hbm)} HBM "
                              f"tensors")
        bindings = {t.name: v for t, v in zip(enc.hbm, bindings)}
    if len(bindings) > len(enc.hbm) or any(k not in enc.prepared()["index"] for k in bindings):
        unknown = set(bindings) - {t.name for t in enc.hbm}
        raise NeuronError(f"program {enc.name!r} has no HBM tensor named {sorted(unknown)}; declared: "
                          f"{[t.name for t in enc.hbm]}")
    keep, ptrs, outputs = [], [], {}
    for t, code, np_dtype in enc.prepared()["specs"]:
        v = bindings.get(t.name)
        if v is None:
            if t.kind in ("output", "scratch"):
                v = np.zeros(t.shape, dtype=np_dtype)
            else:
                raise NeuronError(f"program {enc.name!r}: {t.kind} HBM tensor {t.name!r} ({t.dtype}{list(t.shape)}) "
                                  f"is not bound; pass it in bindings")
        ptrs.append(_bind(t, v, keep, code, np_dtype))
        outputs[t.name] = v
    sbuf, psum = _memories(enc.arch, fresh_memory)
    t0 = time.perf_counter()
    total, times, busy, counts, hbm = _execute(enc, ptrs, 1, sbuf, psum)
    wall = time.perf_counter() - t0
    del keep
    res = _result(enc, total, times, busy, counts, hbm, outputs, wall)
    if report:
        for _, fn in _LISTENERS:
            fn(res)
    return res
