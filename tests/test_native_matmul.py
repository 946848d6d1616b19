# Tests of the TensorE matmul tile kernel (_native/matmul.c) through the cffi module, against numpy/torch.
import numpy as np
import pytest
import torch

from tn._native._kernels import ffi, lib

RNG = np.random.default_rng(1234)

# Every code path of the kernel this machine can run ("auto" first); the others are skipped.
ISAS = ["auto", "generic", "avx2", "avx512", "amx"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Forces one code path of the kernel for a test, then restores the one in force before (TN_MATMUL_ISA's)."""
    before = lib.tn_matmul_isa()
    if lib.tn_matmul_set_isa(request.param.encode()) != 0:
        pytest.skip(f"this CPU/OS has no {request.param} path (hardware)")
    yield request.param
    assert lib.tn_matmul_set_isa(before) == 0


def _ptr(ctype, arr):
    """cffi pointer to a numpy array's first element."""
    return ffi.cast(ctype, arr.ctypes.data)


def _padded(rows, cols, pad, dtype):
    """A (rows, cols + pad) buffer and its (rows, cols) view: the view has a row stride wider than the row."""
    buf = np.zeros((rows, cols + pad), dtype=dtype)
    return buf, buf[:, :cols]


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 array -> bf16 bit patterns (uint16), rounded to nearest even by torch."""
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> fp32 (exact)."""
    return (b.astype(np.uint32) << 16).view(np.float32)


def _run_f32(stat, mov, psum, K, M, N, acc):
    return lib.tn_matmul_f32(_ptr("float *", stat), stat.strides[0] // 4, _ptr("float *", mov), mov.strides[0] // 4,
                             _ptr("float *", psum), psum.strides[0] // 4, K, M, N, acc)


def _run_bf16(stat, mov, psum, K, M, N, acc):
    return lib.tn_matmul_bf16(_ptr("uint16_t *", stat), stat.strides[0] // 2, _ptr("uint16_t *", mov),
                              mov.strides[0] // 2, _ptr("float *", psum), psum.strides[0] // 4, K, M, N, acc)


SHAPES = [(1, 1, 1), (1, 128, 512), (128, 1, 1), (128, 128, 512), (127, 127, 511), (3, 5, 7),
          (64, 96, 200), (128, 17, 33), (13, 128, 15), (128, 128, 1), (7, 6, 16), (100, 7, 97)]


@pytest.mark.parametrize("K,M,N", SHAPES)
@pytest.mark.parametrize("pad", [0, 5])
def test_f32_overwrite_and_accumulate(K, M, N, pad, isa):
    _, stat = _padded(K, M, pad, np.float32)
    _, mov = _padded(K, N, pad + 3, np.float32)
    stat[:] = RNG.standard_normal((K, M))
    mov[:] = RNG.standard_normal((K, N))
    pbuf, psum = _padded(M, N, pad + 11, np.float32)
    pbuf[:] = 7.0  # overwrite must ignore this; padding must stay untouched
    assert _run_f32(stat, mov, psum, K, M, N, 0) == 0
    want = (torch.from_numpy(stat.copy()).double().T @ torch.from_numpy(mov.copy()).double()).numpy()
    np.testing.assert_allclose(psum, want, rtol=1e-5, atol=1e-4)
    assert np.all(pbuf[:, N:] == 7.0)
    assert _run_f32(stat, mov, psum, K, M, N, 1) == 0
    np.testing.assert_allclose(psum, 2 * want, rtol=1e-5, atol=2e-4)
    assert np.all(pbuf[:, N:] == 7.0)


@pytest.mark.parametrize("K,M,N", SHAPES)
def test_bf16_matches_torch(K, M, N, isa):
    _, stat = _padded(K, M, 9, np.uint16)
    _, mov = _padded(K, N, 1, np.uint16)
    stat[:] = _to_bf16_bits(RNG.standard_normal((K, M)).astype(np.float32))
    mov[:] = _to_bf16_bits(RNG.standard_normal((K, N)).astype(np.float32))
    psum = np.full((M, N), 3.0, np.float32)
    init = RNG.standard_normal((M, N)).astype(np.float32)
    assert _run_bf16(stat, mov, psum, K, M, N, 0) == 0
    # inputs are exact in fp32, so the fp32 product of the widened values is the reference
    a = torch.from_numpy(_bf16_bits_to_f32(np.ascontiguousarray(stat)))
    b = torch.from_numpy(_bf16_bits_to_f32(np.ascontiguousarray(mov)))
    want = (a.double().T @ b.double()).numpy()
    np.testing.assert_allclose(psum, want, rtol=1e-5, atol=1e-4)
    # and it agrees with torch's own bf16 matmul to bf16 precision
    tb = (a.bfloat16().T @ b.bfloat16()).float().numpy()
    np.testing.assert_allclose(psum, tb, rtol=2e-2, atol=2e-2 * np.sqrt(K))
    psum[:] = init
    assert _run_bf16(stat, mov, psum, K, M, N, 1) == 0
    np.testing.assert_allclose(psum, want + init, rtol=1e-5, atol=1e-4)


def test_accumulate_over_k_chunks_equals_one_big_k(isa):
    K, M, N = 512, 128, 512
    a = RNG.standard_normal((K, M)).astype(np.float32)
    b = RNG.standard_normal((K, N)).astype(np.float32)
    psum = np.empty((M, N), np.float32)
    for i in range(0, K, 128):
        assert _run_f32(a[i:i + 128], b[i:i + 128], psum, 128, M, N, int(i > 0)) == 0
    np.testing.assert_allclose(psum, a.astype(np.float64).T @ b, rtol=1e-4, atol=1e-3)


def test_partition_pitch_strides(isa):
    """Operands laid out as in SBUF/PSUM: rows a partition pitch apart (57344 floats = 224 KiB)."""
    pitch = 57344
    K, M, N = 128, 128, 512
    sbuf = np.zeros((K, pitch), np.float32)
    pbank = np.zeros((M, 4096), np.float32)
    sbuf[:, 1000:1000 + M] = RNG.standard_normal((K, M))
    sbuf[:, 9000:9000 + N] = RNG.standard_normal((K, N))
    stat, mov, psum = sbuf[:, 1000:1000 + M], sbuf[:, 9000:9000 + N], pbank[:, 2048:2048 + N]
    assert _run_f32(stat, mov, psum, K, M, N, 0) == 0
    np.testing.assert_allclose(psum, stat.astype(np.float64).T @ mov, rtol=1e-5, atol=1e-4)
    assert not pbank[:, :2048].any() and not pbank[:, 2048 + N:].any()


def test_bf16_partition_pitch_strides(isa):
    """bf16 operands in a 224 KiB partition pitch (114688 bf16), psum a 16 KiB pitch, accumulating over K."""
    pitch = 114688
    K, M, N = 128, 128, 512
    sbuf = np.zeros((K, pitch), np.uint16)
    sbuf[:, 64:64 + M] = _to_bf16_bits(RNG.standard_normal((K, M)).astype(np.float32))
    sbuf[:, 4000:4000 + N] = _to_bf16_bits(RNG.standard_normal((K, N)).astype(np.float32))
    stat, mov = sbuf[:, 64:64 + M], sbuf[:, 4000:4000 + N]
    pbank = np.zeros((M, 4096), np.float32)
    psum = pbank[:, 512:512 + N]
    want = _bf16_bits_to_f32(np.ascontiguousarray(stat)).astype(np.float64).T @ _bf16_bits_to_f32(
        np.ascontiguousarray(mov))
    assert _run_bf16(stat, mov, psum, K, M, N, 0) == 0
    assert _run_bf16(stat, mov, psum, K, M, N, 1) == 0
    np.testing.assert_allclose(psum, 2 * want, rtol=1e-5, atol=2e-4)
    assert not pbank[:, :512].any() and not pbank[:, 512 + N:].any()


def test_isa_names():
    before = lib.tn_matmul_isa()
    assert ffi.string(before).decode() in ("amx", "avx512", "avx2", "generic")
    assert lib.tn_matmul_set_isa(b"no-such-isa") == -1
    assert lib.tn_matmul_set_isa(ffi.NULL) == -1
    assert lib.tn_matmul_set_isa(b"generic") == 0
    assert ffi.string(lib.tn_matmul_isa()) == b"generic"
    assert lib.tn_matmul_set_isa(b"auto") == 0
    assert lib.tn_matmul_set_isa(before) == 0


@pytest.mark.parametrize("K,M,N", [(0, 1, 1), (1, 0, 1), (1, 1, 0), (129, 1, 1), (1, 129, 1), (1, 1, 513),
                                   (-1, 4, 4), (4, -3, 4), (4, 4, -512)])
def test_bad_dims_return_minus_one_and_touch_nothing(K, M, N):
    stat = np.ones((4, 256), np.float32)
    mov = np.ones((4, 1024), np.float32)
    psum = np.full((4, 1024), 5.0, np.float32)
    s16 = np.ones((4, 256), np.uint16)
    m16 = np.ones((4, 1024), np.uint16)
    assert lib.tn_matmul_f32(_ptr("float *", stat), 256, _ptr("float *", mov), 1024, _ptr("float *", psum), 1024,
                             K, M, N, 0) == -1
    assert lib.tn_matmul_bf16(_ptr("uint16_t *", s16), 256, _ptr("uint16_t *", m16), 1024, _ptr("float *", psum),
                              1024, K, M, N, 0) == -1
    assert np.all(psum == 5.0)


@pytest.mark.parametrize("which", ["stat", "mov", "psum"])
def test_strides_narrower_than_a_row_are_rejected(which):
    stat = np.ones((8, 8), np.float32)
    mov = np.ones((8, 8), np.float32)
    psum = np.full((8, 8), 5.0, np.float32)
    strides = {"stat": 8, "mov": 8, "psum": 8}
    strides[which] = 7
    assert lib.tn_matmul_f32(_ptr("float *", stat), strides["stat"], _ptr("float *", mov), strides["mov"],
                             _ptr("float *", psum), strides["psum"], 8, 8, 8, 0) == -1
    assert np.all(psum == 5.0)


def test_null_pointers_are_rejected():
    psum = np.zeros((4, 4), np.float32)
    assert lib.tn_matmul_f32(ffi.NULL, 4, ffi.NULL, 4, _ptr("float *", psum), 4, 4, 4, 4, 0) == -1
    assert lib.tn_matmul_bf16(ffi.NULL, 4, ffi.NULL, 4, ffi.NULL, 4, 4, 4, 4, 0) == -1


def test_threads_use_their_own_scratch(isa):
    """Tiles from several threads at once (cffi releases the GIL) give the same results as one thread."""
    import threading

    K, M, N = 128, 128, 512
    jobs = []
    for i in range(4):
        a = RNG.standard_normal((K, M)).astype(np.float32)
        b = RNG.standard_normal((K, N)).astype(np.float32)
        jobs.append((a, b, _to_bf16_bits(a), _to_bf16_bits(b), np.empty((M, N), np.float32),
                     np.empty((M, N), np.float32)))
    errors = []

    def work(job):
        a, b, a16, b16, out32, out16 = job
        for _ in range(5):
            if _run_f32(a, b, out32, K, M, N, 0) != 0 or _run_bf16(a16, b16, out16, K, M, N, 0) != 0:
                errors.append("rc")

    threads = [threading.Thread(target=work, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for a, b, a16, b16, out32, out16 in jobs:
        np.testing.assert_allclose(out32, a.astype(np.float64).T @ b, rtol=1e-5, atol=1e-4)
        want16 = _bf16_bits_to_f32(a16).astype(np.float64).T @ _bf16_bits_to_f32(b16)
        np.testing.assert_allclose(out16, want16, rtol=1e-5, atol=1e-4)


def test_random_shapes_stay_inside_their_buffers(isa):
    """Random dims and strides, operands and PSUM embedded in guarded buffers: results right, guards untouched."""
    rng = np.random.default_rng(99)
    for _ in range(12):
        K, M, N = int(rng.integers(1, 129)), int(rng.integers(1, 129)), int(rng.integers(1, 513))
        ss, ms, ps = M + int(rng.integers(0, 40)), N + int(rng.integers(0, 40)), N + int(rng.integers(0, 40))
        acc = int(rng.integers(0, 2))
        guard = 64
        sbuf = np.full(guard * 2 + K * ss, 9.0, np.float32)
        mbuf = np.full(guard * 2 + K * ms, 9.0, np.float32)
        pbuf = np.full(guard * 2 + M * ps, 7.0, np.float32)
        stat = sbuf[guard:guard + K * ss].reshape(K, ss)[:, :M]
        mov = mbuf[guard:guard + K * ms].reshape(K, ms)[:, :N]
        psum = pbuf[guard:guard + M * ps].reshape(M, ps)[:, :N]
        stat[:] = rng.standard_normal((K, M))
        mov[:] = rng.standard_normal((K, N))
        before = psum.copy()
        assert _run_f32(stat, mov, psum, K, M, N, acc) == 0
        want = stat.astype(np.float64).T @ mov + (before if acc else 0)
        np.testing.assert_allclose(psum, want, rtol=1e-5, atol=1e-4)
        rest = pbuf.copy()
        rest[guard:guard + M * ps].reshape(M, ps)[:, :N] = 7.0
        assert np.all(rest == 7.0), "kernel wrote outside psum[M, N]"
        # the same through the bf16 entry point, on bf16 copies of the operands
        s16 = np.full(guard * 2 + K * ss, 0x4110, np.uint16)
        m16 = np.full(guard * 2 + K * ms, 0x4110, np.uint16)
        st16 = s16[guard:guard + K * ss].reshape(K, ss)[:, :M]
        mv16 = m16[guard:guard + K * ms].reshape(K, ms)[:, :N]
        st16[:] = _to_bf16_bits(np.ascontiguousarray(stat))
        mv16[:] = _to_bf16_bits(np.ascontiguousarray(mov))
        pbuf[:] = 7.0
        assert _run_bf16(st16, mv16, psum, K, M, N, 0) == 0
        want16 = _bf16_bits_to_f32(np.ascontiguousarray(st16)).astype(np.float64).T @ _bf16_bits_to_f32(
            np.ascontiguousarray(mv16))
        np.testing.assert_allclose(psum, want16, rtol=1e-5, atol=1e-4)
        rest = pbuf.copy()
        rest[guard:guard + M * ps].reshape(M, ps)[:, :N] = 7.0
        assert np.all(rest == 7.0), "bf16 kernel wrote outside psum[M, N]"


def test_special_values_propagate(isa):
    K, M, N = 4, 3, 20
    a = np.ones((K, M), np.float32)
    b = np.ones((K, N), np.float32)
    b[2, 5] = np.inf
    b[1, 7] = np.nan
    psum = np.zeros((M, N), np.float32)
    assert _run_f32(a, b, psum, K, M, N, 0) == 0
    assert np.all(np.isinf(psum[:, 5])) and np.all(np.isnan(psum[:, 7]))
    np.testing.assert_allclose(psum[:, 0], 4.0, rtol=1e-6)
