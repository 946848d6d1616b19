# Helpers shared by the NeuronCore test suites (run one instruction on tiles from numpy), and their own checks.
import numpy as np

from tn.neuron import Program, from_bf16, to_bf16

TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=1e-2, atol=1e-2),
       "float16": dict(rtol=1e-3, atol=1e-3)}


def to_device(a, dtype):
    """numpy values -> the host representation of a NeuronCore dtype (bf16 as uint16 bits)."""
    if dtype == "bfloat16":
        return to_bf16(a)
    return np.ascontiguousarray(np.asarray(a).astype({"float32": np.float32, "float16": np.float16,
                                                      "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
                                                      "bool": np.bool_}[dtype]))


def from_device(a, dtype):
    """Host representation -> float64 numpy values."""
    if dtype == "bfloat16":
        return from_bf16(a).astype(np.float64)
    return np.asarray(a).astype(np.float64)


def round_to(a, dtype):
    """Round float values as storing them in `dtype` would."""
    return from_device(to_device(np.asarray(a, dtype=np.float64), dtype), dtype)


def run_op(emit, inputs, outputs, arch=None):
    """Build a program: DMA every input (name -> (array, dtype)) into an SBUF tile of its shape, call
    emit(prog, tiles) which emits instructions (and may allocate more tiles), DMA outputs (name -> (shape, dtype))
    back, run it. Returns ({name: float64 array}, RunResult)."""
    prog = Program("op_test", arch=arch)
    tiles = {}
    for name, (arr, dt) in inputs.items():
        h = prog.hbm(name, arr.shape, dt)
        t = prog.sbuf(arr.shape, dt, name=name)
        prog.dma_copy(t, h)
        tiles[name] = t
    for name, (shape, dt) in outputs.items():
        tiles[name] = prog.sbuf(shape, dt, name=name)
    emit(prog, tiles)
    for name, (shape, dt) in outputs.items():
        h = prog.hbm(name, shape, dt, kind="output")
        prog.dma_copy(h, tiles[name])
    res = prog.run({n: to_device(a, dt) for n, (a, dt) in inputs.items()})
    return {n: from_device(res.outputs[n], dt) for n, (_, dt) in outputs.items()}, res


def test_bf16_round_trip_helpers_round_to_nearest_even():
    import torch

    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    ref_bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bf16(x), ref_bits)  # bit patterns (integers): RNE must match torch exactly
