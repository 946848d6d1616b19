# Benchmark of the TensorE matmul tile kernel (_native/matmul.c): a 2048^3 matmul done tile by tile, vs numpy.
"""GFLOP/s of ``tn_matmul_f32`` / ``tn_matmul_bf16`` on a 2048x2048x2048 matmul.

The product is done as the engine does it: operands sit in SBUF-shaped buffers
(128 partitions, rows a partition pitch apart), one kernel call per
(stationary 128x128, moving 128x512) tile pair, accumulating over K into a
PSUM-shaped bank. numpy (OpenBLAS pinned to one thread) multiplies the same
fp32 shapes in the same run; repeats are interleaved and min and median are
reported.

Usage: ``python bench/matmul_kernel.py [--size 2048] [--repeats 5] [--isa amx,avx512,...]``

OpenBLAS: if ``OPENBLAS_CORETYPE`` is set in the environment, numpy runs the
kernel for that core type, which may be slower than this CPU allows; the table
header says which core type OpenBLAS reports. Unset it (and
``OPENBLAS_L2_SIZE``) for that command alone to compare against the best numpy.
"""
import argparse
import os
import statistics
import sys
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported: single-threaded BLAS

import numpy as np  # noqa: E402
from tabulate import tabulate  # noqa: E402

from tn._native._kernels import ffi, lib  # noqa: E402

P, MT, NT = 128, 128, 512  # partitions (K tile), stationary columns (M tile), moving columns (N tile)


def _blas_info() -> str:
    """Which BLAS numpy uses and how many threads (threadpoolctl if installed)."""
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
        threadpool_limits(1)
        infos = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} threads={i.get('num_threads')}"
                 for i in threadpool_info()]
        return "; ".join(infos) or "unknown"
    except ImportError:
        return f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')} (threadpoolctl not installed)"


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _sbuf_layout(x: np.ndarray) -> np.ndarray:
    """[K, F] -> [128, (K/128) * F]: partition p holds rows p, p+128, ... of x side by side (a DMA's result)."""
    K, F = x.shape
    return np.ascontiguousarray(x.reshape(K // P, P, F).transpose(1, 0, 2).reshape(P, (K // P) * F))


class TiledMatmul:
    """C[M, N] = A[M, K] @ B[K, N] by kernel calls on SBUF-shaped operands, one per tile pair."""

    def __init__(self, a: np.ndarray, b: np.ndarray, dtype: str):
        self.M, self.K = a.shape
        self.N = b.shape[1]
        self.dtype = dtype
        conv = _to_bf16_bits if dtype == "bf16" else (lambda x: x.astype(np.float32))
        self.stat = _sbuf_layout(conv(np.ascontiguousarray(a.T)))  # lhsT: [K, M]
        self.mov = _sbuf_layout(conv(b))                             # [K, N]
        self.c = np.zeros((self.M, self.N), np.float32)
        ctype = "uint16_t *" if dtype == "bf16" else "float *"
        self.fn = lib.tn_matmul_bf16 if dtype == "bf16" else lib.tn_matmul_f32
        sp = ffi.cast(ctype, self.stat.ctypes.data)
        mp = ffi.cast(ctype, self.mov.ctypes.data)
        cp = ffi.cast("float *", self.c.ctypes.data)
        ss, ms = self.stat.shape[1], self.mov.shape[1]
        calls = []
        for m0 in range(0, self.M, MT):
            for n0 in range(0, self.N, NT):
                for kb in range(self.K // P):
                    calls.append((sp + kb * self.M + m0, ss, mp + kb * self.N + n0, ms,
                                  cp + m0 * self.N + n0, self.N, P, MT, NT, int(kb > 0)))
        self.calls = calls

    def run(self) -> np.ndarray:
        """Every tile call; returns C."""
        fn = self.fn
        for args in self.calls:
            if fn(*args) != 0:
                raise RuntimeError(f"tn_matmul_{self.dtype} rejected tile arguments {args[5:]}")
        return self.c


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, returns the numbers."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048, help="M = K = N (multiple of 512)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--isa", default="auto,amx,avx512,avx2",
                    help="comma-separated code paths to time (auto, amx, avx512, avx2, generic)")
    args = ap.parse_args(argv)
    n = args.size
    if n % 512:
        raise SystemExit("--size must be a multiple of 512")
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    flops = 2.0 * n * n * n
    ref = a.astype(np.float64) @ b.astype(np.float64)

    variants = []  # (label, callable)
    variants.append(("numpy fp32 (OpenBLAS, 1 thread)", lambda: a @ b))
    isas = []
    for isa in args.isa.split(","):
        if lib.tn_matmul_set_isa(isa.encode()) == 0:
            isas.append((isa, ffi.string(lib.tn_matmul_isa()).decode()))
    lib.tn_matmul_set_isa(b"auto")
    for isa, resolved in isas:
        for dtype in ("fp32", "bf16"):
            if dtype == "fp32" and isa == "amx":
                continue  # AMX only changes the bf16 path
            tm = TiledMatmul(a, b, dtype)

            def run(tm=tm, isa=isa):
                """All tiles with this code path forced."""
                lib.tn_matmul_set_isa(isa.encode())
                return tm.run()
            variants.append((f"tn_matmul_{dtype} [{isa} -> {resolved}]", run))

    # correctness once (bf16 inputs are rounded: compare against the rounded product loosely)
    for label, fn in variants:
        out = fn()
        tol = 5e-2 if "bf16" in label else 1e-3
        err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
        if err > tol:
            raise SystemExit(f"{label}: relative error {err:.3g} > {tol}")

    times = {label: [] for label, _ in variants}
    for _ in range(args.repeats):  # interleaved
        for label, fn in variants:
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    lib.tn_matmul_set_isa(b"auto")

    np_med = statistics.median(times[variants[0][0]])
    rows, result = [], {}
    for label, _ in variants:
        t = times[label]
        tmin, tmed = min(t), statistics.median(t)
        rows.append([label, f"{tmin * 1e3:.1f}", f"{tmed * 1e3:.1f}", f"{flops / tmin / 1e9:.1f}",
                     f"{flops / tmed / 1e9:.1f}", f"{np_med / tmed:.2f}"])
        result[label] = {"min_s": tmin, "median_s": tmed, "gflops_median": flops / tmed / 1e9}
    print(f"{n}x{n}x{n} matmul, {n // P * (n // MT) * (n // NT)} tile calls of {P}x{MT}x{NT}; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}; BLAS: {_blas_info()}")
    print(tabulate(rows, headers=["variant", "min ms", "median ms", "GFLOP/s (min)", "GFLOP/s (median)",
                                  "vs numpy (median)"], tablefmt="github"))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
