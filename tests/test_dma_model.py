# The DMA rule bench/fidelity.py tests against the OUT matmul anchors (issue 16): what it charges, and that it is a
# timing variant only (same instruction streams).
import os
import sys

import numpy as np
import pytest

import tn
from tn.neuron import get_arch, nki_matmul, simulate_timing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import fidelity  # noqa: E402


@pytest.mark.parametrize("arch", ["trn1", "trn2"])
def test_tested_rule_drops_only_the_per_transfer_minimum(arch):
    """fidelity.no_transfer_minimum is the modelled arch with the per-transfer minimum at 0 and every other
    timing constant (latency, bandwidth, descriptor overhead, DGE issue) as modelled."""
    base, alt = get_arch(arch), fidelity.no_transfer_minimum(arch)
    assert base.dma_transfer_min_ns > 0 and alt.dma_transfer_min_ns == 0
    tb, ta = base.timing_vector(), alt.timing_vector()
    assert np.array_equal(tb[:-1], ta[:-1]) and ta[-1] == 0
    assert np.array_equal(base.limits_vector(), alt.limits_vector())


def test_tested_rule_makes_a_v1_step_bandwidth_bound():
    """Under the tested rule (fixed cost once per queue start, pipelined) a steady v1 step on trn1's one IO queue
    costs its two loads' engine time, (256 + 185) and (1024 + 185) B on each of an engine's 8 partitions at
    17 B/ns (0.78 us), not two per-transfer minimums (2.28 us): the published step (51.80 ms / 32768 = 1.58 us)
    lies between the two, which is why neither reading fits v1 (the row's note)."""
    a = fidelity.no_transfer_minimum("trn1")
    ppe = a.partitions // a.dma_engines
    bw = a.dma_engine_bytes_per_s / 1e9

    def load_ns(partition_bytes):
        return ppe * (partition_bytes + a.dma_chunk_overhead_bytes) / bw

    def m_tile_ns(arch):
        """Modelled ns of one more M-tile at K = 8192, N = 512: 64 steps and one [128, 512] bf16 store."""
        t = [simulate_timing(nki_matmul.build("tiled", 8192, 128 * m, 512, arch=arch).build(check=False)).total_ns
             for m in (2, 3)]
        return t[1] - t[0]

    step = load_ns(256) + load_ns(1024)
    assert m_tile_ns(a) == pytest.approx(64 * step + load_ns(1024), rel=0.05)
    published_step = 51.80e6 / 32768
    assert step < published_step / 1.15 < published_step * 1.15 < 2 * get_arch("trn1").dma_transfer_min_ns


def test_trn2_kernels_take_an_arch_variant_without_changing_the_stream():
    """build_trn2(arch=...) models the same instructions under another trn2 cost constant; a trn1 arch is refused
    (the kernels' tile sets are sized for trn2's SBUF)."""
    e1 = nki_matmul.build_trn2("tiled", 512, 256, 2048).build(check=False)
    e2 = nki_matmul.build_trn2("tiled", 512, 256, 2048, arch=fidelity.no_transfer_minimum("trn2")).build(check=False)
    p1, p2 = e1.prepared(), e2.prepared()
    assert np.array_equal(p1["records"], p2["records"]) and np.array_equal(p1["deps"], p2["deps"])
    assert simulate_timing(e2).total_ns < simulate_timing(e1).total_ns
    with pytest.raises(tn.NeuronError, match="NeuronCore-v3"):
        nki_matmul.build_trn2("tiled", 512, 256, 2048, arch="trn1")
