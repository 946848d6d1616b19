# Every NeuronCore instruction against a numpy/torch reference on random tiles, edge shapes included.
import math

import numpy as np
import pytest
import torch

import tn
from test_neuron_helpers import TOL, from_device, round_to, run_op, to_device
from tn.neuron import Program

RNG = np.random.default_rng(1234)


def rnd(*shape, scale=1.0):
    return RNG.standard_normal(shape) * scale


# ---------------------------------------------------------------- DMA

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "int64", "uint8", "bool"])
def test_dma_round_trip_every_dtype(dtype):
    a = RNG.integers(0, 2 if dtype == "bool" else 100, size=(37, 19))
    out, res = run_op(lambda p, t: p.tensor_copy(t["y"], t["x"]) if dtype != "int64" else
                      p.dma_copy(t["y"], t["x"]), {"x": (a, dtype)}, {"y": ((37, 19), dtype)})
    np.testing.assert_allclose(out["y"], from_device(to_device(a, dtype), dtype))
    assert res.hbm_read_bytes == res.hbm_write_bytes == a.size * tn.neuron.isa.DTYPE_SIZES[
        tn.neuron.isa.dtype_code(dtype)]


def test_dma_strided_views_both_sides():
    x = rnd(64, 48).astype(np.float32)
    prog = Program("strided")
    X = prog.hbm("x", (64, 48), "float32")
    Y = prog.hbm("y", (24, 32), "float32", kind="output")
    Z = prog.hbm("z", (48, 64), "float32", kind="output")
    t = prog.sbuf((24, 32), "float32")
    prog.dma_copy(t, X[1::2][:24, 8:40])                 # every other row, columns 8..39
    prog.dma_copy(Y, t)
    u = prog.sbuf((48, 64), "float32")
    prog.dma_copy(u, X.T)                                # transposing DMA
    v = prog.sbuf((48, 2, 32), "float32")
    prog.dma_copy(v, u.reshape(48, 2, 32))               # SBUF -> SBUF
    prog.dma_copy(Z, v.reshape(48, 64))
    res = prog.run({"x": x})
    np.testing.assert_allclose(res.outputs["y"], x[1::2][:24, 8:40], rtol=1e-6)
    np.testing.assert_allclose(res.outputs["z"], x.T, rtol=1e-6)


def test_dma_broadcast_and_hbm_to_hbm():
    x = rnd(1, 16).astype(np.float32)
    prog = Program("bcast")
    X = prog.hbm("x", (1, 16), "float32")
    Y = prog.hbm("y", (8, 16), "float32", kind="output")
    W = prog.hbm("w", (8, 16), "float32", kind="output")
    t = prog.sbuf((8, 16), "float32")
    prog.dma_copy(t, X.view().broadcast_to((8, 16)))
    prog.dma_copy(Y, t)
    prog.dma_copy(W, Y)
    res = prog.run({"x": x})
    np.testing.assert_allclose(res.outputs["y"], np.repeat(x, 8, 0), rtol=1e-6)
    np.testing.assert_allclose(res.outputs["w"], np.repeat(x, 8, 0), rtol=1e-6)


@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
def test_dma_gather_embedding_rows(idx_dtype):
    V, D, P = 1000, 64, 96
    table = rnd(V, D).astype(np.float32)
    ids = RNG.integers(0, V, size=(P, 1))
    prog = Program("embed")
    T = prog.hbm("table", (V, D), "float32")
    I = prog.hbm("ids", (P, 1), idx_dtype)
    O = prog.hbm("out", (P, D), "float32", kind="output")
    it = prog.sbuf((P, 1), idx_dtype)
    prog.dma_copy(it, I)
    et = prog.sbuf((P, D), "float32")
    prog.dma_gather(et, T, it)
    prog.dma_copy(O, et)
    res = prog.run({"table": table, "ids": to_device(ids, idx_dtype)})
    np.testing.assert_allclose(res.outputs["out"], table[ids[:, 0]], rtol=1e-6)
    ids[5, 0] = V  # out of range: the engine names the index and the table size
    with pytest.raises(tn.NeuronError, match=f"index {V} in partition 5 is outside the table's {V} rows"):
        prog.run({"table": table, "ids": to_device(ids, idx_dtype)})


# ---------------------------------------------------------------- TensorE

@pytest.mark.parametrize("K,M,N", [(1, 1, 1), (128, 128, 512), (3, 7, 5), (128, 1, 512), (64, 128, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matmul_shapes_and_dtypes(K, M, N, dtype):
    a = rnd(K, M)
    b = rnd(K, N)
    out = _mm(a, b, dtype, M, N)
    ref = round_to(a, dtype).T @ round_to(b, dtype)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * max(1, math.sqrt(K)))


def _mm(a, b, dtype, M, N):
    def emit(p, t):
        ps = p.psum((M, N))
        p.matmul(ps, t["a"], t["b"])
        p.tensor_copy(t["c"], ps)
    out, _ = run_op(emit, {"a": (a, dtype), "b": (b, dtype)}, {"c": ((M, N), "float32")})
    return out["c"]


def test_matmul_strided_stationary_and_accumulation_groups():
    K, M, N = 128, 64, 256
    a = rnd(K, 2 * M)
    b = rnd(K, N)

    def emit(p, t):
        ps = p.psum((M, N))
        p.matmul(ps, t["a"][:, ::2], t["b"])                 # strided stationary (gathered by the engine)
        p.matmul(ps, t["a"][:, 1::2], t["b"], accumulate=True)
        p.tensor_copy(t["c"], ps)
    out, res = run_op(emit, {"a": (a, "bfloat16"), "b": (b, "bfloat16")}, {"c": ((M, N), "float32")})
    ar, br = round_to(a, "bfloat16"), round_to(b, "bfloat16")
    np.testing.assert_allclose(out["c"], ar[:, ::2].T @ br + ar[:, 1::2].T @ br, rtol=1e-4, atol=1e-3)
    assert res.matmul_flops == 2 * 2 * K * M * N


@pytest.mark.parametrize("P,F", [(128, 128), (5, 77), (1, 1)])
def test_transpose(P, F):
    x = rnd(P, F)
    out = _tr(x, P, F)
    np.testing.assert_allclose(out, round_to(x, "bfloat16").T, rtol=1e-6)


def _tr(x, P, F):
    def emit(p, t):
        ps = p.psum((F, P))
        p.transpose(ps, t["x"])
        p.tensor_copy(t["y"], ps)
    return run_op(emit, {"x": (x, "bfloat16")}, {"y": ((F, P), "float32")})[0]["y"]


# ---------------------------------------------------------------- ScalarE

def _erf(x):
    return torch.special.erf(torch.from_numpy(x)).numpy()


ACT_REF = {
    "identity": lambda x: x, "relu": lambda x: np.maximum(x, 0),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy(),
    "gelu": lambda x: torch.nn.functional.gelu(torch.from_numpy(x)).numpy(),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "tanh": np.tanh, "exp": np.exp, "log": np.log,
    "silu": lambda x: x / (1 + np.exp(-x)), "softplus": lambda x: np.logaddexp(0, x), "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "reciprocal": lambda x: 1 / x, "square": np.square, "abs": np.abs,
    "sign": np.sign, "sin": np.sin, "cos": np.cos, "erf": _erf,
}
POSITIVE = {"log", "sqrt", "rsqrt", "reciprocal"}


@pytest.mark.parametrize("func", sorted(ACT_REF))
def test_activation_functions_with_scale_and_bias(func):
    P, F = 100, 70
    x = rnd(P, F)
    scale, bias = 0.75, 0.25
    if func in POSITIVE:
        x = np.abs(x) + 0.5
    out, res = run_op(lambda p, t: p.activation(t["y"], t["x"], func, scale=scale, bias=bias),
                      {"x": (x, "float32")}, {"y": ((P, F), "float32")})
    xr = round_to(x, "float32")
    np.testing.assert_allclose(out["y"], ACT_REF[func](xr * scale + bias), rtol=2e-5, atol=2e-5)
    assert res.counts["ScalarE"] == 1


def test_activation_tile_bias_scale_and_fused_reduce_bf16():
    P, F = 64, 300
    x, b, s = rnd(P, F), rnd(P, 1), rnd(P, 1)

    def emit(p, t):
        p.activation(t["y"], t["x"], "exp", scale=t["s"], bias=t["b"], reduce_op="add", reduce_out=t["r"])
        p.activation(t["z"], t["x"], "identity", reduce_op="max", reduce_out=t["m"])
    out, _ = run_op(emit, {"x": (x, "bfloat16"), "b": (b, "float32"), "s": (s, "float32")},
                    {"y": ((P, F), "bfloat16"), "r": ((P, 1), "float32"), "z": ((P, F), "float32"),
                     "m": ((P, 1), "float32")})
    xr = round_to(x, "bfloat16")
    ref = np.exp(xr * round_to(s, "float32") + round_to(b, "float32"))
    np.testing.assert_allclose(out["y"], ref, **TOL["bfloat16"])
    np.testing.assert_allclose(out["r"][:, 0], ref.sum(1), rtol=1e-4)
    np.testing.assert_allclose(out["m"][:, 0], xr.max(1), rtol=1e-6)


# ---------------------------------------------------------------- VectorE

def _alu_ref(op, x, y):
    with np.errstate(all="ignore"):
        return _alu_table(x, y)[op].astype(np.float64)


def _alu_table(x, y):
    return {
        "add": x + y, "subtract": x - y, "multiply": x * y, "divide": x / y, "max": np.maximum(x, y),
        "min": np.minimum(x, y), "pow": np.power(np.abs(x), y), "is_equal": (x == y), "not_equal": (x != y),
        "is_ge": x >= y, "is_gt": x > y, "is_le": x <= y, "is_lt": x < y,
        "logical_and": (x != 0) & (y != 0), "logical_or": (x != 0) | (y != 0), "logical_xor": (x != 0) ^ (y != 0),
        "abs_max": np.maximum(np.abs(x), np.abs(y)), "mod": np.mod(x, y), "bypass": x,
    }


ALU = ["add", "subtract", "multiply", "divide", "max", "min", "pow", "is_equal", "not_equal", "is_ge", "is_gt",
       "is_le", "is_lt", "logical_and", "logical_or", "logical_xor", "abs_max", "mod", "bypass"]


@pytest.mark.parametrize("op", ALU)
def test_tensor_tensor_ops(op):
    P, F = 128, 33
    x = np.round(rnd(P, F) * 3) / 2
    y = np.round(rnd(P, F) * 3) / 2 + (0.5 if op in ("divide", "mod") else 0)
    y[y == 0] = 1.0
    if op == "pow":
        x = np.abs(x) + 0.5
    out, _ = run_op(lambda p, t: p.tensor_tensor(t["z"], t["x"], t["y"], op), {"x": (x, "float32"),
                    "y": (y, "float32")}, {"z": ((P, F), "float32")})
    np.testing.assert_allclose(out["z"], _alu_ref(op, x, y), rtol=1e-5, atol=1e-5)


def test_tensor_tensor_bf16_out_broadcast_and_gpsimd():
    P, F = 32, 64
    x, y = rnd(P, F), rnd(P, 1)

    def emit(p, t):
        p.tensor_tensor(t["z"], t["x"], t["y"].broadcast_to((P, F)), "multiply")
        p.tensor_tensor(t["w"], t["x"], t["x"], "add", engine="gpsimd")
    out, res = run_op(emit, {"x": (x, "float32"), "y": (y, "float32")},
                      {"z": ((P, F), "bfloat16"), "w": ((P, F), "float32")})
    np.testing.assert_allclose(out["z"], round_to(x * y, "bfloat16"), **TOL["bfloat16"])
    np.testing.assert_allclose(out["w"], 2 * x, rtol=1e-6)
    assert res.counts["GpSimd"] == 1


def test_tensor_scalar_immediates_tiles_and_reverse():
    P, F = 64, 40
    # inputs drawn from their own generator (not the module's, whose state depends on test order), |x| in
    # [0.5, 1.5] and s in [2.5, 3.5]: 1 - s/x then stays >= 0.67 in magnitude, so no cancellation or division
    # near zero makes an fp32 result look wrong to a relative tolerance
    rng = np.random.default_rng(235)
    x = rng.uniform(0.5, 1.5, (P, F)) * rng.choice([-1.0, 1.0], (P, F))
    s = rng.uniform(2.5, 3.5, (P, 1))

    def emit(p, t):
        p.tensor_scalar(t["a"], t["x"], "multiply", 3.0, "add", 1.0)
        p.tensor_scalar(t["b"], t["x"], "subtract", t["s"], "divide", 2.0, reverse0=True)
        p.tensor_scalar(t["c"], t["x"], "max", 0.0)
        p.tensor_scalar(t["d"], t["x"], "divide", t["s"], "subtract", 1.0, reverse0=True, reverse1=True)
    out, _ = run_op(emit, {"x": (x, "float32"), "s": (s, "float32")},
                    {k: ((P, F), "float32") for k in "abcd"})
    np.testing.assert_allclose(out["a"], x * 3 + 1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["b"], (s - x) / 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["c"], np.maximum(x, 0), rtol=1e-6)
    np.testing.assert_allclose(out["d"], 1 - s / x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op,ref", [("add", np.sum), ("max", np.max), ("min", np.min), ("multiply", np.prod)])
@pytest.mark.parametrize("axis", [-1, 1, (1, 2), (2, 3), (1, 3)])
def test_tensor_reduce_axes(op, ref, axis):
    P, shape = 16, (4, 5, 6)
    x = rnd(P, *shape) * (0.5 if op == "multiply" else 1) + (1.0 if op == "multiply" else 0)
    ax = (axis,) if isinstance(axis, int) else axis
    red = ref(x, axis=ax)
    out, _ = run_op(lambda p, t: p.tensor_reduce(t["y"], t["x"], op, axis=axis), {"x": (x, "float32")},
                    {"y": (red.shape, "float32")})
    np.testing.assert_allclose(out["y"], red, rtol=1e-5, atol=1e-5)


def test_tensor_reduce_logical():
    x = (RNG.random((8, 12)) > 0.3).astype(np.float32)
    out, _ = run_op(lambda p, t: (p.tensor_reduce(t["a"], t["x"], "logical_and"),
                                  p.tensor_reduce(t["o"], t["x"], "logical_or")),
                    {"x": (x, "float32")}, {"a": ((8, 1), "float32"), "o": ((8, 1), "float32")})
    np.testing.assert_allclose(out["a"][:, 0], x.all(1))
    np.testing.assert_allclose(out["o"][:, 0], x.any(1))


@pytest.mark.parametrize("dst", ["bfloat16", "float16", "int32", "uint8", "bool", "float32"])
def test_tensor_copy_casts(dst):
    x = rnd(64, 50) * 100
    out, _ = run_op(lambda p, t: p.tensor_copy(t["y"], t["x"]), {"x": (x, "float32")}, {"y": ((64, 50), dst)})
    xt = torch.from_numpy(x.astype(np.float32))
    if dst in ("int32",):
        ref = xt.to(torch.int32).double().numpy()            # truncation toward zero
    elif dst == "uint8":
        ref = xt.clamp(0, 255).to(torch.uint8).double().numpy()
    elif dst == "bool":
        ref = (xt != 0).double().numpy()
    else:
        ref = xt.to(getattr(torch, dst)).double().numpy()    # RNE, bit-compatible with torch
    np.testing.assert_allclose(out["y"], ref, rtol=0, atol=0)


def test_select_and_psum_copy():
    P, F = 48, 20
    c, x, y = (rnd(P, F) > 0).astype(np.float32), rnd(P, F), rnd(P, F)
    out, _ = run_op(lambda p, t: p.select(t["z"], t["c"], t["x"], t["y"]),
                    {"c": (c, "uint8"), "x": (x, "float32"), "y": (y, "float32")}, {"z": ((P, F), "float32")})
    np.testing.assert_allclose(out["z"], np.where(c != 0, round_to(x, "float32"), round_to(y, "float32")))


def test_bn_stats_and_aggr():
    P, F = 128, 1000
    x = rnd(P, F) * 2 + 1
    chunks = [(0, 500), (500, 1000)]

    def emit(p, t):
        st = p.sbuf((P, 2, 3), "float32")
        for j, (a, b) in enumerate(chunks):
            p.bn_stats(st[:, j, :], t["x"][:, a:b])
        p.bn_aggr(t["mv"], st)
    out, _ = run_op(emit, {"x": (x, "float32")}, {"mv": ((P, 2), "float32")})
    np.testing.assert_allclose(out["mv"][:, 0], x.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["mv"][:, 1], x.var(1), rtol=1e-4)


# ---------------------------------------------------------------- GpSimd

def test_iota_int_and_float():
    P = 16

    def emit(p, t):
        p.iota(t["i"], base=5, channel_multiplier=100, pattern=[10, 1])
        p.iota(t["f"], base=0.5, channel_multiplier=-1, pattern=[2])
    out, res = run_op(emit, {}, {"i": ((P, 3, 4), "int32"), "f": ((P, 7), "float32")})
    p, a, b = np.meshgrid(np.arange(P), np.arange(3), np.arange(4), indexing="ij")
    np.testing.assert_array_equal(out["i"], 5 + 100 * p + 10 * a + b)
    p, a = np.meshgrid(np.arange(P), np.arange(7), indexing="ij")
    np.testing.assert_allclose(out["f"], 0.5 - p + 2 * a)
    assert res.counts["GpSimd"] == 2


def test_affine_select_causal_mask():
    S = 64
    s = rnd(S, S)
    out, _ = run_op(lambda p, t: p.affine_select(t["m"], t["s"], cmp="is_ge", channel_multiplier=1,
                                                 pattern=[-1], fill=-1e30),
                    {"s": (s, "float32")}, {"m": ((S, S), "float32")})
    ref = np.where(np.tril(np.ones((S, S))) > 0, round_to(s, "float32"), -1e30)
    np.testing.assert_allclose(out["m"], ref, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_memset(dtype):
    out, _ = run_op(lambda p, t: (p.memset(t["a"], 3), p.memset(t["a"][32:36, 1:3], -7, engine="vector")),
                    {}, {"a": ((64, 5), dtype)})
    ref = np.full((64, 5), 3.0)
    ref[32:36, 1:3] = -7
    np.testing.assert_allclose(out["a"], ref)


@pytest.mark.parametrize("op,ref", [("add", np.sum), ("max", np.max), ("min", np.min)])
def test_partition_reduce_broadcasts_to_every_partition(op, ref):
    x = rnd(100, 24)
    out, _ = run_op(lambda p, t: p.partition_reduce(t["y"], t["x"], op), {"x": (x, "float32")},
                    {"y": ((32, 24), "float32")})
    np.testing.assert_allclose(out["y"], np.broadcast_to(ref(round_to(x, "float32"), 0), (32, 24)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
def test_partition_shuffle_in_place(dtype):
    x = RNG.integers(-1000, 1000, size=(64, 9))
    perm = RNG.permutation(64)
    out, _ = run_op(lambda p, t: (p.partition_shuffle(t["x"], t["x"], perm), p.tensor_copy(t["y"], t["x"])),
                    {"x": (x, dtype)}, {"y": ((64, 9), dtype)})
    np.testing.assert_allclose(out["y"], round_to(x, dtype)[perm])


@pytest.mark.parametrize("func,lo,hi", [("exp", -87.0, 88.5), ("tanh", -20.0, 20.0), ("sigmoid", -80.0, 80.0),
                                        ("silu", -80.0, 80.0), ("gelu_tanh", -10.0, 10.0)])
def test_vectorised_transcendentals_accuracy_over_wide_ranges(func, lo, hi):
    P, F = 128, 512
    x = np.linspace(lo, hi, P * F).reshape(P, F).astype(np.float32)
    x[0, :6] = [0.0, -0.0, 1e-7, -1e-7, 0.3, -0.6]
    out, _ = run_op(lambda p, t: p.activation(t["y"], t["x"], func), {"x": (x, "float32")},
                    {"y": ((P, F), "float32")})
    ref = ACT_REF[func](x.astype(np.float64))
    np.testing.assert_allclose(out["y"], ref, rtol=3e-6, atol=1e-30 if func == "exp" else 1e-7)


def test_exp_special_values():
    x = np.array([[np.nan, np.inf, -np.inf, 89.0, -104.0, 0.0]], np.float32)
    out, _ = run_op(lambda p, t: p.activation(t["y"], t["x"], "exp"), {"x": (x, "float32")}, {"y": ((1, 6), "float32")})
    y = out["y"][0]
    assert np.isnan(y[0]) and y[1] == np.inf and y[2] == 0 and y[3] == np.inf and y[4] == 0 and abs(y[5] - 1) < 1e-7


def test_copies_between_differently_shaped_patterns():
    P = 32
    x, y = rnd(P, 6, 8), rnd(P, 8)

    def emit(p, t):
        p.tensor_copy(t["a"].reshape(P, 8, 6).permute(0, 2, 1), t["x"])      # byte copy between patterns
        p.partition_shuffle(t["b"], t["x"].reshape(P, 48), list(range(P))[::-1])
        w = p.sbuf((P, 4, 16), "bfloat16")
        p.tensor_copy(w[:, :, :12], t["x"].reshape(P, 4, 12))                # strided destination
        ps = p.psum((48, 8))
        p.matmul(ps, w[:, :, :12], t["y"])                                   # 2-axis strided stationary
        p.tensor_copy(t["m"], ps)
    out, _ = run_op(emit, {"x": (x, "bfloat16"), "y": (y, "bfloat16")},
                    {"a": ((P, 8, 6), "bfloat16"), "b": ((P, 48), "bfloat16"), "m": ((48, 8), "float32")})
    xr, yr = round_to(x, "bfloat16"), round_to(y, "bfloat16")
    np.testing.assert_allclose(out["a"], xr.transpose(0, 2, 1), rtol=1e-7)
    np.testing.assert_allclose(out["b"], xr.reshape(P, 48)[::-1], rtol=1e-7)
    np.testing.assert_allclose(out["m"], xr.reshape(P, 48).T @ yr, rtol=1e-4, atol=1e-4)


def test_negative_strides_on_both_sides():
    x = rnd(16, 10)
    prog = Program("flip")
    X = prog.hbm("x", (16, 10), "float32")
    Y = prog.hbm("y", (16, 10), "float32", kind="output")
    t = prog.sbuf((16, 10))
    u = prog.sbuf((16, 10))
    prog.dma_copy(t, X[::-1, ::-1])
    prog.tensor_tensor(u[:, ::-1], t, t, "add")
    prog.dma_copy(Y, u)
    res = prog.run({"x": x.astype(np.float32)})
    np.testing.assert_allclose(res.outputs["y"], 2 * x.astype(np.float32)[::-1], rtol=1e-6)


@pytest.mark.parametrize("accumulate", [False, True])
def test_dma_scatter_rows(accumulate):
    V, D, P = 50, 16, 40
    table = rnd(V, D).astype(np.float32)
    ids = RNG.integers(0, V, size=(P, 1))          # duplicates included
    ids[:3, 0] = [7, 7, 7]
    src = rnd(P, D).astype(np.float32)
    prog = Program("scatter")
    T = prog.hbm("table", (V, D), "float32", kind="inout")
    I = prog.hbm("ids", (P, 1), "int32")
    S = prog.hbm("src", (P, D), "float32")
    it = prog.sbuf((P, 1), "int32")
    st = prog.sbuf((P, D), "float32")
    prog.dma_copy(it, I)
    prog.dma_copy(st, S)
    prog.dma_scatter(T, st, it, accumulate=accumulate)
    got = table.copy()
    res = prog.run({"table": got, "ids": ids.astype(np.int32), "src": src})
    ref = table.copy()
    if accumulate:
        np.add.at(ref, ids[:, 0], src)
    else:
        for p in range(P):
            ref[ids[p, 0]] = src[p]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert res.hbm_write_bytes == P * D * 4
    ids[4, 0] = -1
    with pytest.raises(tn.NeuronError, match="index -1 in partition 4 is outside the table's 50 rows"):
        prog.run({"table": got, "ids": ids.astype(np.int32), "src": src})
