# Benchmark of the software NeuronCore on hand-written programs: a tiled bf16 matmul and a fused layer norm.
"""Modelled and host performance of the software NeuronCore.

Runs :func:`tn.neuron.handwritten.tiled_matmul` (2048x2048x2048, bf16
inputs, fp32 PSUM accumulation, bf16 output; A given transposed, the main
row, and A as stored, transposed on TensorE) and
:func:`tn.neuron.handwritten.layer_norm` and prints, per program: modelled
time, modelled TFLOPS, TensorE utilisation (fraction of the trn2 bf16 peak),
HBM bytes, the host wall time of the simulation, and numpy on the same sizes
in the same run (fp32 ``a @ b`` for the matmul, a numpy layer norm for the
layer norm), single-threaded, with interleaved repeats (median and min).

``--json PATH`` also writes the numbers; keys include ``matmul_tensor_util``
and ``sim_vs_numpy`` (numpy matmul time / simulation wall time, medians).

Usage: ``python bench/neuroncore.py [--size 2048] [--ln-rows 4096] [--ln-dim 1024] [--repeats 5] [--json PATH]``
"""
import argparse
import json
import os
import statistics
import sys
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported: single-threaded BLAS, as the simulation

import numpy as np  # noqa: E402
from tabulate import tabulate  # noqa: E402

from tn._native._kernels import ffi as _ffi, lib as _lib  # noqa: E402
from tn.neuron import run, to_bf16  # noqa: E402
from tn.neuron.handwritten import layer_norm, layer_norm_flops, matmul_flops, tiled_matmul  # noqa: E402


def _numpy_layer_norm(x, g, b, eps):
    """Reference layer norm in numpy (fp32)."""
    mean = x.mean(axis=1, keepdims=True)
    var = x.var(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * g + b


def _stats(ts):
    return min(ts), statistics.median(ts)


def main(argv=None) -> dict:
    """Runs the benchmark, prints the table, optionally writes JSON; returns the numbers."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048, help="M = K = N of the matmul")
    ap.add_argument("--ln-rows", type=int, default=4096)
    ap.add_argument("--ln-dim", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--arch", default="trn2")
    ap.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = ap.parse_args(argv)
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass

    n = args.size
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    R, D, eps = args.ln_rows, args.ln_dim, 1e-5
    x = rng.standard_normal((R, D)).astype(np.float32)
    g = rng.standard_normal(D).astype(np.float32)
    be = rng.standard_normal(D).astype(np.float32)

    t0 = time.perf_counter()
    mm = tiled_matmul(n, n, n, arch=args.arch).build()
    mm_build = time.perf_counter() - t0
    mk = tiled_matmul(n, n, n, a_layout="MK", arch=args.arch).build()
    t0 = time.perf_counter()
    ln = layer_norm(R, D, arch=args.arch).build()
    ln_build = time.perf_counter() - t0
    mm_bind = {"aT": to_bf16(np.ascontiguousarray(a.T)), "b": to_bf16(b)}
    mk_bind = {"a": to_bf16(a), "b": mm_bind["b"]}
    ln_bind = {"x": x, "gamma": g, "beta": be}

    # correctness once
    res = run(mm, mm_bind, report=False)
    ref = (mm_bind["aT"].astype(np.uint32) << 16).view(np.float32).T @ (mm_bind["b"].astype(np.uint32) << 16).view(
        np.float32)
    c = (res.outputs["c"].astype(np.uint32) << 16).view(np.float32)
    err = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)))
    if err > 1e-2:
        raise SystemExit(f"matmul program: relative error {err:.3g} vs numpy")
    mres = run(mk, mk_bind, report=False)
    if not np.array_equal(mres.outputs["c"], res.outputs["c"]):
        merr = float(np.max(np.abs((mres.outputs["c"].astype(np.uint32) << 16).view(np.float32) - c)))
        if merr > 1e-2 * float(np.max(np.abs(ref))):
            raise SystemExit(f"matmul program with a_layout=MK differs from the KM one by {merr:.3g}")
    lres = run(ln, ln_bind, report=False)
    lerr = float(np.max(np.abs(lres.outputs["y"] - _numpy_layer_norm(x, g, be, eps))))
    if lerr > 1e-3:
        raise SystemExit(f"layer-norm program: max error {lerr:.3g} vs numpy")

    t = {k: [] for k in ("mm_sim", "mm_run", "np_mm", "mk_sim", "mk_run", "ln_sim", "ln_run", "np_ln")}
    for _ in range(args.repeats):  # interleaved
        t0 = time.perf_counter()
        r = run(mm, mm_bind, report=False)
        t["mm_run"].append(time.perf_counter() - t0)
        t["mm_sim"].append(r.wall_s)
        t0 = time.perf_counter()
        a @ b
        t["np_mm"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r3 = run(mk, mk_bind, report=False)
        t["mk_run"].append(time.perf_counter() - t0)
        t["mk_sim"].append(r3.wall_s)
        t0 = time.perf_counter()
        r2 = run(ln, ln_bind, report=False)
        t["ln_run"].append(time.perf_counter() - t0)
        t["ln_sim"].append(r2.wall_s)
        t0 = time.perf_counter()
        _numpy_layer_norm(x, g, be, eps)
        t["np_ln"].append(time.perf_counter() - t0)

    mm_sim_min, mm_sim_med = _stats(t["mm_sim"])
    np_mm_min, np_mm_med = _stats(t["np_mm"])
    mk_sim_min, mk_sim_med = _stats(t["mk_sim"])
    ln_sim_min, ln_sim_med = _stats(t["ln_sim"])
    np_ln_min, np_ln_med = _stats(t["np_ln"])
    mm_flops = matmul_flops(n, n, n)
    ln_fl = layer_norm_flops(R, D)

    rows = [
        [f"matmul {n}x{n}x{n} bf16 -> bf16", f"{res.total_us:.1f}", f"{res.tflops:.1f}",
         f"{res.tensor_utilisation:.3f}", f"{(res.hbm_read_bytes + res.hbm_write_bytes) / 2**20:.1f}",
         f"{mm_sim_med * 1e3:.1f} ({mm_sim_min * 1e3:.1f})", f"{statistics.median(t['mm_run']) * 1e3:.1f}",
         f"{np_mm_med * 1e3:.1f} ({np_mm_min * 1e3:.1f})", f"{np_mm_med / mm_sim_med:.2f}"],
        ["matmul, A as [M,K] (TensorE transposes)", f"{mres.total_us:.1f}", f"{mres.tflops:.1f}",
         f"{mres.tensor_utilisation:.3f}", f"{(mres.hbm_read_bytes + mres.hbm_write_bytes) / 2**20:.1f}",
         f"{mk_sim_med * 1e3:.1f} ({mk_sim_min * 1e3:.1f})", f"{statistics.median(t['mk_run']) * 1e3:.1f}",
         f"{np_mm_med * 1e3:.1f} ({np_mm_min * 1e3:.1f})", f"{np_mm_med / mk_sim_med:.2f}"],
        [f"layer norm {R}x{D} fp32", f"{lres.total_us:.1f}", f"{ln_fl / (lres.total_ns * 1e-9) / 1e12:.3f}",
         f"{lres.tensor_utilisation:.3f}", f"{(lres.hbm_read_bytes + lres.hbm_write_bytes) / 2**20:.1f}",
         f"{ln_sim_med * 1e3:.1f} ({ln_sim_min * 1e3:.1f})", f"{statistics.median(t['ln_run']) * 1e3:.1f}",
         f"{np_ln_med * 1e3:.1f} ({np_ln_min * 1e3:.1f})", f"{np_ln_med / ln_sim_med:.2f}"],
    ]
    isa_name = _ffi.string(_lib.tn_matmul_isa()).decode()
    print(f"software NeuronCore ({mm.arch.name}), matmul kernel path: {isa_name}; numpy single-threaded "
          f"(OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}); {args.repeats} interleaved repeats, "
          f"host times median (min)")
    print(tabulate(rows, headers=["program", "modelled us", "modelled TFLOPS", "TensorE util", "HBM MiB",
                                  "sim wall ms", "run() ms", "numpy ms", "numpy/sim"], tablefmt="github"))
    print("numpy column: fp32 a @ b for the matmuls, a numpy layer norm for the layer norm.")
    util = {k: round(v, 4) for k, v in res.utilisation.items() if res.counts.get(k)}
    print(f"matmul: {len(mm)} instructions, engine busy fractions {util}, SBUF peak {res.sbuf_peak_bytes} B/partition, "
          f"PSUM peak {res.psum_peak_bytes} B/partition, build {mm_build * 1e3:.0f} ms")
    lutil = {k: round(v, 4) for k, v in lres.utilisation.items() if lres.counts.get(k)}
    print(f"layer norm: {len(ln)} instructions, engine busy fractions {lutil}, build {ln_build * 1e3:.0f} ms")

    out = {
        "arch": mm.arch.name, "matmul_isa": isa_name, "size": n, "repeats": args.repeats,
        "matmul_tensor_util": res.tensor_utilisation,
        "matmul_modelled_us": res.total_us,
        "matmul_modelled_tflops": res.tflops,
        "matmul_hbm_read_bytes": res.hbm_read_bytes, "matmul_hbm_write_bytes": res.hbm_write_bytes,
        "matmul_sim_wall_s_median": mm_sim_med, "matmul_sim_wall_s_min": mm_sim_min,
        "matmul_run_wall_s_median": statistics.median(t["mm_run"]),
        "numpy_matmul_s_median": np_mm_med, "numpy_matmul_s_min": np_mm_min,
        "numpy_matmul_gflops_median": mm_flops / np_mm_med / 1e9,
        "sim_matmul_gflops_median": mm_flops / mm_sim_med / 1e9,
        "sim_vs_numpy": np_mm_med / mm_sim_med,
        "sim_vs_numpy_min": np_mm_min / mm_sim_min,
        "matmul_engine_busy": util,
        "matmul_mk_tensor_util": mres.tensor_utilisation, "matmul_mk_modelled_us": mres.total_us,
        "matmul_mk_sim_wall_s_median": mk_sim_med,
        "layer_norm_rows": R, "layer_norm_dim": D,
        "layer_norm_modelled_us": lres.total_us,
        "layer_norm_modelled_tflops": ln_fl / (lres.total_ns * 1e-9) / 1e12,
        "layer_norm_hbm_read_bytes": lres.hbm_read_bytes, "layer_norm_hbm_write_bytes": lres.hbm_write_bytes,
        "layer_norm_sim_wall_s_median": ln_sim_med, "numpy_layer_norm_s_median": np_ln_med,
        "layer_norm_engine_busy": lutil,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
