# Edge cases of the engine's fast kernel paths (kernels.c): blocked transposes, interval affine_select, 16-lane
# reductions, branch-free select, elementwise partition reduce, broadcast (stride-0) row loads.
import numpy as np
import pytest

from test_neuron_helpers import from_device, round_to, run_op, to_device
from tn.neuron import Program

RNG = np.random.default_rng(7)


def rnd(*shape):
    return RNG.standard_normal(shape)


# ---------------------------------------------------------------- transpose

@pytest.mark.parametrize("P,F", [(128, 128), (5, 77), (77, 5), (9, 8), (1, 1), (128, 3), (64, 128)])
@pytest.mark.parametrize("src,dst", [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"),
                                     ("float16", "float32")])
def test_transpose_dtypes_and_shapes(P, F, src, dst):
    x = rnd(P, F) * 10
    x.flat[::7] = 0.0
    def emit(p, t):
        ps = p.psum((F, P), dst)
        p.transpose(ps, t["x"])
        p.tensor_copy(t["y"], ps)
    out, _ = run_op(emit, {"x": (x, src)}, {"y": ((F, P), dst)})
    np.testing.assert_array_equal(out["y"], round_to(x, src).T)


def test_transpose_is_a_bit_exact_copy():
    """Same-dtype transposes move bits: NaN payloads, infinities and -0 come through unchanged."""
    bits = RNG.integers(0, 2 ** 32, size=(32, 48), dtype=np.uint64).astype(np.uint32)
    bits[0, :4] = [0x7F800001, 0xFFC00000, 0x80000000, 0x7F800000]   # sNaN, qNaN, -0, inf
    prog = Program("tr_bits")
    X = prog.hbm("x", (32, 48), "float32")
    Y = prog.hbm("y", (48, 32), "float32", kind="output")
    t = prog.sbuf((32, 48), "float32")
    prog.dma_copy(t, X)
    ps = prog.psum((48, 32))
    prog.transpose(ps, t)
    u = prog.sbuf((48, 32), "float32")
    prog.tensor_copy(u, ps)
    prog.dma_copy(Y, u)
    res = prog.run({"x": bits.view(np.float32)})
    np.testing.assert_array_equal(res.outputs["y"].view(np.uint32), bits.T)


def test_transpose_of_a_strided_view_takes_the_general_path():
    x = rnd(16, 40)
    def emit(p, t):
        ps = p.psum((20, 16))
        p.transpose(ps, t["x"][:, ::2])
        p.tensor_copy(t["y"], ps)
    out, _ = run_op(emit, {"x": (x, "float32")}, {"y": ((20, 16), "float32")})
    np.testing.assert_array_equal(out["y"], round_to(x, "float32")[:, ::2].T)


# ---------------------------------------------------------------- affine_select

CMPS = {"is_ge": np.greater_equal, "is_gt": np.greater, "is_le": np.less_equal, "is_lt": np.less,
        "is_equal": np.equal, "not_equal": np.not_equal}


def _affine_ref(shape, base, cm, pattern):
    """The affine expression in double, evaluated as the engine does: base + cm*p + sum_d m_d*i_d (in order)."""
    P, *free = shape
    pat = [0.0] * (4 - len(pattern)) + [float(m) for m in pattern]
    dims = [1] * (4 - len(free)) + list(free)
    e = np.empty((P, *dims))
    for idx in np.ndindex(P, *dims):
        p, i0, i1, i2, i3 = idx
        b = base + cm * p + pat[0] * i0 + pat[1] * i1 + pat[2] * i2
        e[idx] = b + pat[3] * i3
    return e.reshape(shape)


@pytest.mark.parametrize("cmp", sorted(CMPS))
@pytest.mark.parametrize("base,cm,pattern", [
    (0, 1, [-1]),            # causal mask
    (3, -1, [1]),            # decreasing along partitions, increasing along the row
    (5, 0, [-1]),            # same for every partition, boundary mid-row
    (0.5, 0.25, [-0.3]),     # fractional: boundaries between elements
    (-2, 1, [0]),            # constant rows
    (1e10, -1e10, [1e-3]),   # huge terms
    (0, 1, [2, -1]),         # pattern over two free axes
    (-7, 0, [1, 0, 3]),      # three free axes
])
def test_affine_select_against_the_double_expression(cmp, base, cm, pattern):
    shape = (16, 37) if len(pattern) == 1 else ((16, 5, 9) if len(pattern) == 2 else (16, 3, 4, 5))
    x = rnd(*shape)
    out, _ = run_op(lambda p, t: p.affine_select(t["y"], t["x"], cmp=cmp, base=base, channel_multiplier=cm,
                                                 pattern=pattern, fill=-5.0),
                    {"x": (x, "float32")}, {"y": (shape, "float32")})
    keep = CMPS[cmp](_affine_ref(shape, base, cm, pattern), 0)
    np.testing.assert_array_equal(out["y"], np.where(keep, round_to(x, "float32"), -5.0))


@pytest.mark.parametrize("cmp", sorted(CMPS))
def test_affine_select_non_finite_coefficients(cmp):
    x = rnd(8, 10)
    for base, cm in [(np.inf, 0.0), (np.nan, 1.0), (-np.inf, 1.0)]:
        out, _ = run_op(lambda p, t: p.affine_select(t["y"], t["x"], cmp=cmp, base=base, channel_multiplier=cm,
                                                     pattern=[1], fill=9.0),
                        {"x": (x, "float32")}, {"y": ((8, 10), "float32")})
        with np.errstate(invalid="ignore"):
            keep = CMPS[cmp](_affine_ref((8, 10), base, cm, [1]), 0)
        np.testing.assert_array_equal(out["y"], np.where(keep, round_to(x, "float32"), 9.0))


# ---------------------------------------------------------------- reductions

@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 33, 128, 130, 777])
@pytest.mark.parametrize("op", ["add", "max", "min"])
def test_reduce_lengths_and_specials(n, op):
    P = 8
    x = rnd(P, n) * 10
    if n > 3:
        x[1, n // 2] = np.nan          # NaN in the middle of a row
        x[2, n - 1] = np.nan           # in the tail
        x[3, 0] = np.inf
        x[4, n // 3] = -np.inf
        x[5, :] = -0.0
        x[6, 0] = np.nan
        x[6, 1] = np.inf
    out, _ = run_op(lambda p, t: p.tensor_reduce(t["y"], t["x"], op), {"x": (x, "float32")},
                    {"y": ((P, 1), "float32")})
    xr = round_to(x, "float32")
    ref = {"add": np.sum, "max": np.max, "min": np.min}[op](xr, axis=1)   # numpy max/min propagate NaN too
    np.testing.assert_allclose(out["y"][:, 0], ref, rtol=2e-6, atol=1e-5)
    if op != "add":
        np.testing.assert_array_equal(out["y"][:, 0], ref)


@pytest.mark.parametrize("op", ["add", "max", "min", "multiply", "logical_and", "logical_or"])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_reduce_over_a_size1_axis_is_elementwise_and_bit_exact(op, dt):
    """A reduction over an axis of size 1 (what lowering emits for a kept dim of 1) takes the per-element path:
    its bits are those of the 16-lane row reduction of one element (sums: 0 + (0 + x), so -0 becomes +0; max/min
    keep x, NaN included; multiply: 1 * x; logical and/or: x != 0)."""
    P, n = 6, 37
    x = rnd(P, n) * 100
    x[0, :6] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40]
    x[3, :] = -0.0
    xr = round_to(x, dt).astype(np.float32)
    def emit(p, t):
        p.tensor_reduce(t["y"], t["x"].reshape(P, n, 1), op, axis=2)
    out, _ = run_op(emit, {"x": (x, dt)}, {"y": ((P, n), "float32")})
    y = out["y"].astype(np.float32)
    nz = (xr != 0).astype(np.float32)
    ref = {"add": np.float32(0) + (np.float32(0) + xr), "max": xr, "min": xr, "multiply": np.float32(1) * xr,
           "logical_and": nz, "logical_or": nz}[op]
    np.testing.assert_array_equal(y, ref)
    assert np.array_equal(np.signbit(y), np.signbit(ref))   # -0 kept or made +0 as the lane sum does


@pytest.mark.parametrize("op", ["add", "max", "min"])
def test_reduce_over_a_size1_axis_of_a_strided_view_matches_the_contiguous_one(op):
    """The size-1 reduction reads fp32 rows of one run in place and gathers other patterns into scratch first:
    both give the same bits (NaN, infinities and -0 included)."""
    P, n = 8, 40
    x = rnd(P, 2 * n) * 100
    x[0, :8] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-40, 3e38]
    x[:, 1::2] = x[:, ::2]
    def emit(p, t):
        p.tensor_reduce(t["a"], t["x"][:, ::2].reshape(P, n, 1), op, axis=2)              # gathered
        p.tensor_copy(t["c"], t["x"][:, ::2])
        p.tensor_reduce(t["b"], t["c"].reshape(P, n, 1), op, axis=2)                       # in place
    out, _ = run_op(emit, {"x": (x, "float32")}, {"a": ((P, n), "float32"), "b": ((P, n), "float32"),
                                                   "c": ((P, n), "float32")})
    a, b = out["a"].astype(np.float32), out["b"].astype(np.float32)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    xr = round_to(x[:, ::2], "float32").astype(np.float32)
    ref = np.float32(0) + (np.float32(0) + xr) if op == "add" else xr
    np.testing.assert_array_equal(a, ref)


@pytest.mark.parametrize("e", [2.0, 3.0, 2.5])
def test_pow_by_2_and_3_matches_powf_bits(e):
    """pow is libm's powf bit for bit (called through ctypes; numpy's float32 power is not powf), squares and
    cubes included, over normal, huge, tiny (subnormal result), zero, inf and NaN bases, in tensor_scalar and
    tensor_tensor. A guard for fast paths: products in double (x*x, x*x*x) differ from glibc's powf (0.82 ulp, not
    correctly rounded) on ~0.05% of all 2^32 floats, results from subnormal up to near FLT_MAX, so they cannot
    replace it."""
    P, n = 8, 512
    x = (RNG.standard_normal((P, n)) * np.exp(RNG.uniform(-80, 80, (P, n)))).astype(np.float32)
    x[0, :8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 3.4e38]
    x[1, :] = np.float32(2.0) ** RNG.integers(-75, -40, n) * RNG.uniform(1, 2, n)   # subnormal squares/cubes
    import ctypes
    import ctypes.util

    powf = ctypes.CDLL(ctypes.util.find_library("m")).powf
    powf.restype, powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    ref = np.array([powf(float(v), e) for v in x.ravel()], dtype=np.float32).reshape(P, n)
    out, _ = run_op(lambda p, t: p.tensor_scalar(t["y"], t["x"], "pow", e), {"x": (x, "float32")},
                    {"y": ((P, n), "float32")})
    np.testing.assert_array_equal(out["y"].astype(np.float32).view(np.uint32)[~np.isnan(ref)],
                                  ref.view(np.uint32)[~np.isnan(ref)])
    assert np.isnan(out["y"]).sum() == np.isnan(ref).sum()
    ex = np.full((P, n), e, dtype=np.float32)
    out, _ = run_op(lambda p, t: p.tensor_tensor(t["y"], t["x"], t["e"], "pow"),
                    {"x": (x, "float32"), "e": (ex, "float32")}, {"y": ((P, n), "float32")})
    np.testing.assert_array_equal(out["y"].astype(np.float32)[~np.isnan(ref)], ref[~np.isnan(ref)])


def test_activation_fused_max_reduce_with_nan():
    x = rnd(4, 50)
    x[2, 17] = np.nan
    out, _ = run_op(lambda p, t: p.activation(t["y"], t["x"], "identity", reduce_op="max", reduce_out=t["r"]),
                    {"x": (x, "float32")}, {"y": ((4, 50), "float32"), "r": ((4, 1), "float32")})
    np.testing.assert_array_equal(out["r"][:, 0], np.max(round_to(x, "float32"), axis=1))


@pytest.mark.parametrize("op", ["add", "max", "min", "multiply"])
def test_partition_reduce_with_nan(op):
    x = rnd(40, 33)
    x[5, 3] = np.nan
    x[7, 4] = np.inf
    out, _ = run_op(lambda p, t: p.partition_reduce(t["y"], t["x"], op), {"x": (x, "float32")},
                    {"y": ((4, 33), "float32")})
    xr = round_to(x, "float32")
    ref = {"add": np.sum, "max": np.max, "min": np.min, "multiply": np.prod}[op](xr, axis=0)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(out["y"], np.broadcast_to(ref, (4, 33)), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- select, broadcast rows

@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_select_random_mask_with_broadcast_operand(dt):
    P, F = 64, 133
    c = (RNG.random((P, F)) > 0.5)
    x, y = rnd(P, F), rnd(P, 1)
    out, _ = run_op(lambda p, t: p.select(t["z"], t["c"], t["x"], t["y"].broadcast_to((P, F))),
                    {"c": (c, "bool"), "x": (x, dt), "y": (y, dt)}, {"z": ((P, F), dt)})
    np.testing.assert_array_equal(out["z"], np.where(c, round_to(x, dt), np.broadcast_to(round_to(y, dt), (P, F))))


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "int32", "uint8", "float16"])
def test_broadcast_row_operand_of_every_dtype(dt):
    P, F = 32, 40
    a = RNG.integers(0, 50, size=(P, F)).astype(np.float64)
    b = RNG.integers(0, 50, size=(P, 1)).astype(np.float64)
    out, _ = run_op(lambda p, t: p.tensor_tensor(t["z"], t["a"], t["b"].broadcast_to((P, F)), "add"),
                    {"a": (a, dt), "b": (b, dt)}, {"z": ((P, F), "float32")})
    np.testing.assert_array_equal(out["z"], from_device(to_device(a, dt), dt) + from_device(to_device(b, dt), dt))


# ---------------------------------------------------------------- overlapping operands (row-wise semantics)

@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_elementwise_with_overlapping_rows_reads_inputs_before_writing(dt):
    """Every partition's inputs are read whole before its output row is written, whatever the kernel path
    (fp32 rows in place, bf16 blocks through scratch): outputs shifted by one element over their own input."""
    P, F = 64, 40
    x, y = rnd(P, F + 8), rnd(P, F)
    def emit(p, t):
        a = t["a"]
        p.tensor_copy(t["s1"], a)
        p.tensor_copy(t["s2"], a)
        p.tensor_copy(t["s3"], a)
        p.tensor_tensor(t["s1"][:, 1:F + 1], t["s1"][:, 0:F], t["b"], "add")          # shifted onto itself
        p.tensor_scalar(t["s2"][:, 1:F + 1], t["s2"][:, 0:F], "multiply", 2.0, "add", 1.0)
        p.activation(t["s3"][:, 1:F + 1], t["s3"][:, 0:F], "tanh", bias=t["s3"][:, 5:6])   # bias inside the output
        p.tensor_copy(t["s4"], a)
        p.tensor_tensor(t["s4"], t["s4"], t["s4"], "multiply")                        # exact in place
    out, _ = run_op(emit, {"a": (x, dt), "b": (y, dt)}, {k: ((P, F + 8), dt) for k in ("s1", "s2", "s3", "s4")})
    xr, yr = round_to(x, dt), round_to(y, dt)
    want1, want2, want3 = xr.copy(), xr.copy(), xr.copy()
    want1[:, 1:F + 1] = round_to(xr[:, :F] + yr, dt)
    want2[:, 1:F + 1] = round_to(xr[:, :F] * 2.0 + 1.0, dt)
    want3[:, 1:F + 1] = round_to(np.tanh(xr[:, :F] + xr[:, 5:6]), dt)
    tol = dict(rtol=1e-6, atol=1e-6) if dt == "float32" else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(out["s1"], want1, **tol)
    np.testing.assert_allclose(out["s2"], want2, **tol)
    np.testing.assert_allclose(out["s3"], want3, **tol)
    np.testing.assert_allclose(out["s4"], round_to(xr * xr, dt), **tol)


# ---------------------------------------------------------------- host layout of SBUF/PSUM

def test_padded_memory_rows_give_the_same_results():
    """The engine addresses partition p at row p of the SBUF/PSUM arrays it is given: rows longer than the
    architecture's partition (the runtime pads them to spread partitions over cache sets) change nothing."""
    from tn._native import engine
    from tn.neuron import runtime

    P, K, N = 128, 96, 80
    rng = np.random.default_rng(3)
    prog = Program("padded")
    A = prog.hbm("a", (K, P), "bfloat16")
    B = prog.hbm("b", (K, N), "bfloat16")
    Y = prog.hbm("y", (P, N), "float32", kind="output")
    a, b = prog.sbuf((K, P), "bfloat16"), prog.sbuf((K, N), "bfloat16")
    prog.dma_copy(a, A)
    prog.dma_copy(b, B)
    ps = prog.psum((P, N))
    prog.matmul(ps, a, b)
    t = prog.sbuf((P, N), "float32")
    prog.activation(t, ps, "gelu")
    ps2 = prog.psum((N, P))
    prog.transpose(ps2, t)
    u = prog.sbuf((N, P), "float32")
    prog.tensor_copy(u, ps2)
    prog.transpose(ps, u)
    prog.tensor_copy(t, ps)
    prog.dma_copy(Y, t)
    enc = prog.build()
    av = to_device(rng.standard_normal((K, P)), "bfloat16")
    bv = to_device(rng.standard_normal((K, N)), "bfloat16")
    prep = enc.prepared()
    arch = enc.arch
    outs = []
    for pad in (0, 64, 4096 + 8):
        y = np.zeros((P, N), np.float32)
        keep = [av, bv, y]
        ptrs = np.array([x.__array_interface__["data"][0] for x in keep], np.int64)
        sbuf = np.zeros((arch.partitions, arch.sbuf_partition_bytes + pad), np.uint8)
        psum = np.zeros((arch.partitions, arch.psum_partition_bytes + pad), np.uint8)
        nq = arch.num_queues
        engine.run(prep["records"], prep["deps"], prep["aux"], sbuf, psum, ptrs, prep["sizes"], prep["limits"],
                   prep["timing"], np.zeros((len(enc), 2)), np.zeros(nq), np.zeros(nq, np.int64),
                   np.zeros(2, np.int64), 1)
        outs.append(y)
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[2].view(np.uint32))
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    shapes = runtime._mem_shapes(arch)
    assert shapes[0][1] > arch.sbuf_partition_bytes and shapes[1][1] > arch.psum_partition_bytes
    res = prog.run({"a": av, "b": bv})                     # through the runtime's padded memories
    np.testing.assert_array_equal(res.outputs["y"].view(np.uint32), outs[0].view(np.uint32))


# ---------------------------------------------------------------- partition_shuffle

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "uint8"])
def test_partition_shuffle_direct_and_staged_paths_agree(dtype):
    """partition_shuffle copies each row straight to its place when no output row overlaps a source row (separate
    tiles, or disjoint columns of one tile; rows of one run by memcpy, strided rows by the pattern copy), and stages
    the source rows in scratch when rows may overlap (interleaved columns, in place). Every path gives
    out[p] = in[perm[p]] bit for bit, with repeated and unused source partitions."""
    P, F = 64, 24
    x = RNG.integers(-100, 100, size=(P, F))
    perm = RNG.integers(0, P, size=P)
    perm[:3] = [5, 5, P - 1]
    xr = round_to(x, dtype)

    def emit(p, t):
        p.partition_shuffle(t["a"], t["x"], perm)                                  # direct, one run per row
        p.partition_shuffle(t["b"], t["x"][:, 1::2], perm)                         # direct, strided source
        p.tensor_copy(t["c"], t["x"])
        p.partition_shuffle(t["c"][:, :F // 2], t["c"][:, F // 2:], perm)          # direct, same tile
        p.tensor_copy(t["d"], t["x"])
        p.partition_shuffle(t["d"][:, ::2], t["d"][:, 1::2], perm)                 # staged: interleaved columns
        p.tensor_copy(t["e"], t["x"])
        p.partition_shuffle(t["e"], t["e"], perm)                                  # staged: in place
    outs = {k: ((P, F), dtype) for k in "acde"}
    outs["b"] = ((P, F // 2), dtype)
    out, _ = run_op(emit, {"x": (x, dtype)}, outs)
    np.testing.assert_array_equal(out["a"], xr[perm])
    np.testing.assert_array_equal(out["b"], xr[perm][:, 1::2])
    c = xr.copy()
    c[:, :F // 2] = xr[perm][:, F // 2:]
    np.testing.assert_array_equal(out["c"], c)
    d = xr.copy()
    d[:, ::2] = xr[perm][:, 1::2]
    np.testing.assert_array_equal(out["d"], d)
    np.testing.assert_array_equal(out["e"], xr[perm])
