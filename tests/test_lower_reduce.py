# Tests of the reduction and scan lowerings (tn/lower/reduce.py) against torch, through check_lowering.
import pytest
import torch

pytest.importorskip("tn.lower.testing")
from tn.lower.testing import check_lowering  # noqa: E402


def _randn(shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("name", ["sum", "amax", "amin"])
@pytest.mark.parametrize("shape,dims", [((300, 70), (1,)), ((300, 70), (0,)), ((3, 50, 7), (0, 2)),
                                        ((3, 50, 7), (1,)), ((3, 50, 7), (0, 1, 2)), ((4, 20000), (1,)),
                                        ((100003,), (0,)), ((129, 2, 3), (0, 1))])
def test_reduce_fp32(name, shape, dims):
    check_lowering(name, _randn(shape), dims=dims, keepdim=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["sum", "amax", "amin", "prod"])
def test_reduce_over_a_leading_axis_of_a_long_row(name, dtype):
    """A leading axis reduced over the partitions while the kept axes fill more than one tile (a GPT-2 position
    embedding's gradient, sum over the batch of [8, 512, 768]): no reduced axis is left in the tile. The lowering
    once emitted tensor_reduce(axis=()) and the op ran on the host."""
    x = _randn((8, 64, 768), dtype) * (0.1 if name == "prod" else 1.0) + (1.0 if name == "prod" else 0.0)
    check_lowering(name, x, dims=(0,), keepdim=False)


@pytest.mark.parametrize("name", ["sum", "amax"])
def test_reduce_keepdim_bf16(name):
    check_lowering(name, _randn((2, 300, 5), torch.bfloat16), dims=(1,), keepdim=True)


def test_sum_dtype_attr():
    check_lowering("sum", _randn((2, 3000, 5), torch.bfloat16), dims=(1,), keepdim=False, dtype=torch.float32)


def test_sum_bool_to_int64():
    x = torch.rand(7, 300, generator=torch.Generator().manual_seed(1)) > 0.5
    check_lowering("sum", x, dims=(1,), keepdim=False)
    check_lowering("sum", x, dims=(0, 1), keepdim=False)


def test_sum_scalar():
    check_lowering("sum", torch.tensor(3.0), dims=(), keepdim=False)


def test_prod():
    x = torch.rand(5, 30, generator=torch.Generator().manual_seed(2)) + 0.5
    check_lowering("prod", x, dims=(1,), keepdim=False)
    check_lowering("prod", x, dims=(0, 1), keepdim=False)


def test_amax_int32():
    x = torch.randint(-100, 100, (30, 70), generator=torch.Generator().manual_seed(3)).int()
    check_lowering("amax", x, dims=(0,), keepdim=False)


@pytest.mark.parametrize("dims", [(1,), (0,), (0, 1)])
def test_any(dims):
    x = torch.rand(300, 7, generator=torch.Generator().manual_seed(4)) > 0.97
    check_lowering("any", x, dims=dims, keepdim=False)


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("shape,dim,keepdim", [((300, 70), 1, False), ((300, 70), 0, True), ((3, 50, 7), 1, False),
                                               ((3, 50, 7), None, False), ((4, 20000), 1, False)])
def test_argreduce(name, shape, dim, keepdim):
    attrs = {} if dim is None else {"dim": dim}
    if keepdim:
        attrs["keepdim"] = True
    check_lowering(name, _randn(shape), **attrs)


def test_argmax_ties_first_occurrence():
    x = torch.randint(0, 3, (4, 20000), generator=torch.Generator().manual_seed(5)).float()
    check_lowering("argmax", x, dim=1)
    check_lowering("argmin", x.reshape(-1))


@pytest.mark.parametrize("shape,dim,dtype", [((300, 7), 0, torch.float32), ((3, 300), 1, torch.float32),
                                             ((3, 200, 5), 1, torch.bfloat16), ((1,), 0, torch.float32)])
def test_cumsum(shape, dim, dtype):
    check_lowering("cumsum", _randn(shape, dtype), dim=dim)


def test_cumsum_bool_to_int64():
    x = torch.rand(3, 200, generator=torch.Generator().manual_seed(6)) > 0.5
    check_lowering("cumsum", x, dim=1)


def test_int_prod_falls_back():
    from tn.errors import UnsupportedOpError
    with pytest.raises(UnsupportedOpError):
        check_lowering("prod", torch.arange(10, dtype=torch.int32).reshape(2, 5), dims=(1,), keepdim=False)


@pytest.mark.slow
@pytest.mark.parametrize("shape,dims", [((4096, 1024), (1,)), ((8192, 768), (0,)), ((1 << 20,), (0,))])
def test_big_sums(shape, dims):
    check_lowering("sum", _randn(shape), dims=dims, keepdim=False, rtol=1e-4, atol=1e-3)
    check_lowering("amax", _randn(shape), dims=dims, keepdim=False)


@pytest.mark.slow
def test_big_argmax_and_cumsum():
    check_lowering("argmax", _randn((512, 4096)), dim=1)
    check_lowering("cumsum", _randn((2048, 256)), dim=0, rtol=1e-4, atol=1e-3)


def _randint(lo, hi, shape, dtype=torch.int64, seed=0):
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name,shape,attrs", [("sum", (300, 70), dict(dims=(1,), keepdim=False)),
                                              ("sum", (3, 50, 7), dict(dims=(0, 2), keepdim=True)),
                                              ("sum", (3, 50, 7), dict(dims=(0, 1, 2), keepdim=False)),
                                              ("amax", (300, 70), dict(dims=(1,), keepdim=False)),
                                              ("amin", (30, 70), dict(dims=(0, 1), keepdim=False)),
                                              ("argmax", (300, 70), dict(dim=1)),
                                              ("argmin", (3, 50, 7), dict())])
def test_integer_reductions(dtype, name, shape, attrs):
    check_lowering(name, _randint(-1000, 1000, shape, dtype), **attrs)


def test_integer_any_and_cumsum():
    check_lowering("any", _randint(0, 2, (30, 70)), dims=(1,), keepdim=False)
    check_lowering("cumsum", _randint(0, 2, (4, 300)), dim=1)           # position ids from a mask
    check_lowering("cumsum", _randint(-9, 9, (3, 200, 5), torch.int32), dim=1)


def test_integer_sum_out_of_exact_range_reruns_on_host():
    from tn.lower.compiler import compile_ir
    from tn.lower.testing import build_eqn_ir
    for x in (torch.tensor([[1 << 40, 3], [5, 7]]), torch.full((2, 100000), 1000)):
        exe = compile_ir(build_eqn_ir("sum", x, dims=(1,), keepdim=False), strict=False)
        assert torch.equal(exe([x])[0], x.sum(1))
        assert sum(exe.last_profile.host_ops.values()) == 1


@pytest.mark.parametrize("name", ["sum", "amax", "prod"])
def test_empty_dims_follow_aten(name):
    check_lowering(name, _randn((3, 4)), dims=(), keepdim=False)


@pytest.mark.parametrize("shape,dim,descending,dtype", [((5, 10, 5), 1, False, torch.float32),
                                                        ((300,), 0, True, torch.float32),
                                                        ((3, 200), 1, True, torch.bfloat16)])
def test_sort(shape, dim, descending, dtype):
    check_lowering("sort", _randn(shape, dtype), dim=dim, descending=descending, stable=True)


def test_sort_ties_are_stable():
    x = torch.randint(0, 4, (7, 20), generator=torch.Generator().manual_seed(8)).float()
    check_lowering("sort", x, dim=1, descending=False, stable=True)
    check_lowering("sort", x, dim=1, descending=True, stable=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_sort_and_topk_of_integers(dtype):
    # MoE routing sorts int64 expert ids: compared in fp32 on the engines, exact below 2**24, stable on ties
    x = torch.randint(-5, 9, (3, 40), generator=torch.Generator().manual_seed(9)).to(dtype)
    check_lowering("sort", x, dim=1, descending=False, stable=True)
    check_lowering("sort", x, dim=1, descending=True, stable=True)
    distinct = torch.stack([torch.randperm(40, generator=torch.Generator().manual_seed(i)) - 20 for i in range(3)])
    check_lowering("topk", distinct.to(dtype), k=4, dim=1, largest=True, sorted=True)   # torch orders ties freely


def test_sort_of_integers_past_2_24_reruns_on_the_host():
    import tn

    x = torch.tensor([[1 << 30, 3, (1 << 24) + 1, 1 << 24, -7]], dtype=torch.int64)
    with tn.profile() as prof:
        values, indices = tn.jit(lambda t: torch.sort(t, dim=1), backend="neuron")(x)
    want_v, want_i = torch.sort(x, dim=1)
    assert torch.equal(values, want_v) and torch.equal(indices, want_i)
    assert prof.host_ops   # the range check flagged the call: recomputed on the host, counted


@pytest.mark.parametrize("shape,k,dim,largest", [((5, 10, 5), 3, 1, True), ((4, 1000), 5, 1, False),
                                                 ((130,), 130, 0, True)])
def test_topk(shape, k, dim, largest):
    check_lowering("topk", _randn(shape), k=k, dim=dim, largest=largest, sorted=True)


@pytest.mark.parametrize("shape,k,largest", [((12, 2), 1, True), ((12, 4), 2, True), ((6, 9), 2, False),
                                             ((3, 200), 3, True)])
def test_topk_unsorted_where_torch_returns_sorted(shape, k, largest):
    """sorted=False lowers where torch's CPU result is sorted anyway (k <= 2: nth_element at k - 1; 64k <= n:
    partial sort), values and indices equal to torch's: DeepSeek-V3's group and expert routers (top-1 of 2,
    top-2 of 4) ran on the host. Distinct values (torch orders ties freely, sorted or not), one NaN a row."""
    x = _randn(shape)
    x[torch.arange(shape[0]), torch.arange(shape[0]) % shape[1]] = float("nan")
    for t in (_randn(shape), x):
        check_lowering("topk", t, k=k, dim=1, largest=largest, sorted=False)
        tv, ti = torch.topk(t, k, dim=1, largest=largest, sorted=True)
        uv, ui = torch.topk(t, k, dim=1, largest=largest, sorted=False)
        assert torch.equal(ti, ui) and torch.equal(tv.nan_to_num(), uv.nan_to_num())


def test_topk_unsorted_otherwise_stays_on_the_host():
    with pytest.raises(Exception, match="sorted=False, k=4 of 8"):
        check_lowering("topk", _randn((4, 8)), k=4, dim=1, largest=True, sorted=False)


@pytest.mark.slow
def test_sort_long_line():
    check_lowering("sort", _randn((8000,)), dim=0, descending=False, stable=True)


def test_cumsum_long_axis_carries_between_blocks():
    check_lowering("cumsum", _randn((2, 1000)), dim=1, rtol=1e-4, atol=1e-4)
    check_lowering("cumsum", _randint(0, 2, (2, 1000)), dim=1)


@pytest.mark.slow
def test_cumsum_very_long_axis():
    check_lowering("cumsum", _randn((2, 10000)), dim=1, rtol=1e-4, atol=1e-3)
    check_lowering("cumsum", _randint(0, 2, (2, 10000)), dim=1)
