# Fuzzing the native engine: random and mutated encoded instruction streams give a result or tn.NeuronError, never a crash.
import numpy as np
import pytest

import tn
from tn._native import engine
from tn.neuron import Program, get_arch, isa

ARCH = get_arch("trn2")


def kitchen_sink():
    """A valid program using every instruction once or more (small tiles)."""
    p = Program("sink", record_sources=False)
    h = p.hbm("h", (64, 32), "float32")
    hb = p.hbm("hb", (64, 32), "bf16")
    ids = p.hbm("ids", (16, 1), "int32")
    o = p.hbm("o", (64, 32), "float32", kind="output")
    a = p.sbuf((64, 32), "float32")
    b = p.sbuf((64, 32), "bf16")
    c = p.sbuf((64, 32), "float32")
    r = p.sbuf((64, 1), "float32")
    it = p.sbuf((16, 1), "int32")
    g = p.sbuf((16, 32), "float32")
    ps = p.psum((32, 32))
    pt = p.psum((32, 64))
    st = p.sbuf((64, 3), "float32")
    mv = p.sbuf((64, 2), "float32")
    p.dma_copy(a, h)
    p.dma_copy(b, hb)
    p.dma_copy(it, ids)
    p.dma_gather(g, h, it)
    p.matmul(ps, b[:, :32], b, accumulate=False)
    p.tensor_copy(c[:32], ps)
    p.transpose(pt, a[:, :32])
    p.activation(c, a, "gelu_tanh", scale=0.5, bias=r, reduce_op="add", reduce_out=r)
    p.tensor_tensor(c, a, c, "multiply")
    p.tensor_scalar(c, c, "add", 1.0, "max", r, reverse0=True)
    p.tensor_reduce(r, c, "max")
    p.select(c, a, c, a)
    p.bn_stats(st, a)
    p.bn_aggr(mv, st)
    p.iota(c, base=1, channel_multiplier=2, pattern=[3])
    p.affine_select(c, a, cmp="is_gt", channel_multiplier=1, pattern=[-1], fill=-5.0)
    p.memset(a[:32], 2.0)
    p.partition_reduce(c[:32], a, "add")
    p.partition_shuffle(c, a, list(range(63, -1, -1)))
    p.dma_copy(o, c)
    p.dma_scatter(o, g, it, accumulate=True)
    return p.build()


def bindings(rng):
    return [rng.standard_normal((64, 32)).astype(np.float32),
            rng.integers(0, 2 ** 16, (64, 32)).astype(np.uint16),
            rng.integers(0, 64, (16, 1)).astype(np.int32),
            np.zeros((64, 32), np.float32)]


_MEM = {}


def run_raw(recs, deps, aux, bufs):
    n = recs.shape[0]
    if not _MEM:  # reused across runs: garbage from earlier runs is fine for fuzzing
        _MEM["sbuf"] = np.zeros((128, ARCH.sbuf_partition_bytes), np.uint8)
        _MEM["psum"] = np.zeros((128, ARCH.psum_partition_bytes), np.uint8)
    sbuf, psum = _MEM["sbuf"], _MEM["psum"]
    ptrs = np.array([b.ctypes.data for b in bufs], np.int64)
    sizes = np.array([b.nbytes for b in bufs], np.int64)
    nq = ARCH.num_queues
    return engine.run(np.ascontiguousarray(recs), np.ascontiguousarray(deps), np.ascontiguousarray(aux), sbuf, psum,
                      ptrs, sizes, ARCH.limits_vector(), ARCH.timing_vector(), np.zeros((max(n, 1), 2)),
                      np.zeros(nq), np.zeros(nq, np.int64), np.zeros(2, np.int64), 1)


SPECIAL = [0, 1, -1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 63, 64, 96, 127, 128, 129, 255, 511, 512, 513, 2047, 2048,
           65535, 65536, 229375, 229376, 2 ** 24, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 62, 2 ** 63 - 1, -2 ** 63]


def mutate(rng, enc):
    recs = enc.records.copy()
    deps = enc.deps.copy()
    aux = enc.aux.copy()
    for _ in range(rng.integers(1, 4)):
        kind = rng.random()
        i = rng.integers(0, recs.shape[0])
        f = rng.integers(0, isa.REC_WIDTH)
        if kind < 0.4:
            recs[i, f] = SPECIAL[rng.integers(0, len(SPECIAL))]
        elif kind < 0.7:
            recs[i, f] += rng.integers(-3, 4)
        elif kind < 0.8:
            recs[i, f] = rng.integers(-2 ** 63, 2 ** 63 - 1, dtype=np.int64)
        elif kind < 0.9 and len(deps):
            deps[rng.integers(0, len(deps))] = rng.integers(-2, recs.shape[0] + 2)
        elif len(aux):
            aux[rng.integers(0, len(aux))] = rng.integers(-2, 130)
    return recs, deps, aux


def random_records(rng, n):
    recs = np.zeros((n, isa.REC_WIDTH), np.int64)
    for i in range(n):
        recs[i, 0] = rng.integers(0, 20)
        recs[i, 1] = rng.integers(0, 21)
        recs[i, 2] = rng.integers(0, 20)
        recs[i, 3] = rng.integers(0, 16)
        imm = rng.integers(-4, 8, size=8).astype(np.float64)
        recs[i, 8:16] = imm.view(np.int64)
        for k in range(5):
            b = 16 + 16 * k
            if rng.random() < 0.3 and k > 0:
                continue
            recs[i, b] = rng.integers(0, 4)
            recs[i, b + 1] = rng.integers(0, 4)
            recs[i, b + 2] = rng.integers(0, 7)
            recs[i, b + 3] = rng.choice([0, 0, 32, 64, 96, 5])
            recs[i, b + 4] = rng.choice([1, 16, 32, 64, 128])
            recs[i, b + 5] = rng.integers(0, 64)
            recs[i, b + 6] = rng.choice([0, 4, 64, 2048, 229000])
            for d in range(4):
                recs[i, b + 8 + 2 * d] = rng.choice([1, 1, 2, 3, 32, 512])
                recs[i, b + 9 + 2 * d] = rng.choice([0, 1, 1, 2, -1, 32])
    return recs


def check_outcome(fn):
    try:
        fn()
    except tn.NeuronError as e:
        assert str(e)
        return "error"
    return "ok"


def fuzz(seed, rounds):
    rng = np.random.default_rng(seed)
    enc = kitchen_sink()
    bufs = bindings(rng)
    # the unmutated program runs
    assert run_raw(enc.records, enc.deps, enc.aux, bufs) > 0
    outcomes = {"ok": 0, "error": 0}
    for r in range(rounds):
        bufs = bindings(rng)
        if r % 3 == 2:
            recs = random_records(rng, int(rng.integers(1, 8)))
            deps = rng.integers(-1, 8, size=int(rng.integers(0, 4))).astype(np.int64)
            aux = rng.integers(-1, 130, size=int(rng.integers(0, 130))).astype(np.int64)
        else:
            recs, deps, aux = mutate(rng, enc)
        outcomes[check_outcome(lambda: run_raw(recs, deps, aux, bufs))] += 1
        # the single-record validator must never crash either
        check_outcome(lambda: engine.check(recs[0], ARCH.limits_vector(), [b.nbytes for b in bufs], aux))
    return outcomes


def test_fuzz_streams_never_crash():
    out = fuzz(0, 1500)
    assert out["ok"] > 20 and out["error"] > 100, out


def test_malformed_shapes_of_arrays_are_errors():
    enc = kitchen_sink()
    with pytest.raises(tn.NeuronError, match="fields per record"):
        run_raw(enc.records[:, :50].copy(), enc.deps, enc.aux, bindings(np.random.default_rng(0)))
    with pytest.raises(tn.NeuronError, match="does not exist"):
        run_raw(enc.records, enc.deps, enc.aux, bindings(np.random.default_rng(0))[:2])


@pytest.mark.slow
def test_fuzz_streams_never_crash_long():
    for seed in range(1, 40):
        fuzz(seed, 1000)


@pytest.mark.parametrize("field,value,match", [
    (isa.OPERAND_BASE + isa.O_PSTART, 2 ** 63 - 1, "fall outside the 128 partitions"),
    (isa.H_DEP_START, 2 ** 63 - 1, "dependency range"),
    (isa.H_AUX_START, 2 ** 63 - 1, "aux range"),
])
def test_huge_fields_do_not_wrap_int64(field, value, match):
    # start + count used to overflow int64 and pass the range checks (found by the fuzz test under ASan)
    enc = kitchen_sink()
    recs = enc.records.copy()
    k = int(np.nonzero(recs[:, isa.H_OPCODE] == isa.OPCODES["partition_shuffle"])[0][0])
    recs[k, field] = value
    if field == isa.H_DEP_START:
        recs[k, isa.H_DEP_COUNT] = 1
    with pytest.raises(tn.NeuronError, match=match):
        run_raw(recs, enc.deps, enc.aux, bindings(np.random.default_rng(0)))
