# Tests of the op table (tn.ops): every op is complete, documented, and its shape rule agrees with its reference impl.
import pytest
import torch

from tn import ops
from tn.ir import Literal, Var
from tn.ops import OPS

from conftest import solo_process_group


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _samples():
    """name -> list of (inputs, attrs) covering every op of the table."""
    x, y = _x(3, 4), _x(4)
    i = torch.tensor([[0, 2], [1, 1], [3, 0]])
    s = {}
    for name in ("neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log1p", "sqrt", "rsqrt", "reciprocal",
                 "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
                 "sigmoid", "erf", "erfinv", "relu", "sign", "floor", "ceil", "trunc", "round", "isnan", "isinf"):
        s[name] = [([x], {}), ([_x(5, dtype=torch.bfloat16)], {})]
    s["logical_not"] = [([x > 0], {})]
    s["conj"] = [([torch.randn(3, dtype=torch.complex64)], {})]
    s["view_as_real"] = [([torch.randn(2, 3, dtype=torch.complex64)], {})]
    s["view_as_complex"] = [([_x(3, 2)], {}), ([_x(2, 4, 2).transpose(0, 1)], {})]
    s["bitwise_not"] = [([torch.arange(4)], {}), ([x > 0], {})]
    s["gelu"] = [([x], {}), ([x], {"approximate": "tanh"})]
    s["convert"] = [([x], {"dtype": torch.bfloat16}), ([torch.arange(3)], {"dtype": torch.float32})]
    for name in ("add", "sub", "mul", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
                 "remainder", "fmod", "atan2", "div"):
        s[name] = [([x, y], {}), ([x, 2.0], {}), ([torch.arange(4), 3], {})]
    s["pow"].append(([2.0, x], {}))
    s["div"].append(([torch.arange(4), 3], {"rounding_mode": "floor"}))
    for name in ("logical_and", "logical_or", "logical_xor"):
        s[name] = [([x > 0, y > 0], {})]
    for name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        s[name] = [([torch.arange(4), torch.arange(4)], {}), ([x > 0, True], {})]
    for name in ("bitwise_left_shift", "bitwise_right_shift"):
        s[name] = [([torch.arange(4), torch.arange(4)], {}), ([torch.arange(4, dtype=torch.int32), 3], {}),
                   ([1, torch.arange(4)], {})]
    s["where"] = [([x > 0, x, y], {}), ([x > 0, 1.0, x], {})]
    for name in ("sum", "prod"):
        s[name] = [([x], {"dims": (1,), "keepdim": False}), ([x], {"dims": (0, 1), "keepdim": True}),
                   ([torch.arange(4)], {"dims": (0,), "keepdim": False, "dtype": torch.float32})]
    for name in ("amax", "amin"):
        s[name] = [([x], {"dims": (0,), "keepdim": True}), ([x], {"dims": (0, 1), "keepdim": False})]
    s["any"] = [([x > 0], {"dims": (1,), "keepdim": False})]
    s["argmax"] = [([x], {"dim": 1}), ([x], {})]
    s["argmin"] = [([x], {"dim": 0, "keepdim": True})]
    s["cumsum"] = [([x], {"dim": 1}), ([torch.arange(4)], {"dim": 0, "dtype": torch.float32})]
    for name in ("cummax", "cummin", "logcumsumexp"):
        s[name] = [([x], {"dim": 1}), ([_x(5, dtype=torch.bfloat16)], {"dim": 0})]
    s["cummax"].append(([torch.arange(4)], {"dim": 0}))
    s["sort"] = [([x], {"dim": 1}), ([x], {"dim": 0, "descending": True, "stable": True})]
    s["topk"] = [([x], {"k": 2, "dim": 1}), ([x], {"k": 1, "dim": 0, "largest": False})]
    s["matmul"] = [([x, _x(4, 5)], {}), ([_x(2, 3, 4), _x(2, 4, 5)], {})]
    conv = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "transposed": False,
            "output_padding": (0, 0), "groups": 1}
    s["convolution"] = [([_x(2, 3, 6, 6), _x(4, 3, 3, 3), _x(4)], conv), ([_x(2, 3, 6, 6), _x(4, 3, 3, 3)], conv)]
    s["convolution_backward"] = [([_x(2, 4, 6, 6), _x(2, 3, 6, 6), _x(4, 3, 3, 3)],
                                  dict(conv, bias_sizes=(4,), output_mask=(True, True, True))),
                                 ([_x(2, 4, 6, 6), _x(2, 3, 6, 6), _x(4, 3, 3, 3)],
                                  dict(conv, bias_sizes=None, output_mask=(False, True, False)))]
    pool = {"kernel_size": (2, 2), "stride": (2, 2), "padding": (0, 0), "ceil_mode": False,
            "count_include_pad": True, "divisor_override": None}
    s["avg_pool2d"] = [([_x(2, 3, 6, 6)], pool)]
    s["avg_pool2d_backward"] = [([_x(2, 3, 3, 3), _x(2, 3, 6, 6)], pool)]
    s["reshape"] = [([x], {"shape": (2, 6)}), ([x], {"shape": (12,)})]
    s["permute"] = [([x], {"dims": (1, 0)})]
    s["expand"] = [([y], {"shape": (3, 4)}), ([_x(3, 1)], {"shape": (2, 3, 4)})]
    s["slice"] = [([x], {"dim": 1, "start": 1, "end": 4, "step": 2}), ([x], {"dim": 0, "start": 0, "end": 0})]
    s["slice_scatter"] = [([x, _x(3, 2)], {"dim": 1, "start": 1, "end": 4, "step": 2})]
    s["cat"] = [([x, _x(3, 2)], {"dim": 1}), ([x], {"dim": 0})]
    s["pad"] = [([x], {"pad": (1, 2), "value": 0.5}), ([x], {"pad": (0, 0, 1, 1)})]
    s["flip"] = [([x], {"dims": (0, 1)})]
    s["as_strided"] = [([x], {"size": (3,), "stride": (5,), "offset": 0})]
    s["as_strided_scatter"] = [([x, _x(3)], {"size": (3,), "stride": (5,), "offset": 0})]
    s["gather"] = [([x, i], {"dim": 1})]
    s["scatter"] = [([torch.zeros(3, 4), i, _x(3, 2)], {"dim": 1}), ([torch.zeros(3, 4), i, 1.5], {"dim": 1})]
    s["scatter_add"] = [([torch.zeros(3, 4), i, _x(3, 2)], {"dim": 1})]
    s["scatter_reduce"] = [([torch.zeros(3, 4), i, _x(3, 2)], {"dim": 1, "reduce": "amax", "include_self": False})]
    s["index"] = [([x, torch.tensor([2, 0])], {"dims": (0,)}), ([x, torch.tensor([1, 3])], {"dims": (1,)})]
    s["index_put"] = [([x, _x(2, 4), torch.tensor([2, 0])], {"dims": (0,)}),
                      ([x, _x(2), torch.tensor([1, 1]), torch.tensor([0, 0])], {"dims": (0, 1), "accumulate": True})]
    s["full"] = [([], {"shape": (2, 3), "value": 1.5, "dtype": torch.float32}),
                 ([], {"shape": (), "value": True, "dtype": torch.bool})]
    s["iota"] = [([], {"length": 5, "start": 0, "step": 1, "dtype": torch.int64}),
                 ([], {"length": 4, "start": 0.5, "step": 0.25, "dtype": torch.float32})]
    s["host"] = [([_x(4, 4)], {"fn": torch.ops.aten.linalg_inv_ex.default, "check_errors": False}),
                 ([_x(3, 8)], {"fn": torch.ops.aten._fft_r2c.default, "dim": (1,), "normalization": 0,
                               "onesided": True})]
    s["linalg_check"] = [([torch.tensor(0, dtype=torch.int32)], {"api_name": "linalg.inv", "is_matrix": True}),
                         ([torch.zeros(2, dtype=torch.int32)], {"api_name": "linalg.cholesky", "is_matrix": True,
                                                                 "where": "f.py:3"})]
    s["rand"] = [([], {"shape": (2, 3), "dtype": torch.float32})]
    s["randn"] = [([], {"shape": (4,), "dtype": torch.bfloat16})]
    g = solo_process_group()     # the collective ops' references call this one-rank gloo group
    s["all_reduce"] = [([_x(3, 4)], {"reduce_op": "sum", "group": g}),
                       ([_x(5).to(torch.bfloat16)], {"reduce_op": "max", "group": g})]
    s["all_gather"] = [([_x(3, 4)], {"group_size": 1, "group": g})]
    s["reduce_scatter"] = [([_x(4, 2)], {"reduce_op": "sum", "group_size": 1, "group": g})]
    s["all_to_all"] = [([_x(4, 2)], {"output_split_sizes": (4,), "input_split_sizes": (4,), "group": g}),
                       ([_x(3, 2)], {"output_split_sizes": (3,), "input_split_sizes": (3,), "group": g})]
    s["broadcast"] = [([_x(2, 3)], {"src": 0, "group": g})]
    s["wait"] = [([_x(2, 3)], {})]
    return s


SAMPLES = _samples()


def test_every_op_has_samples():
    missing = sorted(set(OPS) - set(SAMPLES))
    assert not missing, f"add samples for {missing} to tests/test_ops_table.py"


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_is_complete(name):
    op = OPS[name]
    assert op.name == name
    assert op.category in ops.CATEGORIES
    assert callable(op.impl) and callable(op.shape_rule)
    assert hasattr(op, "lowering") and (op.lowering is None or callable(op.lowering))
    assert isinstance(op.random, bool)
    assert op.doc and isinstance(op.doc, str)
    assert name in ops.__doc__, f"document {name} in the table of tn/ops/__init__.py's docstring"


def _aval(a):
    return Var(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else Literal(a)


@pytest.mark.parametrize("name", sorted(OPS))
def test_shape_rule_agrees_with_impl(name):
    op = OPS[name]
    for inputs, attrs in SAMPLES[name]:
        out = op.impl(*inputs, **attrs)
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        rule = op.shape_rule(*[_aval(a) for a in inputs], **attrs)
        assert [(tuple(o.shape), o.dtype) for o in outs] == [(tuple(s), d) for s, d in rule], (name, attrs)


def test_random_flags():
    assert {n for n, op in OPS.items() if op.random} == {"rand", "randn"}


def test_from_aten_points_into_the_table():
    for overload, (op, conv) in ops.FROM_ATEN.items():
        assert OPS[op.name] is op and callable(conv)
        assert overload in op.aten


def test_decompositions_are_callables():
    assert ops.DECOMPOSITIONS and all(callable(f) for f in ops.DECOMPOSITIONS.values())


def test_every_override_of_torch_decomp_says_why():
    """Where tn's decomposition replaces one of ``torch._decomp.decomposition_table``, the decorator gives the
    reason in one line; a reason sits only on a decomposition that replaces one of torch's."""
    from torch._decomp import decomposition_table

    overrides = [ov for ov in ops.DECOMPOSITIONS if ov in decomposition_table]
    assert overrides, "tn overrides some of torch's decompositions (cat, mean, clamp, ...)"
    missing = [str(ov) for ov in overrides if ov not in ops.OVERRIDE_REASONS]
    assert missing == [], f"give @decomposition(..., instead_of_torch='why') for {missing}"
    for ov, why in ops.OVERRIDE_REASONS.items():
        assert isinstance(why, str) and why.strip() and "\n" not in why, ov
        fn = ops.DECOMPOSITIONS[ov]
        assert any(o in decomposition_table for o, f in ops.DECOMPOSITIONS.items() if f is fn), \
            f"{ov}: a reason on a decomposition that overrides none of torch's"


def test_a_second_registration_of_an_overload_is_refused():
    some_overload, (op, _) = next(iter(ops.FROM_ATEN.items()))
    with pytest.raises(ValueError, match="twice"):
        ops.from_aten(op, some_overload)(lambda *a: None)
    decomposed = next(iter(ops.DECOMPOSITIONS))
    with pytest.raises(ValueError, match="two tn decompositions"):
        ops.decomposition(decomposed)(lambda *a: None)


def test_the_package_files_register_what_they_say():
    """tn.ops' files: core ops in tn.ops.core, the collective ops in tn.ops.collective, the complex views in
    tn.ops.fft, decompositions in tn.ops.decompositions / nn_layers / special / attention_grad / grouped_mm /
    linalg / ldl / fft / resample / ctc / segment_reduce_grad / histogram / linear_cross_entropy (and collective:
    its in-place/out=/coalesced forms)."""
    from tn.ops import (attention_grad, collective, core, ctc, decompositions, fft, grouped_mm, histogram, ldl,
                        linalg, linear_cross_entropy, nn_layers, resample, segment_reduce_grad, special)

    where_ops = {op.name: op.impl.__module__ for op in OPS.values()}
    assert {n for n, m in where_ops.items() if m == collective.__name__} == set(collective.COLLECTIVE_OPS)
    assert {n for n, m in where_ops.items() if m == fft.__name__} == {"view_as_real", "view_as_complex"}
    assert set(where_ops.values()) == {core.__name__, collective.__name__, fft.__name__}, \
        "core ops are registered in tn.ops.core"
    where = {f.__module__ for f in ops.DECOMPOSITIONS.values()}
    assert where == {decompositions.__name__, nn_layers.__name__, special.__name__, collective.__name__,
                     attention_grad.__name__, grouped_mm.__name__, linalg.__name__, fft.__name__, resample.__name__,
                     ctc.__name__, segment_reduce_grad.__name__, ldl.__name__, histogram.__name__}
    by_name = {f.__module__ for f in ops.DECOMPOSITIONS_BY_NAME.values()}   # custom ops of other packages
    assert by_name == {grouped_mm.__name__, linear_cross_entropy.__name__}


def test_get_unknown_op_raises():
    import tn

    assert ops.get("add") is OPS["add"]
    with pytest.raises(tn.UnsupportedOpError, match="no core op named"):
        ops.get("frobnicate")


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        ops.register("add", "elementwise")(lambda x, y: x + y)


# ----------------------------------------------------------------- the facts an Op declares (passes and compiler read)

def test_reductions_declare_their_alu_and_identity():
    from tn.neuron import isa

    reductions = {n: op for n, op in OPS.items() if op.reduce_alu is not None}
    assert set(reductions) == {"sum", "prod", "amax", "amin", "any"}
    for name, op in reductions.items():
        assert op.category == "reduction" and op.reduce_alu in isa.ALU_OPS
        x = torch.tensor([False, True, False]) if name == "any" else torch.tensor([0.75, -2.5, 3.0])
        padded = torch.cat([x, torch.tensor([op.reduce_identity], dtype=x.dtype)])
        torch.testing.assert_close(op.impl(padded, (0,)), op.impl(x, (0,)))  # the identity changes nothing
    assert all(op.reduce_identity is None for op in OPS.values() if op.reduce_alu is None)


def test_impure_ops_are_the_random_and_the_effectful_ones():
    random = {n for n, op in OPS.items() if op.random}
    effectful = {n for n, op in OPS.items() if op.effectful}
    assert random == {n for n, op in OPS.items() if op.category == "random"} and random
    # the collectives, and linalg_check (a host op whose only effect is raising eager's LinAlgError)
    assert effectful == {n for n, op in OPS.items() if op.category == "collective"} | {"linalg_check"}
    assert {n for n, op in OPS.items() if op.impure} == random | effectful


def test_tile_rules_are_held_by_the_elementwise_ops():
    import tn.lower  # noqa: F401  (registers tile rules)
    from tn.lower.elementwise import ELEMENTWISE_OPS

    held = {n for n, op in OPS.items() if op.tile_rule is not None}
    assert held == set(ELEMENTWISE_OPS) and {"add", "exp", "where", "convert"} <= held
    assert all(OPS[n].category == "elementwise" for n in held)
