# The timing model: DESIGN.md's cost formulas per engine clock, DMA fixed cost + bandwidth, queues, dependencies.
import pytest

from tn.neuron import Program, get_arch, simulate_timing
from tn.neuron.isa import cost_cycles


def one(arch, emit):
    p = Program("timing", arch=arch)
    emit(p)
    return simulate_timing(p.build(check=False))


def dur(res, i):
    s, e = res.times[i]
    return e - s


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
@pytest.mark.parametrize("N", [1, 32, 64, 100, 512, 2048])
def test_vector_scalar_gpsimd_formulas(arch, N):
    a = get_arch(arch)
    ns = {q: 1e9 / a.clock_hz[q] for q in ("act", "dve", "pool")}

    def emit(p):
        t = p.sbuf((128, N))
        u = p.sbuf((128, N))
        r = p.sbuf((128, 1))
        p.tensor_tensor(u, t, t, "add")                      # 0
        p.tensor_scalar(u, t, "multiply", 2.0)               # 1
        p.activation(u, t, "exp")                            # 2
        p.activation(u, t, "reciprocal")                     # 3
        p.tensor_copy(u, t)                                  # 4
        p.tensor_reduce(r, t, "add")                         # 5
        p.iota(u)                                            # 6
        p.memset(u, 0.0)                                     # 7
    res = one(arch, emit)
    lat = a.result_latency_cycles("dve")           # static overhead + read and write access start-up
    assert lat == 100 + 2 * 60 == a.result_latency_cycles("act") == a.result_latency_cycles("pool")
    assert dur(res, 0) == pytest.approx(cost_cycles("tensor_tensor", N, access_cycles=lat) * ns["dve"])
    assert dur(res, 0) == pytest.approx((max(64, 2 * N) + lat) * ns["dve"])
    assert dur(res, 1) == pytest.approx((max(64, N) + lat) * ns["dve"])
    table = a.act_table_switch_cycles     # exp, then reciprocal: each loads its activation table first
    assert dur(res, 2) == pytest.approx((max(64, N) + table + lat) * ns["act"])
    assert dur(res, 3) == pytest.approx((max(64, N) + table + lat) * ns["act"])   # ScalarE reciprocal: N
    assert dur(res, 4) == pytest.approx((max(64, N) + lat) * ns["dve"])
    assert dur(res, 5) == pytest.approx((max(64, N) + lat) * ns["dve"])
    assert dur(res, 6) == pytest.approx((150 + N + lat) * ns["pool"])
    assert dur(res, 7) == pytest.approx((max(64, N) + lat) * ns["pool"])


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
@pytest.mark.parametrize("dtype,M,N", [("bf16", 128, 512), ("bf16", 32, 16), ("bf16", 128, 8), ("float32", 128, 512)])
def test_matmul_formula(arch, dtype, M, N):
    a = get_arch(arch)

    def emit(p):
        s = p.sbuf((128, M), dtype)
        m = p.sbuf((128, N), dtype)
        ps = p.psum((M, N))
        p.matmul(ps, s, m)
    res = one(arch, emit)
    cyc = max(min(64, M), N) * (4 if dtype == "float32" else 1) + 2 * 60     # + PSUM write, consumer read
    assert cyc == cost_cycles("matmul", N, m=M, fp32=dtype == "float32", access_cycles=a.result_latency_cycles("pe"))
    assert dur(res, 0) == pytest.approx(cyc * 1e9 / a.clock_hz["pe"])
    assert res.matmul_flops == 2 * 128 * M * N


def test_dma_fixed_cost_plus_bandwidth_and_queues():
    a = get_arch("trn2")
    F = 2048

    def emit(p):
        h = p.hbm("h", (4, 128, F))
        ts = [p.sbuf((128, F)) for _ in range(3)]
        p.dma_copy(ts[0], h[0], queue=0)
        p.dma_copy(ts[1], h[1], queue=1)     # another queue: overlaps its fixed cost, shares the engines
        p.dma_copy(ts[2], h[2], queue=0)     # same queue: triggered after the DGE time, data in order
    res = one("trn2", emit)
    nbytes = 128 * F * 4
    # 128 partitions: 16 engines, 8 partitions (8 runs) each, at the per-engine bandwidth
    xfer = (nbytes / 16 + 8 * a.dma_chunk_overhead_bytes) / a.dma_engine_bytes_per_s * 1e9
    assert res.times[0][0] == 0 and res.times[1][0] == 0
    assert res.times[0][1] == pytest.approx(a.dma_fixed_ns + xfer)
    assert res.times[1][1] == pytest.approx(a.dma_fixed_ns + 2 * xfer)          # engines shared
    assert res.times[2][0] == pytest.approx(a.dma_issue_ns)                     # latency overlapped, not serial
    assert res.times[2][1] == pytest.approx(a.dma_fixed_ns + 3 * xfer)
    assert res.hbm_read_bytes == 3 * nbytes and res.hbm_write_bytes == 0


def test_small_dma_chunks_are_inefficient():
    def emit(p):
        h = p.hbm("h", (128, 128))
        t1 = p.sbuf((128, 128))
        t2 = p.sbuf((128, 128))
        p.dma_copy(t1, h, queue=0)        # 512 B per partition, 128 runs
        p.dma_copy(t2, h.T, queue=1)      # transposing: one run per element
    res = one("trn2", emit)
    fixed = get_arch("trn2").dma_fixed_ns          # the trigger-to-start latency both pay once
    assert dur(res, 1) - fixed > 10 * (dur(res, 0) - fixed)


def test_engines_run_in_parallel_and_dependencies_wait():
    def emit(p):
        a = p.sbuf((128, 256))
        b = p.sbuf((128, 256))
        p.memset(a, 1.0)                          # 0 GpSimd
        p.memset(b, 2.0, engine="vector")         # 1 VectorE: independent, starts at 0
        p.activation(a, b, "exp")                 # 2 ScalarE: RAW on b (1), WAW on a (0)
        p.tensor_copy(b, a)                       # 3 VectorE: RAW on a (2)
    res = one("trn2", emit)
    t = res.times
    assert t[0][0] == 0 and t[1][0] == 0
    assert t[2][0] == pytest.approx(max(t[0][1], t[1][1]))
    assert t[3][0] == pytest.approx(t[2][1])
    assert res.total_ns == pytest.approx(t[3][1])
    access = get_arch("trn2").result_latency_cycles("dve") * 1e9 / get_arch("trn2").clock_hz["dve"]
    assert res.busy_ns["VectorE"] == pytest.approx(dur(res, 1) + dur(res, 3) - 2 * access)   # busy = issue
    assert 0 < res.utilisation["ScalarE"] < 1


def test_write_after_read_waits_and_disjoint_tiles_do_not():
    def emit(p):
        h = p.hbm("h", (128, 512))
        a = p.sbuf((128, 512))
        c = p.sbuf((128, 512))
        p.memset(a, 1.0)                     # 0
        p.tensor_copy(c, a)                  # 1 reads a
        p.dma_copy(a, h)                     # 2 overwrites a: must wait for 1 (WAR)
        p.dma_copy(c[:, :1], h[:, :1])       # 3 WAW on c (1)
    res = one("trn2", emit)
    assert res.times[2][0] == pytest.approx(res.times[1][1])
    assert res.times[3][0] == pytest.approx(res.times[1][1])


def test_trn1_clock_is_faster_for_tensor_engine():
    def emit(p):
        p.matmul(p.psum((128, 512)), p.sbuf((128, 128), "bf16"), p.sbuf((128, 512), "bf16"))
    t1, t2 = one("trn1", emit).total_ns, one("trn2", emit).total_ns
    assert t1 / t2 == pytest.approx(2.4 / 2.8)


def test_run_result_report_fields():
    def emit(p):
        p.matmul(p.psum((128, 512)), p.sbuf((128, 128), "bf16"), p.sbuf((128, 512), "bf16"))
    res = one("trn2", emit)
    assert res.total_cycles == 512 + 120
    assert res.busy_cycles["TensorE"] == 512            # the issue interval; the access latency is not busy time
    assert res.tensor_utilisation == pytest.approx(512 / 632)
    assert res.sbuf_peak_bytes == 256 + 1024 and res.psum_peak_bytes == 2048
    assert res.summary()["instructions"] == 1


def test_many_dmas_fragmenting_the_pipe_stay_consistent():
    # DMAs waiting on a chain of compute instructions leave many idle gaps in the transfer pipe; later,
    # independent DMAs fill them (the pipe keeps a bounded interval list).
    def emit(p):
        h = p.hbm("h", (128, 4096))
        t = p.sbuf((128, 64))
        u = p.sbuf((128, 64))
        for i in range(700):
            p.activation(t, t, "exp")                              # serial chain on ScalarE
            p.dma_copy(u[:, i % 64:i % 64 + 1], t[:, :1], queue=i % 8)   # waits for it
        v = p.sbuf((128, 512))
        for i in range(300):                                          # independent: fill the gaps
            p.dma_copy(v[:, i % 64 * 8:(i % 64 + 1) * 8], h[:, i * 8:(i + 1) * 8], queue=8 + i % 8)
    res = one("trn2", emit)
    t = res.times
    assert (t[:, 1] >= t[:, 0]).all() and res.total_ns >= t[:, 1].max() - 1e-6
    assert t[-300:, 0].min() < t[1399, 0]        # the independent DMAs did not queue behind the chain


def test_engines_are_pipelined_access_is_latency():
    # Independent instructions of one engine issue back to back (one issue interval apart); a dependent
    # instruction waits for the whole latency (issue + access); accumulating matmuls stream through PSUM.
    a = get_arch("trn2")
    ns_pe = 1e9 / a.clock_hz["pe"]
    ns_dve = 1e9 / a.clock_hz["dve"]

    def emit(p):
        x = p.sbuf((128, 512))
        y = p.sbuf((128, 512))
        z = p.sbuf((128, 512))
        p.tensor_scalar(y, x, "multiply", 2.0, engine="vector")          # 0
        p.tensor_scalar(z, x, "multiply", 3.0, engine="vector")          # 1 independent: issues after 0's interval
        p.tensor_scalar(x, y, "add", 1.0, engine="vector")               # 2 reads y: waits for 0's result
        s = p.sbuf((128, 128), "bf16")
        m = p.sbuf((128, 512), "bf16")
        ps = p.psum((128, 512))
        p.matmul(ps, s, m)                                                # 3
        p.matmul(ps, s, m, accumulate=True, stop=True)                    # 4 accumulates: streams after 3
    res = one("trn2", emit)
    t = res.times
    assert t[1][0] == pytest.approx(512 * ns_dve)
    assert t[2][0] == pytest.approx(max(t[0][1], t[1][0] + 512 * ns_dve))
    assert t[0][1] - t[0][0] == pytest.approx((512 + 100 + 2 * 60) * ns_dve)
    assert t[4][0] == pytest.approx(t[3][0] + 512 * ns_pe)
    assert res.busy_cycles["TensorE"] == 1024


def test_same_engine_read_after_write_waits_for_the_latency():
    # One engine, in order: a read of the previous instruction's result waits for its access latency; an
    # overwrite of a tile an earlier instruction read (WAR) or wrote (WAW) only waits for the issue.
    a = get_arch("trn2")
    ns = 1e9 / a.clock_hz["act"]

    def emit(p):
        x = p.sbuf((128, 32))
        y = p.sbuf((128, 32))
        p.activation(y, x, "relu")       # 0 reads x (table-free functions: no table loads in the way)
        p.activation(y, y, "square")     # 1 reads y (RAW on 0)
        p.activation(x, y, "relu")       # 2 writes x (WAR on 0), reads y (RAW on 1)
        p.activation(y, x, "relu")       # 3 reads x (RAW on 2), writes y (WAW/WAR on 1, 2)
    res = one("trn2", emit)
    t = res.times
    assert t[1][0] == pytest.approx(t[0][1]) and t[1][0] == pytest.approx((64 + 100 + 2 * 60) * ns)
    assert t[2][0] == pytest.approx(t[1][1])
    assert t[3][0] == pytest.approx(t[2][1])


def test_same_engine_war_does_not_wait_for_the_latency():
    a = get_arch("trn2")
    ns = 1e9 / a.clock_hz["act"]

    def emit(p):
        x = p.sbuf((128, 32))
        y = p.sbuf((128, 32))
        z = p.sbuf((128, 32))
        p.activation(y, x, "relu")       # 0 reads x
        p.activation(x, z, "relu")       # 1 overwrites x (WAR on 0): issues right after 0
    res = one("trn2", emit)
    assert res.times[1][0] == pytest.approx(64 * ns)
