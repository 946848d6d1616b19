# Tests of the shape and creation lowerings (tn/lower/shape.py) against torch, through check_lowering.
import pytest
import torch

pytest.importorskip("tn.lower.testing")
from tn.lower.testing import check_lowering  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.bool]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(dtype)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape(dtype):
    check_lowering("reshape", _rand((3, 5, 7), dtype), shape=(15, 7))


def test_reshape_big():
    check_lowering("reshape", _rand((300, 129), torch.float32), shape=(129, 300))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(1, 0, 2), (2, 0, 1), (2, 1, 0)])
def test_permute(dtype, dims):
    check_lowering("permute", _rand((3, 130, 7), dtype), dims=dims)


def test_permute_rank6():
    check_lowering("permute", _rand((2, 3, 4, 5, 6, 7), torch.float32), dims=(5, 3, 1, 0, 2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_expand(dtype):
    check_lowering("expand", _rand((5, 1), dtype), shape=(3, 5, 7))
    check_lowering("expand", _rand((1, 7), dtype), shape=(200, 7))


def test_expand_scalar():
    check_lowering("expand", torch.tensor(3.5), shape=(4, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_slice(dtype):
    x = _rand((3, 131, 7), dtype)
    check_lowering("slice", x, dim=1, start=1, end=130, step=3)
    check_lowering("slice", x, dim=2, start=2, end=7, step=1)


@pytest.mark.parametrize("step", [1, 2])
def test_slice_scatter(step):
    x = _rand((3, 9, 7), torch.float32)
    n = len(range(1, 8, step))
    check_lowering("slice_scatter", x, _rand((3, n, 7), torch.float32, 1), dim=1, start=1, end=8, step=step)
    check_lowering("slice_scatter", x, _rand((3, 9, 2), torch.float32, 1), dim=2, start=0, end=2, step=1)


def test_cat():
    check_lowering("cat", _rand((3, 5, 7), torch.float32), _rand((3, 2, 7), torch.float32, 1),
                   _rand((3, 1, 7), torch.float32, 2), dim=1)
    check_lowering("cat", _rand((200, 3), torch.bfloat16), _rand((100, 3), torch.bfloat16, 1), dim=0)


@pytest.mark.parametrize("pad,value", [((1, 2), 0.0), ((1, 2, -1, 3), 1.5), ((0, 0, 2, 0), -2.0)])
def test_pad(pad, value):
    check_lowering("pad", _rand((3, 5, 7), torch.float32), pad=pad, value=value)


def test_pad_int64():
    check_lowering("pad", _rand((130, 3), torch.int64), pad=(2, 1, 1, 1), value=-7)


@pytest.mark.parametrize("dims", [(0,), (2,), (0, 2)])
def test_flip(dims):
    check_lowering("flip", _rand((3, 5, 7), torch.float32), dims=dims)


def test_as_strided():
    x = _rand((3, 5, 7), torch.float32)
    check_lowering("as_strided", x, size=(4, 3), stride=(2, 5), offset=3)
    check_lowering("as_strided", x, size=(4, 3, 2), stride=(0, 1, 7), offset=0)


def test_as_strided_scatter():
    check_lowering("as_strided_scatter", _rand((3, 5, 7), torch.float32), _rand((4, 3), torch.float32, 1),
                   size=(4, 3), stride=(7, 1), offset=3)


@pytest.mark.parametrize("dtype,value", [(torch.float32, 2.5), (torch.bfloat16, -1.25), (torch.int32, 7),
                                         (torch.int64, -5), (torch.int64, 1 << 40), (torch.bool, True)])
def test_full(dtype, value):
    check_lowering("full", shape=(300, 7), value=value, dtype=dtype)
    check_lowering("full", shape=(), value=value, dtype=dtype)


@pytest.mark.parametrize("dtype,start,step,length", [(torch.int64, 0, 1, 1000), (torch.int64, -3, 2, 77),
                                                     (torch.int32, 5, -1, 300), (torch.float32, 0.5, 0.25, 300)])
def test_iota(dtype, start, step, length):
    check_lowering("iota", length=length, start=start, step=step, dtype=dtype)


@pytest.mark.parametrize("shape,dims,dtype", [((300, 200), (1, 0), torch.float32),
                                              ((1, 130, 3, 64), (0, 2, 3, 1), torch.bfloat16),
                                              ((3, 130, 17), (0, 2, 1), torch.float16)])
def test_permute_transpose_on_tensore(shape, dims, dtype):
    res = check_lowering("permute", _rand(shape, dtype), dims=dims)
    assert res.counts.get("TensorE", 0) > 0  # the inner axis moved: 128x128 transposes, not element DMAs


@pytest.mark.parametrize("xshape,shape,dtype", [((300, 1), (300, 64), torch.float32),
                                                ((5, 1), (3, 5, 700), torch.bfloat16),
                                                ((1,), (1000,), torch.float32),
                                                ((2, 1, 3, 1), (2, 4, 3, 16), torch.float32),
                                                ((7, 1), (7, 9), torch.bool), ((7, 1), (7, 9), torch.int64)])
def test_expand_inner_axis(xshape, shape, dtype):
    check_lowering("expand", _rand(xshape, dtype), shape=shape)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_big_weight_transpose(dtype):
    res = check_lowering("permute", _rand((2304, 768), dtype), dims=(1, 0))
    assert res.counts.get("TensorE", 0) > 0


@pytest.mark.slow
def test_big_cat_pad_slice():
    x = _rand((1024, 1024), torch.float32)
    check_lowering("cat", x, _rand((1024, 512), torch.float32, 1), dim=1)
    check_lowering("pad", x, pad=(3, 5, 2, 0), value=0.5)
    check_lowering("slice", x, dim=0, start=1, end=1000, step=3)


def test_cat_promotes_dtypes():
    check_lowering("cat", _rand((3, 5), torch.float32), _rand((3, 2), torch.int32, 1),
                   _rand((3, 4), torch.bfloat16, 2), dim=1)
    check_lowering("cat", _rand((300, 2), torch.bool), _rand((200, 2), torch.float16, 1), dim=0)


@pytest.mark.slow
def test_copy_beyond_one_dma():
    # more elements than one DMA axis holds: 1M-element rows on the partition axis, not element runs
    x = torch.randint(0, 256, ((1 << 24) + 1000,), dtype=torch.uint8)
    res = check_lowering("reshape", x, shape=(1, (1 << 24) + 1000))
    assert res.total_us < 1000
