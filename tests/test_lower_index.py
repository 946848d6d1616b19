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
