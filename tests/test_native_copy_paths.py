# The native engine's byte-copy kernel (tn_copy_bytes / copy_ap_part in _native/kernels.c) through DMA programs:
# random pairs of differently shaped and strided access patterns (permuted, sliced, stride-0 broadcast sources) of
# 1-, 2-, 4- and 8-byte elements, compared with numpy; plus overlapping source and destination (element order).
import numpy as np
import pytest

from tn.neuron import Program

DTYPES = [("uint8", np.uint8), ("float16", np.float16), ("float32", np.float32), ("int32", np.int32),
          ("int64", np.int64)]


def _values(rng, shape, npdt):
    """Random distinct-ish values of the dtype (bit patterns for floats survive the copy unchanged)."""
    n = int(np.prod(shape))
    bits = rng.integers(0, 2 ** 63, n, dtype=np.int64).view(np.uint64)
    size = np.dtype(npdt).itemsize
    raw = bits.astype(np.dtype(f"u{size}")) if size < 8 else bits
    return raw.view(npdt).reshape(shape)


def _random_src(rng, P, shape_free):
    """A source view recipe over an HBM tensor: (tensor shape, slices, permutation of free axes, broadcast axes)."""
    full = [P] + [int(n) + int(rng.integers(0, 3)) for n in shape_free]
    starts = [0] + [int(rng.integers(0, f - n + 1)) for f, n in zip(full[1:], shape_free)]
    return full, starts


def _case(rng, dt, npdt):
    """One random dma_copy HBM -> HBM between two access patterns of the same partition count and free size."""
    P = int(rng.integers(1, 5))
    nf = int(rng.integers(1, 4))                       # free axes of the source view
    sfree = [int(rng.choice([1, 2, 3, 4, 7, 8, 16])) for _ in range(nf)]
    bcast = [k for k in range(nf) if rng.random() < 0.25]
    for k in bcast:
        sfree[k] = int(rng.choice([2, 3, 5]))
    full, starts = _random_src(rng, P, sfree)
    for k in bcast:                                    # the tensor holds one element along a broadcast axis
        full[k + 1] = 1
        starts[k + 1] = 0
    perm = [0] + [1 + int(i) for i in rng.permutation(nf)]
    a = _values(rng, tuple(full), npdt)
    # destination: an output tensor whose free size is split into 1-3 axes, viewed through a permutation
    F = int(np.prod(sfree))
    dshape = [F]
    if rng.random() < 0.7:
        divs = [d for d in range(1, F + 1) if F % d == 0]
        d0 = int(rng.choice(divs))
        dshape = [d0, F // d0]
        if rng.random() < 0.5:
            divs = [d for d in range(1, dshape[1] + 1) if dshape[1] % d == 0]
            d1 = int(rng.choice(divs))
            dshape = [d0, d1, dshape[1] // d1]
    dperm = [0] + [1 + int(i) for i in rng.permutation(len(dshape))]
    oshape = tuple([P] + [dshape[i - 1] for i in dperm[1:]])   # stored so that the permuted view has dshape

    prog = Program("copy_paths")
    A = prog.hbm("a", tuple(full), dt)
    O = prog.hbm("o", oshape, dt, kind="output")
    sv = A[tuple([slice(None)] + [slice(s, s + (1 if k in bcast else n))
                                  for k, (s, n) in enumerate(zip(starts[1:], sfree))])]
    if bcast:
        sv = sv.broadcast_to(tuple([P] + sfree))
    sv = sv.permute(*perm)
    inv = [0] * len(dperm)
    for i, d in enumerate(dperm):
        inv[d] = i
    dv = O.permute(*inv)
    assert tuple(dv.shape) == tuple([P] + dshape)
    prog.dma_copy(dv, sv)
    res = prog.run({"a": a})

    src = a[tuple([slice(None)] + [slice(s, s + (1 if k in bcast else n))
                                   for k, (s, n) in enumerate(zip(starts[1:], sfree))])]
    src = np.broadcast_to(src, tuple([P] + sfree)).transpose(perm).reshape(P, -1)
    idx = np.arange(int(np.prod(oshape))).reshape(oshape).transpose(inv).reshape(P, -1)
    want = np.zeros(int(np.prod(oshape)), dtype=npdt)
    want[idx] = src
    got = res.outputs["o"]
    np.testing.assert_array_equal(got.reshape(-1).view(f"u{np.dtype(npdt).itemsize}"),
                                  want.view(f"u{np.dtype(npdt).itemsize}"))


@pytest.mark.parametrize("dt,npdt", DTYPES)
def test_random_pattern_pairs_copy_like_numpy(dt, npdt):
    rng = np.random.default_rng(abs(hash(dt)) % 1000)
    for _ in range(60):
        _case(rng, dt, npdt)


def test_run_crosses_dims_of_both_patterns():
    # source [2, 3, 8] rows of 8 split across a destination whose rows are 4 and 6 long, plus a transposed source
    for dt, npdt in DTYPES:
        a = np.arange(2 * 3 * 8).astype(npdt).reshape(2, 3, 8)
        prog = Program("cross")
        A = prog.hbm("a", (2, 3, 8), dt)
        O1 = prog.hbm("o1", (2, 6, 4), dt, kind="output")
        O2 = prog.hbm("o2", (2, 4, 6), dt, kind="output")
        O3 = prog.hbm("o3", (2, 8, 3), dt, kind="output")
        prog.dma_copy(O1, A)
        prog.dma_copy(O2, A)
        prog.dma_copy(O3, A.permute(0, 2, 1))
        res = prog.run({"a": a})
        np.testing.assert_array_equal(res.outputs["o1"], a.reshape(2, 6, 4))
        np.testing.assert_array_equal(res.outputs["o2"], a.reshape(2, 4, 6))
        np.testing.assert_array_equal(res.outputs["o3"], a.transpose(0, 2, 1))


def test_broadcast_source_rows():
    a = np.arange(3 * 5, dtype=np.float32).reshape(3, 1, 5)
    prog = Program("bcast")
    A = prog.hbm("a", (3, 1, 5), "float32")
    O = prog.hbm("o", (3, 20), "float32", kind="output")
    prog.dma_copy(O, A.view().broadcast_to((3, 4, 5)))
    np.testing.assert_array_equal(prog.run({"a": a}).outputs["o"], np.broadcast_to(a, (3, 4, 5)).reshape(3, 20))


def test_overlapping_copy_keeps_its_order():
    # a contiguous same-shape row moves like memmove; a shifted differently shaped copy goes element by element
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    prog = Program("overlap_rows")
    A = prog.hbm("a", (4, 6), "float32", kind="inout")
    prog.dma_copy(A[:, 1:], A[:, :5])
    want = a.copy()
    want[:, 1:] = a[:, :5]
    np.testing.assert_array_equal(prog.run({"a": a}).outputs["a"], want)

    # a shifted copy from a transposed view of the same row: element by element in the two row-major orders
    b = np.arange(2 * 12, dtype=np.int32).reshape(2, 12)
    prog = Program("overlap_strided")
    B = prog.hbm("b", (2, 12), "int32", kind="inout")
    prog.dma_copy(B[:, 1:7], B[:, 0:6].reshape(2, 3, 2).permute(0, 2, 1))
    want = b.copy()
    src_order = [j + 2 * i for j in range(2) for i in range(3)]
    for p in range(2):
        for e, s in enumerate(src_order):
            want[p, 1 + e] = want[p, s]
    np.testing.assert_array_equal(prog.run({"b": b}).outputs["b"], want)
