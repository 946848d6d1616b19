# Tests of the many-core neuron device: the machine table, devices neuron:0..N-1, memory per device, streams, profiles.
import pytest

import tn
import tn.config as cfg
from tn.neuron.machine import INSTANCES, machine


# ---------------------------------------------------------------- the machine table
@pytest.mark.parametrize("instance,lnc,count,per_chip", [
    ("trn2.3xlarge", None, 4, 4), ("trn2.3xlarge", 1, 8, 8), ("trn2.48xlarge", None, 64, 4),
    ("trn2.48xlarge", 1, 128, 8), ("trn1.2xlarge", None, 2, 2), ("trn1.32xlarge", None, 32, 2),
    ("trn1n.32xlarge", 1, 32, 2)])
def test_device_count_follows_instance_and_lnc(instance, lnc, count, per_chip):
    with cfg.override(instance=instance, lnc=lnc):
        m = machine()
        assert (m.device_count, m.cores_per_chip) == (count, per_chip)
        assert m.arch_name == instance[:4].replace("trn1n", "trn1")


def test_default_machine_is_one_trn2_chip(monkeypatch):
    for v in ("TN_INSTANCE", "TN_ARCH", "TN_LNC", "TN_INSTANCES"):
        monkeypatch.delenv(v, raising=False)
    m = machine()
    assert m.name == "trn2.3xlarge" and m.lnc == 2 and m.device_count == 4 and m.instances == 1
    with cfg.override(arch="trn1"):
        assert machine().name == "trn1.2xlarge" and machine().core_arch.name == "trn1"


def test_published_numbers():
    t2, t1, t1n = INSTANCES["trn2.48xlarge"], INSTANCES["trn1.32xlarge"], INSTANCES["trn1n.32xlarge"]
    assert t2.hbm_bytes_per_chip == 96 << 30 and t2.hbm_bytes_per_s_per_chip == 2.9e12 and t2.torus == (4, 4)
    assert t2.efa_bytes_per_s * 8 == 3200e9 and t2.link_bytes_per_s == 1.28e12
    assert t1.efa_bytes_per_s * 8 == 800e9 and t1n.efa_bytes_per_s * 8 == 1600e9
    assert t1.hbm_bytes_per_chip == 32 << 30 and t1.physical_cores_per_chip == 2
    for inst in INSTANCES.values():   # every number says where it comes from
        for key in ("chips", "hbm_bytes_per_chip", "link_bytes_per_s", "efa_bytes_per_s", "intra_hop_ns"):
            assert inst.sources.get(key), (inst.name, key)


def test_lnc_model_memory_per_device():
    # a logical core holds the HBM of its physical cores; its programs are timed on one physical core's model
    m2, m1 = machine("trn2.48xlarge", lnc=2), machine("trn2.48xlarge", lnc=1)
    assert m2.hbm_bytes_per_device == 24 << 30 and m1.hbm_bytes_per_device == 12 << 30
    assert m2.hbm_bytes_per_s_per_device == pytest.approx(2 * m1.hbm_bytes_per_s_per_device)
    assert m2.core_arch is m1.core_arch and m2.core_arch.name == "trn2"


def test_bad_settings_name_what_is_wrong():
    with pytest.raises(cfg.ConfigError, match="trn9.1xlarge.*trn2.48xlarge"):
        machine("trn9.1xlarge")
    with pytest.raises(cfg.ConfigError, match="TN_LNC=2 is not available on trn1.32xlarge"):
        machine("trn1.32xlarge", lnc=2)
    with cfg.override(instance="trn1.32xlarge", arch="trn2"):
        with pytest.raises(cfg.ConfigError, match="contradicts"):
            machine()
    with pytest.raises(cfg.ConfigError, match="at least 1"):
        machine(instances=0)


def test_topology_helpers():
    m = machine("trn2.48xlarge", instances=2)
    assert m.world_size == 128 and m.device_count == 64
    assert m.chip_of(3) == 0 and m.chip_of(4) == 1 and m.chip_of(64 + 5) == 1 and m.instance_of(64) == 1
    assert m.local_index(64 + 5) == 5
    assert m.same_chip(0, 3) and not m.same_chip(3, 4) and m.same_instance(0, 63) and not m.same_instance(63, 64)
    assert m.hops(0, 1) == 0 and m.hops(0, 4) == 1 and m.hops(0, 15 * 4) == 2   # 4x4 torus: (0,0)-(3,3) wraps
    assert m.link(0, 0).kind == "self" and m.link(0, 1).kind == "chip"
    nl, efa = m.link(0, 4), m.link(0, 64)
    assert nl.kind == "neuronlink" and nl.latency_ns == 1500.0 and nl.bytes_per_s == 1.28e12
    assert efa.kind == "efa" and efa.latency_ns == 15000.0 and efa.bytes_per_s == 400e9
    ring = m.ring_order()
    assert sorted(ring) == list(range(128)) and ring[:4] == [0, 1, 2, 3]
    # consecutive ring neighbours inside an instance are at most one NeuronLink hop apart (snake over the torus)
    assert all(m.hops(a, b) <= 1 for a, b in zip(ring, ring[1:]) if m.same_instance(a, b))
    assert m.hops(ring[63], ring[0]) == 1                      # the wrap-around closes the ring of instance 0
    assert m.ring_order([9, 0, 5]) == [0, 5, 9]
    with pytest.raises(cfg.ConfigError, match="core 128 does not exist"):
        m.chip_of(128)


def test_arch_follows_instance():
    from tn.neuron.arch import default_arch_name

    with cfg.override(instance="trn1n.32xlarge"):
        assert default_arch_name() == "trn1" == machine().arch_name
    with cfg.override(instance="trn2.48xlarge"):
        assert default_arch_name() == "trn2" == machine().arch_name
    assert tn.neuron.machine.machine is machine
