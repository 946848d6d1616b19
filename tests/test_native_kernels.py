# The C kernels' dtype conversions through cffi: bf16 and fp16 round to nearest even like torch/numpy, specials kept.
import numpy as np
import torch

from tn._native import _kernels

ffi, lib = _kernels.ffi, _kernels.lib


def f32_to(fn, x):
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.shape, np.uint16)
    fn(ffi.from_buffer("float[]", x), ffi.from_buffer("uint16_t[]", out), x.size)
    return out


def to_f32(fn, bits):
    bits = np.ascontiguousarray(bits, np.uint16)
    out = np.empty(bits.shape, np.float32)
    fn(ffi.from_buffer("uint16_t[]", bits), ffi.from_buffer("float[]", out), bits.size)
    return out


def specials():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(5000) * 10.0 ** rng.integers(-8, 8, 5000),
        [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.0, 65520.0, 1e-8, 6e-8, 5.96e-8, 2.0 ** -24, 2.0 ** -25,
         3 * 2.0 ** -26, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 3.4e38, -3.4e38, 1e-40],
    ]).astype(np.float32)
    return x


def test_bf16_conversion_matches_torch_bits():
    x = specials()
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(f32_to(lib.tn_cvt_f32_to_bf16, x), ref)   # integer bit patterns


def test_bf16_nan_stays_nan_and_widening_is_exact():
    bits = f32_to(lib.tn_cvt_f32_to_bf16, np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(to_f32(lib.tn_cvt_bf16_to_f32, bits)).all()
    all_bits = np.arange(65536, dtype=np.uint16)
    wide = to_f32(lib.tn_cvt_bf16_to_f32, all_bits)
    np.testing.assert_array_equal(wide.view(np.uint32), all_bits.astype(np.uint32) << 16)


def test_fp16_conversion_matches_numpy_bits():
    x = specials()
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(f32_to(lib.tn_cvt_f32_to_f16, x), ref)


def test_fp16_widening_of_every_value():
    all_bits = np.arange(65536, dtype=np.uint16)
    got = to_f32(lib.tn_cvt_f16_to_f32, all_bits)
    ref = all_bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
