# Every NeuronCore rule violation raises tn.NeuronError naming the instruction, the operand and the limit.
import pytest

import tn
from tn.neuron import Program, isa
from tn.neuron.program import Tile


def prog():
    return Program("rules")


def test_too_many_partitions_on_allocation():
    with pytest.raises(tn.NeuronError, match="129 partitions; the limit is 128"):
        prog().sbuf((129, 4))


def test_partition_count_and_range_in_operand():
    p = prog()
    t = p.sbuf((128, 4))
    bad = Tile(isa.MEM_SBUF, 64, 128, t.offset, "float32", t.dims)   # partitions 64..191
    with pytest.raises(tn.NeuronError, match=r"operand 'out'.*outside the 128 partitions"):
        p.memset(bad, 0)


def test_partition_start_rule():
    p = prog()
    t = p.sbuf((128, 4))
    with pytest.raises(tn.NeuronError, match=r"tensor_tensor on VectorE: operand 'out': partition start 16 is not 0, 32"):
        p.tensor_tensor(t[16:48], t[16:48], t[16:48], "add")
    with pytest.raises(tn.NeuronError, match=r"64 partitions from start 32: at most 32"):
        p.tensor_copy(t[32:96], t[0:64])
    p.tensor_copy(t[64:128], t[0:64])   # 64 from 64 is fine
    p.dma_copy(t[3:7], t[9:13])         # DMA has no quadrant rule


def test_sbuf_and_psum_full():
    p = prog()
    p.sbuf((128, 200 * 1024 // 4))
    with pytest.raises(tn.NeuronError, match="SBUF is full.*229376 bytes per partition"):
        p.sbuf((128, 30 * 1024 // 4))
    for _ in range(8):
        p.psum((128, 512))
    with pytest.raises(tn.NeuronError, match="PSUM is full"):
        p.psum((128, 1))


def test_tile_outside_sbuf():
    p = prog()
    bad = Tile(isa.MEM_SBUF, 0, 128, 224 * 1024 - 8, "float32", [(4, 1)])
    with pytest.raises(tn.NeuronError, match=r"fall outside SBUF \(229376 bytes per partition\)"):
        p.memset(bad, 1.0)


def test_alignment_rule():
    p = prog()
    t = p.sbuf((128, 8))
    bad = Tile(isa.MEM_SBUF, 0, 128, t.offset + 2, "float32", [(4, 1)])
    with pytest.raises(tn.NeuronError, match="not aligned to the 4-byte float32 element"):
        p.memset(bad, 1.0)


def test_matmul_limits():
    p = prog()
    a = p.sbuf((128, 129), "bf16")
    b = p.sbuf((128, 600), "bf16")
    ps = p.psum((128, 512))
    big = p.psum((128, 1024))
    with pytest.raises(tn.NeuronError, match=r"matmul on TensorE: operand 'moving': moving free size N=600 exceeds 512"):
        p.matmul(ps, a[:, :128], b)
    with pytest.raises(tn.NeuronError, match=r"operand 'stationary': stationary free size M=129 exceeds 128"):
        p.matmul(ps, a, b[:, :512])
    with pytest.raises(tn.NeuronError, match=r"operand 'psum'.*cross a PSUM bank boundary"):
        p.matmul(big[:, 256:768], a[:, :128], b[:, :512])
    with pytest.raises(tn.NeuronError, match=r"operand 'moving'.*spans partitions 0..\+64.*contraction"):
        p.matmul(ps, a[:, :128], b[:64, :512])


def test_matmul_dtype_rules():
    p = prog()
    ai = p.sbuf((128, 128), "int32")
    af = p.sbuf((128, 128), "float32")
    ab = p.sbuf((128, 128), "bf16")
    ps = p.psum((128, 128))
    psb = p.psum((128, 128), "bf16")
    with pytest.raises(tn.NeuronError, match=r"operand 'stationary': dtype int32 is not a TensorE input"):
        p.matmul(ps, ai, ai)
    with pytest.raises(tn.NeuronError, match=r"operand 'moving': dtype bfloat16 differs from the stationary's float32"):
        p.matmul(ps, af, ab)
    with pytest.raises(tn.NeuronError, match=r"operand 'psum': must be float32"):
        p.matmul(psb, ab, ab)
    with pytest.raises(tn.NeuronError, match=r"operand 'stationary': is in PSUM but this instruction accepts SBUF"):
        p.matmul(ps, ps, ab)


def test_psum_bank_owned_by_live_accumulation():
    p = prog()
    a = p.sbuf((128, 128), "bf16")
    b = p.sbuf((128, 512), "bf16")
    ps = p.psum((128, 512))
    out = p.sbuf((128, 512))
    p.matmul(ps[:, :256], a, b[:, :256])                       # starts a group on bank 0, columns 0..255
    p.matmul(ps[:, 256:], a, b[:, 256:])                       # another region of the same bank: violation
    with pytest.raises(tn.NeuronError, match=r"instruction #1 matmul.*PSUM bank 0 is owned by a live accumulation "
                                             r"started by instruction #0"):
        p.build()
    q = prog()
    a = q.sbuf((128, 128), "bf16")
    b = q.sbuf((128, 512), "bf16")
    ps = q.psum((128, 512))
    out = q.sbuf((128, 512))
    q.matmul(ps[:, :256], a, b[:, :256])
    q.memset(out, 0)
    q.tensor_copy(ps[:, 256:], out[:, 256:])                          # VectorE writes into the live bank
    with pytest.raises(tn.NeuronError, match=r"instruction #2 tensor_copy.*writes PSUM bank 0, owned by the live"):
        q.build()
    r = prog()
    a = r.sbuf((128, 128), "bf16")
    b = r.sbuf((128, 512), "bf16")
    ps = r.psum((128, 512))
    out = r.sbuf((128, 512))
    r.matmul(ps[:, :256], a, b[:, :256])
    r.tensor_copy(out[:, :256], ps[:, :256])                   # reading the result ends the group
    r.matmul(ps[:, 256:], a, b[:, 256:], stop=True)
    r.matmul(ps[:, :256], a, b[:, :256])                       # stop=True closed the previous one
    r.build()


def test_engine_restrictions():
    p = prog()
    t = p.sbuf((128, 16))
    ps = p.psum((128, 16))
    h = p.hbm("h", (128, 16))
    with pytest.raises(tn.NeuronError, match=r"GpSimd cannot access PSUM"):
        p.iota(ps)
    with pytest.raises(tn.NeuronError, match=r"compute engines cannot address HBM"):
        p.tensor_copy(t, h)
    with pytest.raises(tn.NeuronError, match=r"dma_copy.*operand 'dst': is in PSUM but this instruction accepts SBUF or HBM"):
        p.dma_copy(ps, h)
    with pytest.raises(tn.NeuronError, match=r"runs on VectorE, ScalarE or GpSimd, not TensorE"):
        p.tensor_copy(t, t, engine="tensor")
    with pytest.raises(tn.NeuronError, match=r"unknown engine 'npu'"):
        p.tensor_copy(t, t, engine="npu")


def test_dtype_rules():
    p = prog()
    i64 = p.sbuf((128, 4), "int64")
    f = p.sbuf((128, 4), "float32")
    b = p.sbuf((128, 4), "bf16")
    with pytest.raises(tn.NeuronError, match=r"int64 is only allowed on DMA"):
        p.tensor_copy(f, i64)
    with pytest.raises(tn.NeuronError, match=r"operand 'src': dtype bfloat16 differs from dst's float32; DMA copies bytes"):
        p.dma_copy(f, b)
    with pytest.raises(tn.NeuronError, match=r"indices must be int32 or int64"):
        p.dma_gather(f, p.hbm("tab", (10, 4)), f[:, :1])
    with pytest.raises(tn.NeuronError, match="unsupported NeuronCore dtype"):
        p.sbuf((4, 4), "complex64")


def test_free_size_limits_and_shapes():
    p = prog()
    big = p.sbuf((1, 70000), "bf16")
    with pytest.raises(tn.NeuronError, match=r"free size 70000 exceeds the engine limit of 65536"):
        p.activation(big, big, "relu")
    t = p.sbuf((128, 600))
    st = p.sbuf((128, 3))
    with pytest.raises(tn.NeuronError, match=r"bn_stats limit of 512"):
        p.bn_stats(st, t)
    with pytest.raises(tn.NeuronError, match=r"operand 'in1': has free size 3 but 600 is required"):
        p.tensor_tensor(t, t, st, "add")
    with pytest.raises(tn.NeuronError, match=r"operand 'in1': has 64 partitions but the output has 128"):
        p.tensor_tensor(t, t, t[:64], "add")


def test_hbm_views_out_of_bounds_and_unknown_names():
    p = prog()
    h = p.hbm("h", (16, 8))
    t = p.sbuf((16, 8))
    from tn.neuron.program import HbmView

    bad = HbmView(h, 8, h.view().dims)   # shifted by 8 elements: runs past the end
    with pytest.raises(tn.NeuronError, match=r"operand 'src': elements 8..135 \(float32\) fall outside HBM buffer 0 of 512 bytes"):
        p.dma_copy(t, bad)
    with pytest.raises(tn.NeuronError, match="index 16 out of range"):
        h[16]
    with pytest.raises(tn.NeuronError, match="declared twice"):
        p.hbm("h", (1,))
    with pytest.raises(tn.NeuronError, match="cannot reshape a strided view"):
        h[:, :4].reshape(64)
    with pytest.raises(tn.NeuronError, match="unknown function 'swish'"):
        p.activation(t, t, "swish")
    with pytest.raises(tn.NeuronError, match="unknown ALU op"):
        p.tensor_tensor(t, t, t, "plus")


def test_explicit_deps_and_malformed_records():
    from tn._native import engine

    p = prog()
    t = p.sbuf((128, 4))
    i0 = p.memset(t, 1.0)
    with pytest.raises(tn.NeuronError, match="explicit dependency 5 is not an earlier instruction"):
        p.memset(t, 2.0, deps=[5])
    enc = p.build()
    rec = enc.records.copy()
    rec[0, isa.H_OPCODE] = 99
    with pytest.raises(tn.NeuronError, match="unknown opcode 99"):
        engine.check(rec[0], enc.arch.limits_vector(), [])
    rec = enc.records.copy()
    rec[0, isa.H_QUEUE] = 2  # VectorE
    rec[0, isa.H_OPCODE] = isa.OPCODES["activation"]
    with pytest.raises(tn.NeuronError, match="runs on ScalarE only"):
        engine.check(rec[0], enc.arch.limits_vector(), [])
    assert i0 == 0


def test_trn1_has_the_smaller_sbuf():
    p = Program("t1", arch="trn1")
    p.sbuf((128, 190 * 1024 // 4))
    with pytest.raises(tn.NeuronError, match="SBUF is full.*196608 bytes per partition"):
        p.sbuf((128, 4 * 1024 // 4))
    with pytest.raises(tn.NeuronError, match="unknown NeuronCore architecture 'trn9'"):
        Program("x", arch="trn9")
