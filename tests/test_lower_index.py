# Tests of the index lowerings (tn/lower/index.py): gathers/embedding by indirect DMA, index_put and scatters.
import pytest
import torch

pytest.importorskip("tn.lower.testing")
from tn.lower.testing import check_lowering  # noqa: E402

G = torch.Generator().manual_seed(0)


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G).to(dtype)


def _randint(lo, hi, shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=G).to(dtype)


@pytest.mark.parametrize("xshape,ishape,dim", [((5, 7), (5, 3), 1), ((300, 7), (200, 7), 0),
                                               ((300, 10), (300, 1), 1), ((3, 4, 5), (2, 3, 5), 1)])
@pytest.mark.parametrize("idtype", [torch.int64, torch.int32])
def test_gather(xshape, ishape, dim, idtype):
    check_lowering("gather", _randn(*xshape), _randint(0, xshape[dim], ishape, idtype), dim=dim)


def test_gather_bf16_int64_table():
    check_lowering("gather", _randn(6, 9, dtype=torch.bfloat16), _randint(0, 9, (6, 4)), dim=1)
    check_lowering("gather", _randint(-50, 50, (6, 9)), _randint(0, 9, (6, 4)), dim=1)


def test_gather_out_of_range_raises():
    from tn.errors import TnError
    with pytest.raises(TnError):
        check_lowering("gather", _randn(5, 7), torch.tensor([[7]]), dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_embedding_lookup(dtype):
    table = _randn(1000, 64).to(dtype) if dtype.is_floating_point else _randint(-9, 9, (1000, 64))
    check_lowering("index", table, _randint(0, 1000, (2, 77)), dims=(0,))


def test_index_negative_indices_wrap():
    check_lowering("index", _randn(1000, 16), _randint(-1000, 1000, (300,)), dims=(0,))
    check_lowering("index", _randn(5, 9, 4), _randint(-9, 9, (6,), torch.int32), dims=(1,))


def test_index_multi():
    x = _randn(5, 9, 4)
    check_lowering("index", x, _randint(0, 5, (6,)), _randint(0, 9, (6,)), dims=(0, 1))
    check_lowering("index", x, _randint(0, 5, (3, 1)), _randint(0, 4, (6,)), dims=(0, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_put_accumulate_embedding_grad(dtype):
    check_lowering("index_put", _randn(1000, 64, dtype=dtype), _randn(300, 64, dtype=dtype),
                   _randint(0, 1000, (300,)), dims=(0,), accumulate=True)


def test_index_put_replace_unique():
    idx = torch.randperm(100, generator=G)[:30] - 50  # negative indices wrap
    check_lowering("index_put", _randn(100, 16), _randn(30, 16), idx, dims=(0,), accumulate=False)


def test_index_put_replace_duplicates_last_wins():
    from tn.lower.compiler import compile_ir
    from tn.lower.testing import assert_close, build_eqn_ir
    x, v, i = _randn(10, 3), _randn(200, 3), _randint(0, 10, (200,))
    exe = compile_ir(build_eqn_ir("index_put", x, v, i, dims=(0,), accumulate=False), strict=True)
    want = x.clone()
    for e in range(200):
        want[i[e]] = v[e]
    assert_close(exe([x, v, i])[0], want)


def test_index_put_multi_and_broadcast():
    x = _randn(5, 9, 4)
    i0, i1 = _randint(0, 5, (6,)), _randint(0, 9, (6,))
    check_lowering("index_put", x, _randn(6, 4), i0, i1, dims=(0, 1), accumulate=True)
    check_lowering("index_put", x, _randn(1), i0, i1, dims=(0, 1), accumulate=False)
    check_lowering("index_put", x, _randn(5, 6, 4), _randint(0, 9, (6,)), dims=(1,), accumulate=True)


def test_index_put_out_of_range_raises():
    from tn.errors import TnError
    with pytest.raises(TnError):
        check_lowering("index_put", _randn(10, 4), _randn(1, 4), torch.tensor([10]), dims=(0,), accumulate=True)


def _unique_idx(rows, n, m):
    return torch.stack([torch.randperm(n, generator=G)[:m] for _ in range(rows)])


@pytest.mark.parametrize("xshape,ishape,dim", [((5, 7), (5, 3), 1), ((130, 7), (100, 7), 0),
                                               ((3, 4, 5), (2, 3, 5), 1)])
def test_scatter_add(xshape, ishape, dim):
    src = _randn(*ishape)
    check_lowering("scatter_add", _randn(*xshape), _randint(0, xshape[dim], ishape), src, dim=dim)


def test_scatter_unique_and_scalar():
    check_lowering("scatter", _randn(5, 7), _unique_idx(5, 7, 3), _randn(5, 3), dim=1)
    check_lowering("scatter", _randn(200, 10), _unique_idx(200, 10, 1), 1.0, dim=1)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    check_lowering("scatter_reduce", _randn(5, 7), _randint(0, 7, (5, 9)), _randn(5, 9), dim=1, reduce=reduce,
                   include_self=include_self)


def test_scatter_add_bf16():
    check_lowering("scatter_add", _randn(5, 7, dtype=torch.bfloat16), _randint(0, 7, (5, 3)),
                   _randn(5, 3, dtype=torch.bfloat16), dim=1)


def test_scatter_out_of_range_raises():
    from tn.errors import TnError
    with pytest.raises(TnError):
        check_lowering("scatter_add", _randn(5, 7), torch.tensor([[7]]), _randn(1, 1), dim=1)


@pytest.mark.parametrize("xshape,vshape,mshape,accumulate", [((5, 5), (5,), (5,), False), ((5, 5), (1,), (5, 5), False),
                                                             ((300, 7), (), (300, 7), True),
                                                             ((3, 4, 6), (6,), (3, 4), True)])
def test_index_put_boolean_mask(xshape, vshape, mshape, accumulate):
    mask = torch.rand(mshape, generator=G) > 0.5
    vals = torch.randn(vshape, generator=G)
    check_lowering("index_put", _randn(*xshape), vals, mask, dims=(0,), accumulate=accumulate)


def test_index_put_boolean_mask_int32():
    mask = torch.rand(3, 4, generator=G) > 0.5
    check_lowering("index_put", _randint(0, 9, (3, 4), torch.int32), torch.tensor(7, dtype=torch.int32), mask,
                   dims=(0,), accumulate=False)


@pytest.mark.slow
def test_big_embedding_and_grad():
    table = _randn(50257, 768)
    idx = _randint(0, 50257, (4, 128))
    check_lowering("index", table, idx, dims=(0,))
    check_lowering("index_put", _randn(8192, 256), _randn(512, 256), _randint(0, 8192, (512,)), dims=(0,),
                   accumulate=True, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_lm_loss_gather_on_a_large_table():
    # 512 x 50257 logits: row numbers are relative to each tile, so tables beyond 2**24 elements work
    check_lowering("gather", _randn(512, 50257), _randint(0, 50257, (512, 1)), dim=1)


def test_index_put_int64_replace():
    # with the indirect-write DMA (dma_scatter) any dtype can be replaced; without it this falls back
    from tn.neuron import Program
    if not hasattr(Program, "dma_scatter"):
        pytest.skip("needs Program.dma_scatter")
    check_lowering("index_put", _randint(-9, 9, (100, 3)), _randint(-9, 9, (30, 3)),
                   torch.randperm(100, generator=G)[:30], dims=(0,), accumulate=False)


def test_scatter_int64_by_dma():
    from tn.neuron import Program
    if not hasattr(Program, "dma_scatter"):
        pytest.skip("needs Program.dma_scatter")
    check_lowering("scatter", _randint(-9, 9, (5, 7)), _unique_idx(5, 7, 3), _randint(-9, 9, (5, 3)), dim=1)
    check_lowering("scatter", _randint(-9, 9, (5, 7), torch.int32), _unique_idx(5, 7, 3), 4, dim=1)
