# One test per published cost rule of the timing model (NKI docs, see tn.neuron.arch for the source list).
"""Each test pins one rule of the timing model to the published fact it comes from.

Sources (aws-neuron/aws-neuron-sdk): [isa] the ``nki.isa`` "Estimated instruction cost" (SDK 2.25 API docs)
and the engine-selection table of ``nki/api/nki.api.shared.rst``; [arch-v2]
``nki/guides/architecture/trainium_inferentia2_arch.rst``; [arch-v3]
``nki/guides/architecture/trainium2_arch.rst``; [perf] ``nki/deep-dives/nki_perf_guide.rst``; [dma]
``nki/get-started/about/nki-dma-overview.rst``; [dma-bw] ``nki/deep-dives/nki-dma-bandwidth-guide.rst``; [dge]
``nki/deep-dives/nki-dge.rst``. Numbers the docs do not give are marked *assumption* in ``tn.neuron.arch``.
"""
import pytest

from tn.neuron import Program, get_arch, simulate_timing
from tn.neuron.isa import cost_cycles


def _timed(arch, emit):
    p = Program("rule", arch=arch)
    emit(p)
    return simulate_timing(p.build(check=False))


def _issue_cycles(arch, engine, emit):
    """Busy (issue) cycles of the one compute instruction ``emit`` puts on ``engine``."""
    res = _timed(arch, emit)
    name = {"pe": "TensorE", "act": "ScalarE", "dve": "VectorE", "pool": "GpSimd"}[engine]
    return res.busy_ns[name] * get_arch(arch).clock_hz[engine] / 1e9


# ----------------------------------------------------------------------------------------------- DMA


@pytest.mark.parametrize("arch,bytes_per_ns", [("trn1", 17.0), ("trn2", 23.0)])
def test_dma_one_engine_moves_its_bytes_at_the_per_engine_bandwidth(arch, bytes_per_ns):
    """[dma] example 1: a [4, 4096] bf16 tile lands on 4 partitions, one engine: 32 KiB in 1416 ns on trn2;
    [dma-bw] per-engine bandwidth 17 / 23 B/ns. The transfer starts dma_fixed_ns after its trigger."""
    a = get_arch(arch)

    def emit(p):
        p.dma_copy(p.sbuf((4, 4096), "bfloat16"), p.hbm("a", (4, 4096), "bfloat16"))
    res = _timed(arch, emit)
    span = res.times[0][1] - res.times[0][0] - a.dma_fixed_ns
    assert a.dma_engine_bytes_per_s == bytes_per_ns * 1e9 and a.dma_fixed_ns == 1300.0
    assert span == pytest.approx((32768 + 4 * a.dma_chunk_overhead_bytes) / bytes_per_ns)
    assert res.busy_ns["DMA0"] == pytest.approx(span)        # the queue's busy time is the transfer span


def test_dma_engines_serve_eight_partitions_each():
    """[dma]: 16 engines per core, each serving 128 / 16 = 8 partitions: a 128-partition tile uses all 16
    engines, so it takes as long as an 8-partition tile with the same bytes per partition."""
    a = get_arch("trn2")
    assert a.dma_engines == 16

    def span(parts):
        def emit(p):
            p.dma_copy(p.sbuf((parts, 2048)), p.hbm("a", (parts, 2048)))
        res = _timed("trn2", emit)
        return res.times[0][1] - res.times[0][0] - a.dma_fixed_ns
    per_engine = (8 * 2048 * 4 + 8 * a.dma_chunk_overhead_bytes) / 23.0
    assert span(8) == pytest.approx(per_engine)
    assert span(128) == pytest.approx(per_engine)
    assert span(16) == pytest.approx(span(8))                # partitions 8..15: the second engine, in parallel
    assert span(4) == pytest.approx(per_engine / 2)


def test_dma_fixed_latency_overlaps_on_a_queue():
    """[dma-bw]: ~1300 ns from semaphore to start per transfer; [dma]: the transfers of one queue run in order
    on an engine. The latency of a queued transfer overlaps the one ahead of it: n back-to-back DMAs on one
    queue end at 1300 + n x transfer, not n x (1300 + transfer). trn1 triggers cost the queue nothing."""
    a = get_arch("trn1")
    n, F = 8, 1024

    def emit(p):
        h = p.hbm("h", (n, 128, F))
        for k in range(n):
            p.dma_copy(p.sbuf((128, F)), h[k], queue=0)
    res = _timed("trn1", emit)
    xfer = (8 * F * 4 + 8 * a.dma_chunk_overhead_bytes) / 17.0
    for k in range(n):
        assert res.times[k][0] == 0.0
        assert res.times[k][1] == pytest.approx(a.dma_fixed_ns + (k + 1) * xfer)


def test_dma_trigger_on_trn2_takes_the_dge_time():
    """[arch-v3]/[dge]: each hardware-DGE DMA instruction takes ~600 ns to execute: a queue triggers one DMA
    every 600 ns."""
    a = get_arch("trn2")
    assert a.dma_issue_ns == 600.0

    def emit(p):
        h = p.hbm("h", (4, 8, 16))
        for k in range(4):
            p.dma_copy(p.sbuf((8, 16)), h[k], queue=0)
    res = _timed("trn2", emit)
    assert [res.times[k][0] for k in range(4)] == pytest.approx([0.0, 600.0, 1200.0, 1800.0])


def test_dma_queues_share_an_engine():
    """[dma]: transfers of different queues on one engine are scheduled round robin: two transfers on two
    queues to the same partitions take twice as long as one."""
    a = get_arch("trn2")

    def emit(p):
        h = p.hbm("h", (2, 8, 4096))
        p.dma_copy(p.sbuf((8, 4096)), h[0], queue=0)
        p.dma_copy(p.sbuf((8, 4096)), h[1], queue=1)
    res = _timed("trn2", emit)
    xfer = (8 * 4096 * 4 + 8 * a.dma_chunk_overhead_bytes) / 23.0
    assert max(res.times[0][1], res.times[1][1]) == pytest.approx(a.dma_fixed_ns + 2 * xfer)


#: [dma] figure "DMA Throughput varying Bytes per Partition for p_dim = 128" (nki/img/overviews/
#: nki-dma-intro-1.jpg), each point's height as a fraction of the 32 KiB point's, read off the image.
_DMA_CURVE = {256: 0.105, 512: 0.208, 1024: 0.423, 2048: 0.813, 4096: 0.964, 8192: 0.983, 16384: 0.990}


def _stream_throughput(arch, bytes_per_partition, n=16, queues=1):
    """Steady-state bytes/ns of ``n`` back-to-back [128, bytes_per_partition] HBM -> SBUF DMAs spread over
    ``queues`` queues: the bytes of the transfers after the first ``queues`` over the time from their ends to
    the last end."""
    F = bytes_per_partition // 4

    def emit(p):
        h = p.hbm("h", (n, 128, F))
        ts = [p.sbuf((128, F)) for _ in range(queues)]     # one tile per queue: no cross-queue waits
        for k in range(n):
            p.dma_copy(ts[k % queues], h[k], queue=k % queues)
    res = _timed(arch, emit)
    ends = sorted(res.times[k][1] for k in range(n))
    return (n - queues) * 128 * bytes_per_partition / (ends[-1] - ends[queues - 1])


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
def test_dma_stream_follows_the_published_throughput_curve(arch):
    """[dma] figure: one stream of [128, b] DMAs moves bytes in proportion to b up to 1 KiB per partition (a
    fixed time per transfer), 81 % of the plateau at 2 KiB, 96 % at 4 KiB; [dma-bw]: "< 256 B severely
    overhead-bound ... >= 4 KiB fully amortizes", the same thresholds on Trn1-Trn3. The model's per-transfer
    minimum (``dma_transfer_min_partition_bytes``) and per-descriptor overhead reproduce every point."""
    peak = _stream_throughput(arch, 32768, n=4)
    for b, frac in _DMA_CURVE.items():
        assert _stream_throughput(arch, b) / peak == pytest.approx(frac, rel=0.06, abs=0.005), b


def test_dma_transfer_minimum_is_per_queue():
    """*Assumption* (arch.dma_transfer_min_partition_bytes): the per-transfer minimum holds a queue, not the
    engine: [dma] "DMA transfers within a queue on the same DMA engine are executed in order", queues share
    an engine round robin. Small DMAs spread over two queues move twice the bytes of one queue's stream."""
    a = get_arch("trn1")
    one = _stream_throughput("trn1", 512)
    assert one == pytest.approx(512 * 8 / a.dma_transfer_min_ns * 16)    # 16 engines, one transfer per minimum
    assert _stream_throughput("trn1", 512, queues=2) == pytest.approx(2 * one, rel=0.02)


def test_dma_is_also_bounded_by_the_cores_hbm_bandwidth():
    """HBM: trn2 2.9 TB/s per chip, 8 cores: 362.5 GB/s per core, below the 16 engines' 368 GB/s: many
    large transfers on all queues cannot move HBM bytes faster than that."""
    a = get_arch("trn2")
    F = 2048

    def emit(p):
        h = p.hbm("h", (16, 128, F))
        for k in range(16):
            p.dma_copy(p.sbuf((128, F)), h[k], queue=k)
    res = _timed("trn2", emit)
    assert res.total_ns >= a.dma_fixed_ns + 16 * 128 * F * 4 / a.hbm_bytes_per_s * 1e9 - 1e-6


# ----------------------------------------------------------------------------------------------- latency


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
def test_dependent_scalar_instructions_start_every_284_cycles(arch):
    """[perf] opt #5a: back-to-back dependent 1-element ScalarE instructions start every ~264 cycles on NC-v2.
    tn: MIN_II (64, [isa]) + the static instruction overhead (~100, [perf]/[arch-v2]) + the SBUF access
    start-up of the producer's write and the consumer's read (2 x ~60, [arch-v2] "Tensor access overhead")."""
    a = get_arch(arch)

    def emit(p):
        x, y = p.sbuf((128, 1)), p.sbuf((128, 1))
        for i in range(6):
            src, dst = (x, y) if i % 2 == 0 else (y, x)
            p.activation(dst, src, "identity", scale=1.5, bias=0.25)
    res = _timed(arch, emit)
    interval = (res.times[5][0] - res.times[1][0]) / 4 * a.clock_hz["act"] / 1e9
    assert interval == pytest.approx(64 + 100 + 2 * 60)


def test_vector_static_overhead_applies_to_dependent_instructions_only():
    """[arch-v2] VectorE cost model: add a static overhead of 100 cycles when each instruction depends on the
    previous one; independent instructions issue one issue interval apart ([isa] max(MIN_II, N))."""
    a = get_arch("trn1")
    N = 256

    def emit(dependent):
        def body(p):
            x, y, z = p.sbuf((128, N)), p.sbuf((128, N)), p.sbuf((128, N))
            p.tensor_scalar(y, x, "add", 1.0)                       # 0
            p.tensor_scalar(z, y if dependent else x, "add", 2.0)   # 1 reads 0's result, or not
        return body
    cyc = 1e9 / a.clock_hz["dve"]
    assert _timed("trn1", emit(False)).times[1][0] == pytest.approx(N * cyc)
    assert _timed("trn1", emit(True)).times[1][0] == pytest.approx((N + 100 + 2 * 60) * cyc)


# ----------------------------------------------------------------------------------------------- VectorE


@pytest.mark.parametrize("dtype,op,expect", [("bfloat16", "add", 512), ("bfloat16", "max", 512),
                                             ("bfloat16", "min", 1024), ("float32", "add", 1024)])
def test_tensor_reduce_bf16_add_max_at_half_cost(dtype, op, expect):
    """[isa] tensor_reduce: N/2 cycles for bf16 add/max, else N (MIN_II 64)."""
    def emit(p):
        p.tensor_reduce(p.sbuf((128, 1), dtype), p.sbuf((128, 1024), dtype), op)
    assert _issue_cycles("trn1", "dve", emit) == pytest.approx(expect)
    assert cost_cycles("tensor_reduce", 1024, dtype=dtype, alu=op) == expect


@pytest.mark.parametrize("case,expect", [("bf16 add", 512), ("bf16 divide", 1024), ("fp32 add", 1024),
                                         ("fp32 psum", 512), ("bf16 strided", 1024)])
def test_tensor_tensor_one_or_two_passes(case, expect):
    """[isa] tensor_tensor: max(MIN_II, N) with an input in PSUM or for bf16 add/subtract/multiply on contiguous
    SBUF operands, else max(MIN_II, 2N) (trn1: no performance mode)."""
    dt = "bfloat16" if case.startswith("bf16") else "float32"
    op = "divide" if "divide" in case else "add"

    def emit(p):
        a = p.psum((128, 512)) if "psum" in case else p.sbuf((128, 512), dt)
        b = p.sbuf((128, 1024), dt)[:, ::2] if "strided" in case else p.sbuf((128, 512), dt)
        p.tensor_tensor(p.sbuf((128, 512), dt), a, b, op)
    # a bf16 stride of 2 elements (4 B) is under the 16-byte stride limit: no bandwidth penalty, but not contiguous
    assert _issue_cycles("trn1", "dve", emit) == pytest.approx(expect)


def test_bn_stats_and_bn_aggr_costs():
    """[isa] bn_stats max(MIN_II, N); bn_aggr max(MIN_II, 13N/3)."""
    def stats(p):
        p.bn_stats(p.sbuf((128, 3)), p.sbuf((128, 512)))

    def aggr(p):
        p.bn_aggr(p.sbuf((128, 2)), p.sbuf((128, 3 * 16)))
    assert _issue_cycles("trn1", "dve", stats) == pytest.approx(512)
    assert _issue_cycles("trn1", "dve", aggr) == pytest.approx(13 * 48 / 3)


@pytest.mark.parametrize("dtype,value,expect", [("bfloat16", 0.0, 512), ("float16", 0.0, 512),
                                                ("bfloat16", 1.0, 1024), ("float32", 0.0, 1024)])
def test_memset_zero_fill_of_16_bit_at_half_cost(dtype, value, expect):
    """[isa] memset: N/2 for a zero fill in bf16/fp16, else N."""
    def emit(p):
        p.memset(p.sbuf((128, 1024), dtype), value, engine="vector")
    assert _issue_cycles("trn1", "dve", emit) == pytest.approx(expect)


def test_iota_and_affine_select_cost_150_plus_n():
    """[isa] iota 150 + N; affine_select ~150 + N."""
    def iota(p):
        p.iota(p.sbuf((128, 300)))

    def mask(p):
        p.affine_select(p.sbuf((128, 300)), p.sbuf((128, 300)), pattern=[-1], channel_multiplier=1,
                        cmp="is_ge", fill=0.0)
    assert _issue_cycles("trn1", "pool", iota) == pytest.approx(450)
    assert _issue_cycles("trn1", "pool", mask) == pytest.approx(450)


@pytest.mark.parametrize("case,factor", [("copy contiguous", 4), ("copy strided", 2), ("scalar contiguous", 4),
                                         ("copy psum", 2), ("copy fp32", 1), ("tensor_tensor", 2)])
def test_trn2_vector_performance_modes(case, factor):
    """[arch-v3] Vector Engine Performance Mode: tensor_copy/tensor_scalar 4x with bf16/fp16 SBUF operands of
    contiguous innermost dims, 2x when not contiguous or with one operand in PSUM; tensor_tensor 2x with both
    inputs in SBUF and every operand bf16/fp16. trn1 (NeuronCore-v2) has none."""
    N = 2048
    dt = "float32" if "fp32" in case else "bfloat16"

    def emit(p):
        out = p.sbuf((128, N), dt)
        if case == "tensor_tensor":
            p.tensor_tensor(out, p.sbuf((128, N), dt), p.sbuf((128, N), dt), "divide")   # 2N, halved
            return
        src = p.psum((128, N // 4), dt) if "psum" in case else (
            p.sbuf((128, 2 * N), dt)[:, ::2] if "strided" in case else p.sbuf((128, N), dt))
        if "psum" in case:
            out = p.sbuf((128, N // 4), dt)
        if case.startswith("scalar"):
            p.tensor_scalar(out, src, "multiply", 2.0)
        else:
            p.tensor_copy(out, src)
    n = N // 4 if "psum" in case else N
    base = 2 * n if case == "tensor_tensor" else n
    assert _issue_cycles("trn1", "dve", emit) == pytest.approx(base)
    assert _issue_cycles("trn2", "dve", emit) == pytest.approx(max(64, base / factor))


def test_scalar_reciprocal_at_n_and_fused_reduce_adds_min_ii():
    """[isa] engine selection: reciprocal on ScalarE max(MIN_II, N) (VectorE's is 8N); activation with a fused
    reduce + MIN_II."""
    a = get_arch("trn1")

    def emit(p):
        x = p.sbuf((128, 512))
        p.activation(p.sbuf((128, 512)), x, "reciprocal")
        p.activation(p.sbuf((128, 512)), x, "reciprocal", reduce_op="add", reduce_out=p.sbuf((128, 1)))
    assert _issue_cycles("trn1", "act", emit) == pytest.approx(2 * 512 + 64 + a.act_table_switch_cycles)


# ----------------------------------------------------------------------------------------------- TensorE


@pytest.mark.parametrize("M,N,expect", [(128, 512, 512), (128, 8, 64), (32, 8, 32), (128, 1, 64)])
def test_matmul_fast_load_stationary(M, N, expect):
    """[isa] nc_matmul max(min(64, M), N) ([arch-v2] fast LoadStationary: a wide stationary with a narrow
    moving costs MIN_II, not M)."""
    def emit(p):
        p.matmul(p.psum((M, N)), p.sbuf((128, M), "bfloat16"), p.sbuf((128, N), "bfloat16"))
    assert _issue_cycles("trn1", "pe", emit) == pytest.approx(expect)


@pytest.mark.parametrize("arch,factor", [("trn1", 4), ("trn2", 2)])
def test_fp32_transpose_mode_on_trn2(arch, factor):
    """[isa] nc_transpose on TensorE max(P, min(64, F)), fp32 4x; [arch-v3] transpose mode: fp32 2x faster."""
    def emit(p):
        p.transpose(p.psum((128, 128)), p.sbuf((128, 128)))
    assert _issue_cycles(arch, "pe", emit) == pytest.approx(128 * factor)


def test_strided_operands_run_at_half_bandwidth():
    """[arch-v2] Access pattern: an innermost stride over 16 bytes halves an SBUF/PSUM interface's bandwidth."""
    def emit(p):
        p.tensor_scalar(p.sbuf((128, 512)), p.sbuf((128, 512 * 8))[:, ::8], "multiply", 2.0)   # 32 B stride
    assert _issue_cycles("trn1", "dve", emit) == pytest.approx(2 * 512)


@pytest.mark.parametrize("arch,shared", [("trn1", True), ("trn2", False)])
def test_nc_v2_vector_and_gpsimd_share_sbuf_scalar_and_vector_share_psum(arch, shared):
    """[arch-v2] Concurrent SBUF/PSUM accesses: on NeuronCore-v2 VectorE and GpSimd cannot access SBUF in
    parallel, VectorE and ScalarE cannot access PSUM in parallel; [arch-v3]: lifted on NeuronCore-v3."""
    a = get_arch(arch)
    assert a.shared_ports == shared

    def sbuf_pair(p):
        p.tensor_scalar(p.sbuf((128, 1024)), p.sbuf((128, 1024)), "add", 1.0)             # VectorE
        p.tensor_scalar(p.sbuf((128, 1024)), p.sbuf((128, 1024)), "add", 1.0, engine="gpsimd")

    def psum_pair(p):
        p.tensor_copy(p.sbuf((128, 512)), p.psum((128, 512)))                              # VectorE
        p.activation(p.sbuf((128, 512)), p.psum((128, 512)), "relu")                       # ScalarE

    def scalar_and_gpsimd(p):                                                              # never shared
        p.activation(p.sbuf((128, 512)), p.sbuf((128, 512)), "relu")
        p.tensor_scalar(p.sbuf((128, 512)), p.sbuf((128, 512)), "add", 1.0, engine="gpsimd")
    res = _timed(arch, sbuf_pair)
    assert res.times[1][0] == pytest.approx(1024 * 1e9 / a.clock_hz["dve"] if shared else 0.0)
    res = _timed(arch, psum_pair)
    assert res.times[1][0] == pytest.approx(512 * 1e9 / a.clock_hz["dve"] if shared else 0.0)
    assert _timed(arch, scalar_and_gpsimd).times[1][0] == 0.0


def test_shared_sbuf_port_never_overlaps_across_many_instructions():
    """The port's busy list stays bounded (its oldest intervals fold) without letting VectorE and GpSimd SBUF
    instructions overlap: a long mix of dependent and independent instructions on trn1."""
    a = get_arch("trn1")
    N = 128

    def emit(p):
        x = [p.sbuf((128, N)) for _ in range(8)]
        for i in range(1500):
            eng = "vector" if i % 3 else "gpsimd"
            src = x[i % 8] if i % 5 else x[(i + 3) % 8]
            p.tensor_scalar(x[(i + 1) % 8], src, "add", 1.0, engine=eng)
    res = _timed("trn1", emit)
    spans = []
    for i, (s, _) in enumerate(res.times):
        clock = a.clock_hz["dve" if i % 3 else "pool"]
        spans.append((s, s + N * 1e9 / clock))
    spans.sort()
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert s1 >= e0 - 1e-6


def test_every_partition_is_charged_to_an_engine_for_any_engine_count():
    """An architecture whose engine count does not divide the partitions: engine e serves ceil(P / E)
    partitions, the last one the remainder; no partition's bytes are left out."""
    import dataclasses

    a = dataclasses.replace(get_arch("trn2"), dma_engines=3)

    def emit(p):
        p.dma_copy(p.sbuf((128, 2048)), p.hbm("a", (128, 2048)))
    res = _timed(a, emit)
    span = res.times[0][1] - res.times[0][0] - a.dma_fixed_ns
    assert span == pytest.approx(43 * (2048 * 4 + a.dma_chunk_overhead_bytes) / 23.0)
