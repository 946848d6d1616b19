# Bench: host cost of each C kernel of the software NeuronCore engine (ns per element), optionally against a baseline build.
"""Host cost per kernel of the NeuronCore engine (``_native/engine.pyx`` + ``kernels.c`` / ``matmul.c``).

Usage::

    python bench/engine_kernels.py [--repeats 7] [--only SUBSTR[,SUBSTR]] [--cold] [--baseline PATH/engine.so
                                   [--baseline-padded]] [--host-split] [--json PATH]

Every row is one instruction kind on typical tile shapes (a GPT-2 block
uses 128-partition tiles of 64..1024 elements). Its program holds ``R``
copies of the instruction with the operands already in SBUF/PSUM (written
into the memories before the run, no DMA), and the engine runs it whole; a
row's time is ``(run(R copies) - run(0 copies)) / R``, so it counts the
kernel plus the per-instruction validation and timing model, not the run's
fixed cost (each of the two is taken as its own min / median over the
repeats, then subtracted). ``ns/elem`` divides by the output's element count (matmul: by
``M*N``, its PSUM tile; DMA: by elements moved).

The copies share their operands, so from the second copy on they sit in the
host's L1/L2 caches; in a real program (a GPT-2 step) a kernel mostly meets
operands that are not cached. ``--cold`` gives every copy its own tiles and
HBM tensors (while SBUF/PSUM have room), which is closer to that: check a
change with both (issue 13 measured a transpose that was 3x faster cached and
2x slower in the GPT-2 step).

Times are ``min / median`` over ``--repeats`` repeats; with ``--baseline``
a second engine (an ``engine.*.so`` built from another checkout, e.g. the
commit before a change) runs the same programs, interleaved with this one
(A, B, A, B, ...) so machine noise hits both alike, and ``speedup`` is
baseline min / this min (on a shared machine the minimum is the stable
statistic; medians move with other processes). The engines are loaded side
by side (each ``.so`` links its own copy of the C kernels). This engine
gets the SBUF/PSUM layout the runtime gives runs (padded partition rows),
the baseline unpadded rows (an older engine addresses partitions by the
architecture's size) unless ``--baseline-padded`` gives it the padded rows too
(for a baseline that takes them: the comparison is then of the kernels alone).

``--workload gpt2|mlp`` measures the engine inside a real training step
instead (the workloads of ``bench/eager_windows.py``; ``--mode`` ``tn.jit``
or ``device adaptive``): ``--steps`` steps run with the engine's per-
instruction host accounting on; each instruction's validation and kernel ns
is its minimum over the steps (machine noise only adds), summed per opcode.
With ``--baseline`` the steps alternate between the two engines (every
compiled program calls whichever is selected), so both run the same programs
on the same data in one process.

``--host-split`` also prints, from this engine's ``host_ns`` accounting, the
validation ns per instruction and the kernel ns per element separately.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tn.neuron import Program, isa, runtime  # noqa: E402

try:
    from tabulate import tabulate
except ImportError:  # pragma: no cover
    tabulate = None

P = 128
R = 16  # instruction copies per program


def load_engine(path=None):
    """The engine module: this checkout's, or a copy of ``engine.*.so`` loaded from ``path`` (own module object)."""
    if path is None:
        from tn._native import engine
        return engine
    spec = importlib.util.spec_from_file_location("tn._native.engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- data

def _bf16_bits(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _values(dtype, shape, rng, lo, hi):
    x = rng.uniform(lo, hi, size=shape).astype(np.float32)
    if dtype == "bfloat16":
        return _bf16_bits(x)
    if dtype == "bool":
        return (x > (lo + hi) / 2).astype(np.uint8)
    if dtype == "int32":
        return x.astype(np.int32)
    return x


class Case:
    """One row: builds its program with n copies of the instruction and fills its operands."""

    def __init__(self, name, elems, emit, tiles, lo=-4.0, hi=4.0, hbm=None, neg_inf=0.0):
        self.name, self.elems, self.emit, self.tiles, self.lo, self.hi = name, elems, emit, tiles, lo, hi
        self.hbm = hbm or []   # [(name, shape, dtype, kind)]
        self.neg_inf = neg_inf  # fraction of float inputs set to -inf (masked attention scores)

    def build(self, n, cold=False):
        """(Encoded, [(key, Tile)]) with n copies. ``cold``: every copy has its own tiles and HBM tensors while
        SBUF/PSUM have room (then the copies cycle through the sets made), so a copy's operands are not the ones the
        previous copy left in the host's L1/L2 caches, as in a real program."""
        prog = Program(f"bench_{self.name}")
        sets = []
        for k in range(max(n, 1) if cold else 1):
            try:
                hbm = {h[0]: prog.hbm(f"{h[0]}{k}", *h[1:]) for h in self.hbm}
                t = {key: (prog.sbuf if mem == "sbuf" else prog.psum)(shape, dtype, name=f"{key}{k}")
                     for key, (mem, shape, dtype) in self.tiles.items()}
            except Exception:   # SBUF/PSUM full: cycle through the sets made so far
                break
            sets.append((t, hbm))
        for k in range(n):
            t, hbm = sets[k % len(sets)]
            self.emit(prog, t, hbm)
        return prog.build(check=False), [(key, tile) for t, _ in sets for key, tile in t.items()]

    def fill(self, tiles, sbuf, psum, rng):
        """Write random operands into the memories; returns [(memory, rows, cols, bytes)] to restore them."""
        saved = []
        for key, tile in tiles:
            mem = sbuf if tile.mem == isa.MEM_SBUF else psum
            dtype = self.tiles[key][2]
            nfree = int(np.prod(self.tiles[key][1][1:]))
            vals = _values(dtype, (tile.pcount, nfree), rng, self.lo, self.hi)
            if self.neg_inf and dtype == "float32":
                vals[rng.uniform(size=vals.shape) < self.neg_inf] = -np.inf
            raw = np.ascontiguousarray(vals).view(np.uint8).reshape(tile.pcount, -1)
            rows, cols = slice(tile.pstart, tile.pstart + tile.pcount), slice(tile.offset, tile.offset + raw.shape[1])
            mem[rows, cols] = raw
            saved.append((mem, rows, cols, raw.copy()))
        return saved


def _cases():
    cs = []
    # ---- ScalarE activations, [128, 512]
    funcs = [("identity", -4, 4), ("relu", -4, 4), ("gelu_tanh", -6, 6), ("gelu", -6, 6), ("sigmoid", -10, 10),
             ("tanh", -6, 6), ("exp", -20, 20), ("silu", -10, 10), ("erf", -4, 4), ("softplus", -10, 10),
             ("log", 0.01, 100), ("sqrt", 0.01, 100), ("rsqrt", 0.01, 100), ("reciprocal", 0.5, 100),
             ("sin", -10, 10)]
    F = 512
    for dt in ("float32", "bfloat16"):
        for fn, lo, hi in funcs:
            cs.append(Case(f"act {fn} {dt}", P * F,
                           (lambda fn: lambda p, t, h: p.activation(t["o"], t["i"], fn))(fn),
                           {"o": ("sbuf", (P, F), dt), "i": ("sbuf", (P, F), dt)}, lo, hi))
    cs.append(Case("act exp scale+bias+reduce f32", P * F,
                   lambda p, t, h: p.activation(t["o"], t["i"], "exp", scale=0.125, bias=t["b"], reduce_op="add",
                                                reduce_out=t["r"]),
                   {"o": ("sbuf", (P, F), "float32"), "i": ("sbuf", (P, F), "float32"),
                    "b": ("sbuf", (P, 1), "float32"), "r": ("sbuf", (P, 1), "float32")}))
    cs.append(Case("act identity+bias PSUM->bf16", P * F,
                   lambda p, t, h: p.activation(t["o"], t["i"], "identity", bias=t["b"]),
                   {"o": ("sbuf", (P, F), "bfloat16"), "i": ("psum", (P, F), "float32"),
                    "b": ("sbuf", (P, 1), "float32")}))
    cs.append(Case("act gelu_tanh PSUM->bf16", P * F,
                   lambda p, t, h: p.activation(t["o"], t["i"], "gelu_tanh", bias=t["b"]),
                   {"o": ("sbuf", (P, F), "bfloat16"), "i": ("psum", (P, F), "float32"),
                    "b": ("sbuf", (P, 1), "float32")}))
    # ---- small rows, as a GPT-2 block's attention and epilogues have them ([128, 128])
    cs.append(Case("act exp+scale+bias+reduce f32 [128] half -inf", P * 128,
                   lambda p, t, h: p.activation(t["o"], t["i"], "exp", scale=t["s"], bias=t["b"], reduce_op="add",
                                                reduce_out=t["r"]),
                   {"o": ("sbuf", (P, 128), "float32"), "i": ("sbuf", (P, 128), "float32"),
                    "b": ("sbuf", (P, 1), "float32"), "s": ("sbuf", (P, 1), "float32"),
                    "r": ("sbuf", (P, 1), "float32")}, -30, 0, neg_inf=0.5))
    for dt in ("float32", "bfloat16"):
        cs.append(Case(f"act gelu_tanh {dt} [128]", P * 128,
                       lambda p, t, h: p.activation(t["o"], t["i"], "gelu_tanh"),
                       {"o": ("sbuf", (P, 128), dt), "i": ("sbuf", (P, 128), dt)}))
    cs.append(Case("act gelu_tanh f32 [128] in place", P * 128, lambda p, t, h: p.activation(t["o"], t["o"], "gelu_tanh"),
                   {"o": ("sbuf", (P, 128), "float32")}))
    cs.append(Case("act identity+bias PSUM->bf16 [128]", P * 128,
                   lambda p, t, h: p.activation(t["o"], t["i"], "identity", bias=t["b"]),
                   {"o": ("sbuf", (P, 128), "bfloat16"), "i": ("psum", (P, 128), "float32"),
                    "b": ("sbuf", (P, 1), "float32")}))
    cs.append(Case("affine_select causal f32<-bf16 [128]", P * 128,
                   lambda p, t, h: p.affine_select(t["o"], t["i"], cmp="is_ge", channel_multiplier=1, pattern=[-1],
                                                   fill=-np.inf),
                   {"o": ("sbuf", (P, 128), "float32"), "i": ("sbuf", (P, 128), "bfloat16")}))
    cs.append(Case("reduce max f32 [128]->[1]", P * 128, lambda p, t, h: p.tensor_reduce(t["o"], t["a"], "max"),
                   {"o": ("sbuf", (P, 1), "float32"), "a": ("sbuf", (P, 128), "float32")}))
    cs.append(Case("ts divide bf16<-f32 [128] by [P,1]", P * 128,
                   lambda p, t, h: p.tensor_scalar(t["o"], t["a"], "divide", t["s"]),
                   {"o": ("sbuf", (P, 128), "bfloat16"), "a": ("sbuf", (P, 128), "float32"),
                    "s": ("sbuf", (P, 1), "float32")}, 0.5, 4))
    cs.append(Case("tt add bf16 [256]", P * 256, lambda p, t, h: p.tensor_tensor(t["o"], t["a"], t["b"], "add"),
                   {"o": ("sbuf", (P, 256), "bfloat16"), "a": ("sbuf", (P, 256), "bfloat16"),
                    "b": ("sbuf", (P, 256), "bfloat16")}))
    cs.append(Case("copy PSUM f32->bf16 [128]", P * 128, lambda p, t, h: p.tensor_copy(t["o"], t["i"]),
                   {"o": ("sbuf", (P, 128), "bfloat16"), "i": ("psum", (P, 128), "float32")}))
    cs.append(Case("copy bf16->bf16 [128]", P * 128, lambda p, t, h: p.tensor_copy(t["o"], t["i"]),
                   {"o": ("sbuf", (P, 128), "bfloat16"), "i": ("sbuf", (P, 128), "bfloat16")}))
    cs.append(Case("partition_shuffle bf16 [768]", P * 768,
                   lambda p, t, h: p.partition_shuffle(t["o"], t["i"], list(range(P))[::-1]),
                   {"o": ("sbuf", (P, 768), "bfloat16"), "i": ("sbuf", (P, 768), "bfloat16")}))
    # ---- VectorE
    for dt in ("float32", "bfloat16"):
        for op in ("add", "multiply", "divide", "max"):
            cs.append(Case(f"tt {op} {dt}", P * F, (lambda op: lambda p, t, h: p.tensor_tensor(t["o"], t["a"], t["b"], op))(op),
                           {"o": ("sbuf", (P, F), dt), "a": ("sbuf", (P, F), dt), "b": ("sbuf", (P, F), dt)}, 0.5, 4))
    cs.append(Case("tt add f32<-f32,bf16", P * F, lambda p, t, h: p.tensor_tensor(t["o"], t["a"], t["b"], "add"),
                   {"o": ("sbuf", (P, F), "float32"), "a": ("sbuf", (P, F), "float32"),
                    "b": ("sbuf", (P, F), "bfloat16")}))
    cs.append(Case("tt subtract bcast f32 [8,128]-[8,1]", P * 1024,
                   lambda p, t, h: p.tensor_tensor(t["o"], t["a"], t["b"].reshape(P, 8, 1).broadcast_to((P, 8, 128)),
                                                   "subtract"),
                   {"o": ("sbuf", (P, 8, 128), "float32"), "a": ("sbuf", (P, 8, 128), "float32"),
                    "b": ("sbuf", (P, 8), "float32")}))
    for dt in ("float32", "bfloat16"):
        cs.append(Case(f"ts mult+add {dt}", P * F,
                       lambda p, t, h: p.tensor_scalar(t["o"], t["a"], "multiply", 1.5, "add", t["s"]),
                       {"o": ("sbuf", (P, F), dt), "a": ("sbuf", (P, F), dt), "s": ("sbuf", (P, 1), "float32")}))
    cs.append(Case("select bf16 (bool pred, bcast)", P * 128,
                   lambda p, t, h: p.select(t["o"], t["m"], t["a"], t["f"][:, 0:1].broadcast_to((P, 128))),
                   {"o": ("sbuf", (P, 128), "bfloat16"), "m": ("sbuf", (P, 128), "bool"),
                    "a": ("sbuf", (P, 128), "bfloat16"), "f": ("sbuf", (P, 1), "bfloat16")}))
    cs.append(Case("reduce max f32 [8,128]->[8]", P * 1024,
                   lambda p, t, h: p.tensor_reduce(t["o"], t["a"], "max"),
                   {"o": ("sbuf", (P, 8), "float32"), "a": ("sbuf", (P, 8, 128), "float32")}))
    cs.append(Case("reduce add f32 [768]->[1]", P * 768,
                   lambda p, t, h: p.tensor_reduce(t["o"], t["a"], "add"),
                   {"o": ("sbuf", (P, 1), "float32"), "a": ("sbuf", (P, 768), "float32")}))
    cs.append(Case("bn_stats f32 [512]", P * 512, lambda p, t, h: p.bn_stats(t["o"], t["a"]),
                   {"o": ("sbuf", (P, 3), "float32"), "a": ("sbuf", (P, 512), "float32")}))
    # ---- copies and casts
    cs.append(Case("copy PSUM f32->bf16", P * F, lambda p, t, h: p.tensor_copy(t["o"], t["i"]),
                   {"o": ("sbuf", (P, F), "bfloat16"), "i": ("psum", (P, F), "float32")}))
    cs.append(Case("copy PSUM f32->f32", P * F, lambda p, t, h: p.tensor_copy(t["o"], t["i"]),
                   {"o": ("sbuf", (P, F), "float32"), "i": ("psum", (P, F), "float32")}))
    cs.append(Case("copy bf16->f32", P * F, lambda p, t, h: p.tensor_copy(t["o"], t["i"]),
                   {"o": ("sbuf", (P, F), "float32"), "i": ("sbuf", (P, F), "bfloat16")}))
    cs.append(Case("copy f32->bf16", P * F, lambda p, t, h: p.tensor_copy(t["o"], t["i"]),
                   {"o": ("sbuf", (P, F), "bfloat16"), "i": ("sbuf", (P, F), "float32")}))
    for dt in ("float32", "bfloat16"):
        cs.append(Case(f"copy {dt} [16,32] transposed view", P * 512,
                       lambda p, t, h: p.tensor_copy(t["o"], t["i"].permute(0, 2, 1)),
                       {"o": ("sbuf", (P, 32, 16), dt), "i": ("sbuf", (P, 16, 32), dt)}))
        cs.append(Case(f"copy {dt} [12,64] head split", P * 768,
                       lambda p, t, h: p.tensor_copy(t["o"], t["i"].reshape(P, 12, 64).permute(0, 1, 2)),
                       {"o": ("sbuf", (P, 12, 64), dt), "i": ("sbuf", (P, 768), dt)}))
    # ---- TensorE
    for dt in ("float32", "bfloat16"):
        cs.append(Case(f"transpose {dt} 128x128", P * 128, lambda p, t, h: p.transpose(t["o"], t["i"]),
                       {"o": ("psum", (P, 128), "float32" if dt == "float32" else dt), "i": ("sbuf", (P, 128), dt)}))
        for n in (128, 512):
            cs.append(Case(f"matmul {dt} K128 M128 N{n}", P * n,
                           lambda p, t, h: p.matmul(t["o"], t["s"], t["m"], accumulate=False, stop=True),
                           {"o": ("psum", (P, n), "float32"), "s": ("sbuf", (P, 128), dt), "m": ("sbuf", (P, n), dt)},
                           -1, 1))
        cs.append(Case(f"matmul {dt} K64 M128 N128", P * 128,
                       lambda p, t, h: p.matmul(t["o"], t["s"], t["m"], accumulate=False, stop=True),
                       {"o": ("psum", (P, 128), "float32"), "s": ("sbuf", (64, 128), dt), "m": ("sbuf", (64, 128), dt)},
                       -1, 1))
    # ---- DMA
    for dt in ("float32", "bfloat16"):
        cs.append(Case(f"dma HBM->SBUF {dt} [128,768]", P * 768, lambda p, t, h: p.dma_copy(t["o"], h["x"]),
                       {"o": ("sbuf", (P, 768), dt)}, hbm=[("x", (P, 768), dt, "input")]))
        cs.append(Case(f"dma SBUF->HBM {dt} [128,768]", P * 768, lambda p, t, h: p.dma_copy(h["y"], t["i"]),
                       {"i": ("sbuf", (P, 768), dt)}, hbm=[("y", (P, 768), dt, "output")]))
    cs.append(Case("dma HBM->SBUF bf16 [6,1024] strided", P * 6144,
                   lambda p, t, h: p.dma_copy(t["o"], h["w"].reshape(6, P, 1024).permute(1, 0, 2)),
                   {"o": ("sbuf", (P, 6, 1024), "bfloat16")}, hbm=[("w", (768, 1024), "bfloat16", "input")]))
    return cs


# --------------------------------------------------------------------------- measurement

class Runner:
    """Runs one case's programs on one engine module with fixed memories and bindings."""

    def __init__(self, engine, case, rng_seed=0, padded=True, cold=False):
        self.engine = engine
        self.case = case
        self.progs = {}
        for n in (0, R):
            enc, tiles = case.build(n, cold)
            self.progs[n] = enc
        arch = enc.arch
        shapes = ((arch.partitions, arch.sbuf_partition_bytes), (arch.partitions, arch.psum_partition_bytes))
        if padded and hasattr(runtime, "_mem_shapes"):
            shapes = runtime._mem_shapes(arch)      # the rows the runtime gives runs (padded partitions)
        self.sbuf = np.zeros(shapes[0], dtype=np.uint8)
        self.psum = np.zeros(shapes[1], dtype=np.uint8)
        rng = np.random.default_rng(rng_seed)
        self.saved = case.fill(tiles, self.sbuf, self.psum, rng)
        self.hbm, self.ptrs = {}, {}     # per program (cold programs have their own HBM tensors per copy)
        for n, e in self.progs.items():
            self.hbm[n] = [np.ascontiguousarray(_values(t.dtype, t.shape, rng, case.lo, case.hi)) for t in e.hbm]
            self.ptrs[n] = np.array([a.__array_interface__["data"][0] for a in self.hbm[n]], dtype=np.int64)

    def _restore(self):
        for mem, rows, cols, raw in self.saved:   # same inputs every time (in-place ops would drift)
            mem[rows, cols] = raw

    def _args(self, enc):
        ptrs = self.ptrs[next(n for n, e in self.progs.items() if e is enc)]
        prep = enc.prepared()
        n = len(enc)
        nq = enc.arch.num_queues
        return (prep["records"], prep["deps"], prep["aux"], self.sbuf, self.psum, ptrs, prep["sizes"],
                prep["limits"], prep["timing"], np.zeros((max(n, 1), 2)), np.zeros(nq), np.zeros(nq, dtype=np.int64),
                np.zeros(2, dtype=np.int64))

    def time_once(self):
        """Wall seconds of one run of the program with 0 and with R instruction copies."""
        out = []
        for n in (0, R):
            self._restore()
            args = self._args(self.progs[n])
            t0 = time.perf_counter()
            self.engine.run(*args, 1)
            out.append(time.perf_counter() - t0)
        return out

    def host_split(self):
        """(validation ns per instruction, kernel ns per instruction) from the engine's host_ns accounting."""
        enc = self.progs[R]
        self._restore()
        h = np.zeros((len(enc), 2))
        self.engine.run(*self._args(enc), 1, h)
        return float(np.median(h[:, 0])), float(np.median(h[:, 1]))


class _Switch:
    """Stands in for the engine module in tn.neuron.runtime: every compiled program's run goes to ``current``."""

    def __init__(self, engine):
        self.current = engine

    def run(self, *a):
        """The selected engine's run."""
        return self.current.run(*a)


def in_step(args, cur, base):
    """Engine host ns per opcode in a training step (``--workload``); rows ``{opcode, n, valid_us, kernel_us}``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import eager_windows as ew
    from tn.neuron import runtime as rt

    switch = _Switch(cur)
    rt._ENGINE[:] = [switch]            # before anything compiles: every call binds switch.run
    engines = {"this": cur, "baseline": base} if base else {"this": cur}
    mins = {k: {} for k in engines}
    active = [None]

    def listen(res):
        if active[0] is None or res.host_ns is None:
            return
        d = mins[active[0]]
        call = res._lazy[0] if getattr(res, "_lazy", None) else None
        for i, (o, (v, k)) in enumerate(zip(res.opcodes.tolist(), res.host_ns.tolist())):
            key = (res.name, id(call), i)
            old = d.get(key)
            d[key] = (o, v, k) if old is None else (o, min(v, old[1]), min(k, old[2]))

    token = rt.add_listener(listen)
    rt.HOST_TIMES[0] = True
    make = ew.mlp_workload if args.workload == "mlp" else ew.gpt2_workload
    step = ew.train_runner(args.mode, make, ew.Counters())
    for name, eng in engines.items():   # warm up (compiles) on both
        switch.current = eng
        step()
        step()
    for _ in range(args.steps):
        for name, eng in engines.items():
            switch.current, active[0] = eng, name
            step()
            active[0] = None
    rt.HOST_TIMES[0] = False
    rt.remove_listener(token)
    switch.current = cur
    rows = {}
    for name, d in mins.items():
        for o, v, k in d.values():
            r = rows.setdefault(isa.OPCODE_NAMES.get(int(o), str(o)), {})
            n, vv, kk = r.get(name, (0, 0.0, 0.0))
            r[name] = (n + 1, vv + v, kk + k)
    headers = ["opcode", "instr/step", "valid us", "kernel us"] + (["baseline valid us", "baseline kernel us",
                                                                     "kernel speedup"] if base else [])
    body, out = [], []
    order = sorted(rows, key=lambda op: -rows[op]["this"][2])
    for op in order + ["total"]:
        if op == "total":
            r = {name: tuple(sum(rows[o][name][j] for o in rows if name in rows[o]) for j in range(3)) for name in engines}
        else:
            r = rows[op]
        n, v, k = r.get("this", (0, 0.0, 0.0))
        line = [op, n, f"{v / 1e3:.0f}", f"{k / 1e3:.0f}"]
        row = {"opcode": op, "instructions": n, "valid_us": v / 1e3, "kernel_us": k / 1e3}
        if base:
            bn, bv, bk = r.get("baseline", (0, 0.0, 0.0))
            line += [f"{bv / 1e3:.0f}", f"{bk / 1e3:.0f}", f"{bk / k:.2f}x" if k > 0 else ""]
            row.update(base_valid_us=bv / 1e3, base_kernel_us=bk / 1e3)
        body.append(line)
        out.append(row)
    print(f"{args.workload} training step, {args.mode}: engine host time per step, each instruction's minimum over "
          f"{args.steps} steps{' (steps alternate with the baseline engine)' if base else ''}")
    print(tabulate(body, headers=headers, stralign="right") if tabulate else
          "\n".join(" | ".join(str(c) for c in b) for b in [headers] + body))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


def main(argv=None):
    """Runs the bench and prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", help="comma-separated substrings of row names")
    ap.add_argument("--baseline", help="path of another build's engine.*.so to compare against (interleaved)")
    ap.add_argument("--cold", action="store_true",
                    help="every instruction copy on its own tiles and HBM tensors (operands not in L1/L2, as in a "
                         "real program; a kernel can look fast on cached operands and be slow on cold ones)")
    ap.add_argument("--baseline-padded", action="store_true",
                    help="give the baseline the padded rows this engine gets (a baseline engine that supports them)")
    ap.add_argument("--host-split", action="store_true", help="also print validation vs kernel ns (host_ns)")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    ap.add_argument("--workload", choices=("gpt2", "mlp"),
                    help="measure the engine inside this training step of bench/eager_windows.py instead")
    ap.add_argument("--mode", default="tn.jit", choices=("tn.jit", "device adaptive"), help="with --workload")
    ap.add_argument("--steps", type=int, default=8, help="with --workload: timed steps per engine")
    args = ap.parse_args(argv)
    cur = load_engine()
    base = load_engine(args.baseline) if args.baseline else None
    if args.workload:
        return in_step(args, cur, base)
    rows = []
    for case in _cases():
        if args.only and not any(s.strip() and s.strip() in case.name for s in args.only.split(",")):
            continue
        ra = Runner(cur, case, cold=args.cold)
        rb = Runner(base, case, padded=args.baseline_padded, cold=args.cold) if base else None   # an older engine may assume unpadded rows
        ra.time_once()
        if rb:
            rb.time_once()
        ta, tb = [], []
        for _ in range(args.repeats):
            ta.append(ra.time_once())
            if rb:
                tb.append(rb.time_once())

        def per_copy(ts):
            """(min, median) seconds per instruction copy: statistics of run(R) minus those of run(0), over R."""
            t0s, tRs = [t[0] for t in ts], [t[1] for t in ts]
            return ((min(tRs) - min(t0s)) / R, (statistics.median(tRs) - statistics.median(t0s)) / R)

        a_min, a_med = per_copy(ta)
        row = {"kernel": case.name, "elems": case.elems,
               "ns_per_elem": [a_min * 1e9 / case.elems, a_med * 1e9 / case.elems], "us_per_instr": a_med * 1e6}
        if rb:
            b_min, b_med = per_copy(tb)
            row["base_ns_per_elem"] = [b_min * 1e9 / case.elems, b_med * 1e9 / case.elems]
            row["speedup"] = b_min / a_min if a_min > 0 else float("nan")
        if args.host_split:
            chk, ker = ra.host_split()
            row["check_ns"] = chk
            row["kernel_ns_per_elem"] = ker / case.elems
        rows.append(row)
        print(f"... {case.name}", file=sys.stderr, flush=True)
    headers = ["kernel", "elems", "ns/elem min/med", "us/instr"]
    if base:
        headers += ["baseline ns/elem min/med", "speedup"]
    if args.host_split:
        headers += ["check ns/instr", "kernel ns/elem"]
    body = []
    for r in rows:
        line = [r["kernel"], r["elems"], f"{r['ns_per_elem'][0]:.3f} / {r['ns_per_elem'][1]:.3f}",
                f"{r['us_per_instr']:.1f}"]
        if base:
            line += [f"{r['base_ns_per_elem'][0]:.3f} / {r['base_ns_per_elem'][1]:.3f}", f"{r['speedup']:.2f}x"]
        if args.host_split:
            line += [f"{r['check_ns']:.0f}", f"{r['kernel_ns_per_elem']:.3f}"]
        body.append(line)
    print(f"{R} instruction copies per program{' (cold: own operands per copy)' if args.cold else ''}; times "
          f"min / median of {args.repeats} (interleaved with the baseline when given)")
    if tabulate:
        print(tabulate(body, headers=headers, stralign="right"))
    else:
        print("\n".join(" | ".join(str(c) for c in b) for b in [headers] + body))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
