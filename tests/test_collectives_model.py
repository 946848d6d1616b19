# Tests of tn.neuron.collectives: the ring timing model's formulas on the modelled machine.
import pytest

from tn.neuron import collectives as C
from tn.neuron.machine import machine


def test_allreduce_is_reduce_scatter_plus_all_gather():
    m = machine("trn2.48xlarge")
    cores = list(range(8))
    nb = 1 << 24
    ar = C.collective_ns("all_reduce", m, nb, cores)
    assert ar == pytest.approx(C.collective_ns("reduce_scatter", m, nb, cores)
                               + C.collective_ns("all_gather", m, nb, cores))


def test_allreduce_formula_pinned():
    m = machine("trn2.48xlarge")
    cores = list(range(m.device_count))
    n = len(cores)
    lat, bw = C.ring_step(m, cores)
    nb = 1 << 20
    expect = 2 * (n - 1) * (lat + nb / n / bw * 1e9)
    assert C.collective_ns("all_reduce", m, nb, cores) == pytest.approx(expect)
    assert lat > 0 and bw > 0
    ns = C.collective_ns("all_reduce", m, nb, cores)
    assert C.bus_bandwidth("all_reduce", nb, ns, n) == pytest.approx(nb / (ns * 1e-9) * 2 * (n - 1) / n)


def test_one_rank_is_free_and_errors():
    m = machine("trn2.48xlarge")
    assert C.collective_ns("all_reduce", m, 1024, [0]) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        C.collective_ns("allreduce", m, 1, [0, 1])
    with pytest.raises(ValueError, match="2 cores"):
        C.collective_ns("send_recv", m, 1, [0, 1, 2])


def test_more_bytes_take_longer_and_send_recv_uses_link():
    m = machine("trn2.48xlarge")
    a = C.collective_ns("all_gather", m, 1 << 10, [0, 1, 2, 3])
    b = C.collective_ns("all_gather", m, 1 << 24, [0, 1, 2, 3])
    assert b > a
    link = m.link(0, m.device_count - 1)
    assert C.collective_ns("send_recv", m, 4096, [0, m.device_count - 1]) == pytest.approx(
        link.latency_ns + 4096 / link.bytes_per_s * 1e9)
