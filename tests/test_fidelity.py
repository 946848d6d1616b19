# Fidelity of the timing model: bounds no modelled program may break (HBM bandwidth, dependencies).
import pytest
import torch

import tn
from tn.neuron import Program, get_arch, simulate_timing


def _timed(arch, emit):
    p = Program("fidelity", arch=arch)
    emit(p)
    return simulate_timing(p.build(check=False))


def _assert_within_hbm_bandwidth(res):
    moved = res.hbm_read_bytes + res.hbm_write_bytes
    floor_ns = moved / res.arch.hbm_bytes_per_s * 1e9
    assert moved > 0
    assert res.total_ns >= floor_ns * (1 - 1e-9), (
        f"{res.name}: {moved} HBM bytes in {res.total_ns:.0f} ns is faster than the bandwidth allows "
        f"({floor_ns:.0f} ns); HBM utilisation {res.hbm_utilisation:.2f}")
    assert res.hbm_utilisation <= 1.0 + 1e-9


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
@pytest.mark.parametrize("queues", [1, 4, 16])
def test_hbm_to_hbm_copy_is_charged_for_both_sides(arch, queues):
    rows, cols = 512, 2048

    def emit(p):
        src = p.hbm("src", (rows, cols))
        dst = p.hbm("dst", (2 * rows, cols), kind="output")
        step = rows // queues if queues > 1 else rows
        for k in range(2 * rows // step):        # torch.cat([src, src]) as HBM -> HBM copies
            lo = (k * step) % rows
            p.dma_copy(dst[k * step:(k + 1) * step], src[lo:lo + step], queue=k % queues)
    res = _timed(arch, emit)
    assert res.hbm_read_bytes == res.hbm_write_bytes == 2 * rows * cols * 4
    _assert_within_hbm_bandwidth(res)


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
def test_hbm_sbuf_round_trips_stay_under_the_bandwidth(arch):
    F = 2048

    def emit(p):
        h = p.hbm("h", (8, 128, F))
        o = p.hbm("o", (8, 128, F), kind="output")
        for k in range(8):
            t = p.sbuf((128, F))
            p.dma_copy(t, h[k], queue=k)
            p.dma_copy(o[k], t, queue=8 + k)
    _assert_within_hbm_bandwidth(_timed(arch, emit))


def test_cat_through_jit_stays_under_the_bandwidth():
    x = torch.randn(512, 512)
    f = tn.jit(lambda a: torch.cat([a, a]))
    with tn.profile() as prof:
        y = f(x)
    torch.testing.assert_close(y, torch.cat([x, x]))
    assert prof.runs
    for res in prof.runs:
        if res.hbm_read_bytes + res.hbm_write_bytes:
            _assert_within_hbm_bandwidth(res)


@pytest.mark.parametrize("between", [10, 300, 1000])
def test_read_long_after_a_write_on_another_engine_waits_for_it(between):
    """The dependency tracker bounds its per-region lists; a read many instructions after a write on another
    engine must still start after the write ends."""
    def emit(p):
        h = p.hbm("h", (128, 16))
        a = p.sbuf((128, 16))                       # bytes 0..63 of each partition
        slots = p.sbuf((128, 1000))                 # same 4 KiB region of SBUF, disjoint from a
        p.dma_copy(a, h)                            # 0: the write (slow: DMA fixed cost)
        for k in range(between):                    # distinct writes on GpSimd crowd the region's list
            p.memset(slots[:, k % 1000:k % 1000 + 1], float(k))
        out = p.sbuf((128, 16))
        p.activation(out, a, "exp")                 # the read, on ScalarE
    res = _timed("trn2", emit)
    write_end = res.times[0][1]
    read_start = res.times[-1][0]
    assert read_start >= write_end


def _issue_ns(res, i):
    """Issue interval of instruction i: until the next instruction of the same queue may start (busy time)."""
    s, e = res.times[i]
    return e - s


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
@pytest.mark.parametrize("N", [1, 8, 63])
def test_tensor_reduce_has_the_64_cycle_minimum(arch, N):
    a = get_arch(arch)

    def emit(p):
        t = p.sbuf((128, N))
        r = p.sbuf((128, 1))
        p.tensor_reduce(r, t, "add")
    res = _timed(arch, emit)
    assert res.busy_ns["VectorE"] == pytest.approx(64 / a.clock_hz["dve"] * 1e9)


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
def test_scalar_engine_pays_for_activation_table_switches(arch):
    a = get_arch(arch)
    ns = 1e9 / a.clock_hz["act"]

    def run(funcs):
        def emit(p):
            t = p.sbuf((128, 512))
            u = p.sbuf((128, 512))
            for f in funcs:
                p.activation(u, t, f)
        return _timed(arch, emit).busy_ns["ScalarE"]
    same = run(["exp"] * 4)
    alternating = run(["exp", "tanh", "exp", "tanh"])
    with_free = run(["exp", "identity", "relu", "exp"])      # table-free functions keep the loaded table
    assert same == pytest.approx((4 * 512 + a.act_table_switch_cycles) * ns)
    assert alternating == pytest.approx((4 * 512 + 4 * a.act_table_switch_cycles) * ns)
    assert with_free == pytest.approx(same)


@pytest.mark.parametrize("arch,generation", [("trn1", "NeuronCore-v2"), ("trn2", "NeuronCore-v3")])
def test_profile_table_names_the_modelled_arch(arch, generation):
    x = torch.randn(64, 64)
    with tn.config.override(arch=arch):
        f = tn.jit(lambda a: a * 2 + 1)
        with tn.profile() as prof:
            f(x)
    assert prof.runs and all(r.arch.name == arch for r in prof.runs)
    assert f"modelled on {arch} ({generation})" in prof.table(print_it=False)
    assert f"modelled on {arch} ({generation})" in prof.table(print_it=False, by="opcode")


def test_trn2_busy_share_anchors_are_carried_with_their_source():
    """Every busy share the trn2 kernel-optimization guide publishes is a row (+-15 % of the share), and every
    known-gap note belongs to an anchor the bench runs."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import fidelity
    from tn.neuron import nki_matmul

    assert set(fidelity.TRN2_SHARES) == set(nki_matmul.TRN2_VERSIONS)
    for version, shares in fidelity.TRN2_SHARES.items():
        for eng, pct in shares:
            what, shape, dtype, arch, value, unit, band, source = fidelity.ANCHORS[f"trn2 matmul {version} {eng} busy"]
            assert (shape, dtype, arch, value, unit, band) == ("K,M,N=8192,4096,8192", "fp32", "trn2", pct, "%", 0.15)
            assert "kernel-optimization.rst" in source
    assert not any("trn2" in k for k in fidelity.NOT_RUN)
    assert set(fidelity.KNOWN_GAPS) <= set(fidelity.ANCHORS) | {"matmul speed-up v1/v2"}
