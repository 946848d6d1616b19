# Tests of the elementwise lowerings (tn/lower/elementwise.py) against torch on CPU via check_lowering.
import math

import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)
from tn.lower.testing import check_lowering

SHAPES = [(), (1,), (7,), (300, 70), (129, 3), (2, 3, 4, 5), (4096,), (3, 5000)]

UNARY_ANY = ["neg", "exp", "sigmoid", "tanh", "sin", "cos", "erf", "relu", "abs", "sign", "floor", "ceil",
             "trunc", "round", "atan", "sinh", "cosh", "asinh", "expm1", "exp2"]
UNARY_POS = ["log", "log2", "log1p", "sqrt", "rsqrt", "reciprocal"]
UNARY_UNIT = ["asin", "acos", "atanh"]


def _gen(shape, dtype=torch.float32, kind="any", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    if kind == "pos":
        x = x.abs() + 0.1
    elif kind == "unit":
        x = torch.rand(shape, generator=g) * 1.8 - 0.9
    return x.to(dtype)


@pytest.mark.parametrize("op", UNARY_ANY + UNARY_POS + UNARY_UNIT)
def test_unary_fp32(op):
    kind = "pos" if op in UNARY_POS else "unit" if op in UNARY_UNIT else "any"
    for shape in [(300, 70), (5,)]:
        check_lowering(op, _gen(shape, kind=kind), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(shape):
    check_lowering("exp", _gen(shape))
    check_lowering("mul", _gen(shape), _gen(shape, seed=1))


def test_tan_acosh_gelu():
    check_lowering("tan", torch.rand(64, 33) * 2 - 1, rtol=2e-4, atol=2e-5)
    check_lowering("acosh", torch.rand(64, 33) * 3 + 1.01, rtol=2e-4, atol=2e-5)
    x = _gen((200, 40))
    check_lowering("gelu", x)
    check_lowering("gelu", x, approximate="tanh")


def test_round_half_even_and_big():
    x = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.49, 1e7 + 0.5, -123456.5, 3e9, 0.0])
    check_lowering("round", x)
    check_lowering("floor", x)
    check_lowering("ceil", x)
    check_lowering("trunc", x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    x = _gen((257, 65), dtype)
    y = _gen((257, 65), dtype, seed=2)
    check_lowering("add", x, y)
    check_lowering("mul", x, 0.5)
    check_lowering("exp", x)
    check_lowering("tanh", x)
    check_lowering("div", x, y.abs() + 0.5)


def test_mixed_dtypes_and_convert():
    x = _gen((100, 9))
    check_lowering("add", x, _gen((100, 9), torch.bfloat16))
    for dt in (torch.bfloat16, torch.float16, torch.int32, torch.bool, torch.uint8):
        check_lowering("convert", x * 10 if dt != torch.uint8 else (x * 10).abs(), dtype=dt)
    check_lowering("convert", torch.randint(-50, 50, (30, 7), dtype=torch.int32), dtype=torch.float32)
    check_lowering("convert", torch.rand(30, 7) > 0.5, dtype=torch.float32)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "minimum", "pow", "remainder", "fmod",
                                "atan2", "eq", "ne", "lt", "le", "gt", "ge"])
def test_binary_broadcast_and_literals(op):
    a = _gen((130, 17))
    b = _gen((17,), seed=3)
    if op in ("div", "remainder", "fmod"):
        b = b.abs() + 0.5
    if op == "pow":
        a = a.abs() + 0.1
    tol = dict(rtol=2e-4, atol=2e-5)
    check_lowering(op, a, b, **tol)
    check_lowering(op, _gen((130, 1), seed=4).abs() + 0.2 if op == "pow" else _gen((130, 1), seed=4), b, **tol)
    check_lowering(op, a, 1.5, **tol)
    if op != "pow":
        check_lowering(op, 1.5, a if op not in ("div", "remainder", "fmod") else a.abs() + 0.5, **tol)


def test_pow_special_exponents():
    a = _gen((64, 40), kind="pos")
    for e in (2.0, 0.5, -1.0, 1.0, 3.0, 2):
        check_lowering("pow", a, e, rtol=2e-4, atol=2e-5)
    check_lowering("pow", 2.0, _gen((64, 40)), rtol=2e-4, atol=2e-5)


def test_div_rounding_modes():
    a = _gen((50, 31)) * 10
    b = _gen((50, 31), seed=5).abs() + 0.3
    check_lowering("div", a, b, rounding_mode="floor")
    check_lowering("div", a, b, rounding_mode="trunc")
    ai = torch.randint(-100, 100, (50, 31), dtype=torch.int32)
    bi = torch.randint(1, 9, (50, 31), dtype=torch.int32)
    check_lowering("div", ai, bi, rounding_mode="floor")
    check_lowering("div", ai, bi, rounding_mode="trunc")
    check_lowering("div", ai, bi)


def test_int_and_bool_ops():
    a = torch.randint(-1000, 1000, (300, 11), dtype=torch.int32)
    b = torch.randint(-1000, 1000, (300, 11), dtype=torch.int32)
    for op in ("add", "sub", "mul", "maximum", "minimum", "eq", "lt", "ge"):
        check_lowering(op, a, b)
    check_lowering("add", a, 7)
    check_lowering("remainder", a, 7)
    check_lowering("neg", a)
    check_lowering("abs", a)
    check_lowering("relu", a)
    p = torch.rand(300, 11) > 0.5
    q = torch.rand(300, 11) > 0.3
    for op in ("logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor"):
        check_lowering(op, p, q)
    check_lowering("logical_not", p)
    check_lowering("bitwise_not", p)
    check_lowering("logical_not", a)
    check_lowering("logical_and", a, p)


def test_where_and_special_values():
    c = torch.rand(129, 50) > 0.5
    x = _gen((129, 50))
    check_lowering("where", c, x, _gen((50,), seed=7))
    check_lowering("where", c, x, -math.inf)
    check_lowering("where", c[:, :1].contiguous(), 0.0, x)
    check_lowering("where", c, 1.0, 2.0)
    s = torch.tensor([0.0, -1.0, math.inf, -math.inf, math.nan, 2.0])
    check_lowering("isnan", s)
    check_lowering("isinf", s)


def test_not_lowered_cases_raise_in_strict_mode():
    with pytest.raises(tn.UnsupportedOpError, match="float64"):
        check_lowering("exp", torch.randn(3, dtype=torch.float64))
    with pytest.raises(tn.UnsupportedOpError, match="bitwise_left_shift of int64"):
        check_lowering("bitwise_left_shift", torch.ones(3, dtype=torch.int64), 2)


def test_large_tiles_use_all_partitions():
    x = _gen((1024, 1024))
    r = check_lowering("exp", x)
    # one read and one write of the tensor, no more
    assert r.hbm_read_bytes == x.numel() * 4
    assert r.hbm_write_bytes == x.numel() * 4
    # few, large instructions (128 partitions x >= 512 elements), enough of them to pipeline DMA and compute
    assert r.counts["ScalarE"] <= 8


def test_broadcast_input_read_once_per_tile():
    x = _gen((256, 512))
    b = _gen((256, 1), seed=9)
    r = check_lowering("sub", x, b)
    assert r.hbm_read_bytes == (x.numel() + b.numel()) * 4


def test_int64_as_checked_int32_words():
    a = torch.randint(-1000, 1000, (300, 7))
    b = torch.randint(1, 50, (300, 7))
    for op in ("add", "sub", "mul", "maximum", "eq", "lt", "remainder"):
        check_lowering(op, a, b)
    check_lowering("div", a, b, rounding_mode="floor")
    check_lowering("div", a, b)
    check_lowering("add", a, 5)
    check_lowering("where", a > 0, a, b)
    check_lowering("convert", a, dtype=torch.float32)
    check_lowering("convert", torch.randn(30, 5) * 100, dtype=torch.int64)
    check_lowering("neg", torch.arange(-3, 300))


def test_int64_out_of_range_recomputed_on_host():
    from tn.lower import compile_ir
    from tn.lower.testing import build_eqn_ir

    a = torch.randint(-1000, 1000, (200, 3))
    b = torch.randint(-1000, 1000, (200, 3))
    exe = compile_ir(build_eqn_ir("add", a, b))
    assert torch.equal(exe([a, b])[0], a + b)
    assert exe.last_profile.host_ops == {}
    for v in (1 << 40, -(1 << 33), (1 << 24) + 1):
        big = a.clone()
        big[7, 1] = v
        assert torch.equal(exe([big, b])[0], big + b)
        assert exe.last_profile.host_ops == {"<out of range: whole call>": 1}
    # a result out of the exact range is caught too
    c = torch.full((200, 3), (1 << 23) + 5)
    assert torch.equal(exe([c, c])[0], c + c)
    assert exe.last_profile.host_ops == {"<out of range: whole call>": 1}


@pytest.mark.parametrize("scale", [0.0, -0.0, 2.0])
def test_multiplying_by_a_number_keeps_the_sign_of_zero(scale):
    """``x * 0.0`` is one ScalarE activation with scale 0 and no bias: the engine must not add a +0.0 bias
    (``-2 * 0.0`` is ``-0.0`` in torch; ``-0.0 + 0.0`` would be ``+0.0``), on tn.jit and the device."""
    x = torch.tensor([-2.0, 3.0, 0.0, -0.0, float("inf"), -1e-30])
    want = x * scale
    got = tn.jit(lambda t: t * scale)(x)
    dev = (x.to("neuron") * scale).cpu()
    for out in (got, dev):
        assert torch.equal(torch.signbit(out), torch.signbit(want)), (out, want)
        torch.testing.assert_close(out, want, equal_nan=True)
