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


# ---------------------------------------------------------------- devices neuron:0 .. N-1
import gc  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from tn.neuron import timeline  # noqa: E402


def close(a, b, **kw):
    torch.testing.assert_close(a.cpu(), b.cpu() if isinstance(b, torch.Tensor) else b, **kw)


@pytest.fixture(autouse=True)
def _device0():
    torch.neuron.set_device(0)
    yield
    torch.neuron.set_device(0)
    torch.neuron.set_stream(torch.neuron.default_stream(0))


def test_device_count_and_module_functions_follow_the_machine():
    assert torch.neuron.device_count() == machine().device_count == torch.accelerator.device_count()
    with cfg.override(instance="trn2.48xlarge"):
        assert torch.neuron.device_count() == 64
        assert torch.ones(2, device="neuron:63").device == torch.device("neuron", 63)
    with cfg.override(instance="trn2.3xlarge", lnc=1):
        assert torch.neuron.device_count() == 8
        p = torch.neuron.get_device_properties(7)
        assert p.hbm_bytes == 12 << 30 and "LNC=1" in p.name
    assert "trn2.3xlarge" in torch.neuron.get_device_name()


def test_bad_index_names_the_count():
    n = torch.neuron.device_count()
    for make in (lambda: torch.zeros(2, device=f"neuron:{n}"), lambda: torch.ones(2).to(f"neuron:{n}"),
                 lambda: torch.neuron.set_device(n), lambda: torch.neuron.device(n),
                 lambda: torch.UntypedStorage(8, device=f"neuron:{n}"), lambda: torch.neuron.memory_allocated(n)):
        with pytest.raises(RuntimeError, match=f"neuron:{n} does not exist.*device_count\\(\\) == {n}"):
            make()


def test_results_land_on_the_device_of_their_inputs():
    x = torch.randn(8, 16)
    w = torch.randn(16, 4)
    a, b = x.to("neuron:1"), w.to("neuron:1")
    y = torch.relu(a @ b) + 1.0
    assert y.device == torch.device("neuron", 1) and y.sum().device == y.device
    close(y, torch.relu(x @ w) + 1.0, rtol=1e-5, atol=1e-5)
    assert torch.neuron.current_device() == 0          # the op's device guard did not leak
    lin = torch.nn.Linear(16, 4).to("neuron:2")
    with torch.no_grad():   # backward on neuron:N>0 needs a C++ device guard (see README: devices)
        out = lin(x.to("neuron:2"))
    assert out.device == lin.weight.device == torch.device("neuron", 2)
    close(out, torch.nn.functional.linear(x, lin.weight.cpu(), lin.bias.cpu()), rtol=1e-5, atol=1e-5)


def test_mixed_devices_raise_torchs_error():
    a, b = torch.ones(3, device="neuron:0"), torch.ones(3, device="neuron:1")
    for f in (lambda: a + b, lambda: torch.mm(a[None], b[:, None]), lambda: torch.cat([a, b]),
              lambda: a.add_(b)):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*neuron:0.*neuron:1"):
            f()


def test_current_device_context_and_factories():
    assert torch.neuron.current_device() == 0 and torch.ones(1, device="neuron").device.index == 0
    with torch.neuron.device(1):
        assert torch.neuron.current_device() == 1 == torch.accelerator.current_device_index()
        assert torch.empty(2, device="neuron").device == torch.device("neuron", 1)
        # torch's C++ binding of .to() fills a missing index from torch 2.13's Python device guard, which always
        # says 0: .to("neuron") means neuron:0 (documented; name the device to move elsewhere)
        assert torch.ones(2).to("neuron").device == torch.device("neuron", 0)
        assert torch.ones(2).to(torch.device("neuron", 1)).device.index == 1
        assert torch.ones(2, device="neuron:3").device.index == 3     # an explicit index wins
        with torch.accelerator.device_index(2):
            assert torch.zeros(1, device="neuron").device.index == 2
        assert torch.neuron.current_device() == 1
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device("neuron:3")
    assert torch.neuron.current_device() == 3 and torch.full((2,), 1.0, device="neuron").device.index == 3
    torch.accelerator.set_device_index(2)
    assert torch.neuron.current_device() == 2
    x = torch.ones(2, device="neuron:1")
    with torch.neuron.device_of(x):
        assert torch.neuron.current_device() == 1


def test_current_device_is_thread_local():
    import threading

    torch.neuron.set_device(3)
    seen = []
    th = threading.Thread(target=lambda: seen.append((torch.neuron.current_device(),
                                                      torch.empty(1, device="neuron").device.index)))
    th.start()
    th.join()
    assert seen == [(0, 0)] and torch.neuron.current_device() == 3


def test_memory_is_per_device():
    gc.collect()
    before = [torch.neuron.memory_allocated(i) for i in range(4)]
    t = torch.empty(1 << 16, device="neuron:2")          # 256 KiB
    assert torch.neuron.memory_allocated(2) == before[2] + (1 << 18)
    assert [torch.neuron.memory_allocated(i) for i in (0, 1, 3)] == [before[0], before[1], before[3]]
    assert torch.neuron.max_memory_allocated("neuron:2") >= before[2] + (1 << 18)
    assert torch.accelerator.memory_allocated(2) == torch.neuron.memory_stats(2)["allocated"]
    with torch.neuron.device(2):
        assert torch.neuron.memory_allocated() == before[2] + (1 << 18)
    del t
    gc.collect()
    assert torch.neuron.memory_allocated(2) == before[2]
    torch.neuron.reset_peak_memory_stats(2)
    assert torch.neuron.max_memory_allocated(2) == before[2]
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved(2) == torch.neuron.memory_allocated(2)


def test_memory_limit_per_device():
    gc.collect()
    torch.neuron.empty_cache()
    torch.neuron.set_memory_limit(torch.neuron.memory_reserved(3) + (1 << 20), device=3)
    try:
        with pytest.raises(tn.TnError, match="neuron:3: cannot allocate"):
            torch.empty(1 << 19, device="neuron:3")         # 2 MiB > 1 MiB left on neuron:3
        assert torch.empty(1 << 19, device="neuron:1").device.index == 1   # other devices have no limit
    finally:
        torch.neuron.set_memory_limit(0, device=3)


def test_native_allocator_checks_device_index():
    from tn._native._kernels import ffi, lib

    out = ffi.new("int64_t[8]")
    assert lib.tn_dev_stats(128, out) != 0 and lib.tn_dev_stats(-1, out) != 0
    assert lib.tn_dev_alloc_addr(128, 64) == 0 and lib.tn_dev_alloc_addr(-3, 64) == 0
    p = lib.tn_dev_alloc_addr(5, 100)
    assert lib.tn_dev_block_device(p) == 5 and lib.tn_dev_free_addr(p) == 0
    assert lib.tn_dev_free_addr(p) != 0 and lib.tn_dev_block_device(p) < 0


def test_cross_device_copies_are_equal_counted_and_timed():
    torch.neuron.reset_transfer_stats()
    x = torch.randn(64, 32)
    a = x.to("neuron:0")
    b = a.to("neuron:1")
    c = b.to("neuron:3", dtype=torch.bfloat16)
    d = torch.empty(64, 32, device="neuron:2")
    d.copy_(b)
    assert (b.device.index, c.device.index, d.device.index) == (1, 3, 2)
    close(b, x, rtol=0, atol=0)
    close(d, x, rtol=0, atol=0)
    close(c, x.to(torch.bfloat16), rtol=0, atol=0)
    st = torch.neuron.transfer_stats()
    assert st["count"] == 3 and st["bytes"] == 3 * 64 * 32 * 4    # fp32 moves, the bf16 cast is on neuron:3
    # on one chip a transfer goes through HBM: the DMA fixed cost + bytes over the chip's HBM bandwidth
    dma = machine().core_arch.dma_fixed_ns
    assert st["time_ns"] == pytest.approx(3 * (dma + 64 * 32 * 4 / 2.9e12 * 1e9))


# ---------------------------------------------------------------- streams and events (modelled time)
def _program_ns(x):
    with tn.profile() as prof:
        torch.mul(x, x)
    return sum(r.total_ns for r in prof.runs)


def test_streams_order_work_on_the_modelled_timeline():
    timeline.reset()
    x = torch.randn(256, 256, device="neuron:1")
    ns = _program_ns(x)                                   # the cost of one mul program
    timeline.reset()
    main = torch.neuron.current_stream(1)
    assert main == torch.neuron.default_stream(1) and main.stream_id == 0 and main.device_index == 1
    side = torch.neuron.Stream(device=1)
    assert side != main and side.device == torch.device("neuron", 1) and side.query()
    start, stop = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    with torch.neuron.device(1):
        start.record()
        torch.mul(x, x)                                   # on the default stream: [0, ns]
        with torch.neuron.stream(side):
            assert torch.neuron.current_stream() == side and torch.accelerator.current_stream() == side
            y = torch.mul(x, x)                           # one core runs one program at a time: [ns, 2ns]
        stop.record(side)
    assert torch.neuron.current_stream(1) == main
    close(y, x.cpu() * x.cpu())                           # the host ran it at once, whatever the stream
    assert start.elapsed_time(stop) == pytest.approx(2 * ns / 1e6)
    # wait_stream/wait_event: later work on main starts after side's; an unrecorded event waits for nothing
    main.wait_stream(side)
    assert main.ready_ns == pytest.approx(2 * ns)
    torch.neuron.Event().wait(main)
    e = side.record_event()
    assert e.time_ns == pytest.approx(2 * ns) and e.query()
    with pytest.raises(RuntimeError, match="enable_timing"):
        e.elapsed_time(stop)


def test_streams_of_two_devices_are_independent_and_synchronize_moves_the_host():
    timeline.reset()
    a, b = torch.randn(128, 128, device="neuron:0"), torch.randn(128, 128, device="neuron:2")
    torch.mul(a, a)
    torch.mul(b, b)
    t0, t2 = timeline.core_time_ns(0), timeline.core_time_ns(2)
    assert t0 > 0 and t2 > 0 and t2 == pytest.approx(t0)     # same program, each on its own core from 0
    torch.neuron.synchronize(2)
    s = torch.neuron.Stream(device=2)
    with torch.neuron.stream(s):
        torch.mul(b, b)
    assert s.ready_ns == pytest.approx(2 * t2)              # after the host's wait, not from 0
    torch.accelerator.synchronize(0)
    torch.neuron.set_stream(s)
    assert torch.neuron.current_stream(2) == s
    torch.neuron.set_stream(torch.neuron.default_stream(2))


def test_record_stream_and_the_device_handle_fsdp_uses():
    from torch.distributed.device_mesh import _get_device_handle

    handle = _get_device_handle("neuron")
    assert handle is torch.neuron
    s = handle.Stream(priority=-1)
    t = torch.ones(4, device="neuron")
    t.record_stream(s)                                    # a no-op kernel: memory frees when the storage dies
    with handle.stream(s):
        handle.current_stream().wait_event(handle.Event())
        s.wait_stream(handle.current_stream())
    assert isinstance(s, torch.Stream) and isinstance(handle.Event(), torch.Event) and s.priority == -1


# ---------------------------------------------------------------- profiles: one track group per core, merging
def test_profile_has_a_track_group_per_core(tmp_path):
    timeline.reset()
    x0, x1 = torch.randn(64, 64, device="neuron:0"), torch.randn(64, 64, device="neuron:1")
    with tn.profile() as prof:
        torch.mul(x0, x0)
        torch.mul(x1, x1)
        x0.to("neuron:3")
        tn.profile.add_record(1, "all_reduce", 100.0, 2100.0, nbytes=4096, args={"ranks": 2})
    assert prof.cores() == [0, 1] and [r.core for r in prof.runs] == [0, 1]   # the copy is neuron:0's record
    assert prof.runs[1].start_ns == 0.0                   # neuron:1's program starts at 0 on its own timeline
    rows = {r["core"]: r for r in prof.core_rows()}
    assert rows["neuron:1"]["collectives_us"] == pytest.approx(2.0) and rows["neuron:1"]["runs"] == 1
    assert rows["neuron:0"]["transfers_us"] > 0
    assert "neuron:1" in prof.table(by="core", print_it=False)
    data = json.load(open(prof.save_trace(tmp_path / "t.json")))["traceEvents"]
    groups = {e["pid"]: e["args"]["name"] for e in data if e.get("name") == "process_name"}
    assert sorted(groups.values()) == ["neuron:0", "neuron:1"]
    tracks = {(groups[e["pid"]], e["args"]["name"]) for e in data if e.get("name") == "thread_name"}
    assert {("neuron:1", "collectives"), ("neuron:1", "stream 0"), ("neuron:0", "transfers")} <= tracks
    # the multiply's engine track sits in neuron:1's group (which engine the compiler picks is its business)
    assert tracks & {("neuron:1", e) for e in ("VectorE", "GpSimd", "ScalarE")}
    coll = [e for e in data if e.get("cat") == "collectives"]
    assert len(coll) == 1 and coll[0]["ts"] == 0.1 and coll[0]["dur"] == 2.0 and coll[0]["args"]["bytes"] == 4096
    tn.profile.add_record(0, "outside", 0.0, 1.0)         # no active profile: nothing recorded
    assert len(prof.records) == 2


def test_merge_traces_of_two_ranks(tmp_path):
    x = torch.randn(32, 32, device="neuron:0")
    paths = []
    for rank in range(2):
        with tn.profile() as prof:
            torch.mul(x, x)
            tn.profile.add_record(0, f"all_gather r{rank}", 0.0, 10.0, nbytes=8)
        paths.append(prof.save_trace(tmp_path / f"rank{rank}.json"))
    out = tn.profile.merge_traces(paths, tmp_path / "job.json")
    data = json.load(open(out))["traceEvents"]
    names = sorted(e["args"]["name"] for e in data if e.get("name") == "process_name")
    assert names == ["rank0 neuron:0", "rank1 neuron:0"]
    pids = {e["pid"] for e in data if e.get("cat") == "collectives"}
    assert len(pids) == 2                                 # the ranks' tracks do not collide
    n_in = sum(len(json.load(open(p))["traceEvents"]) for p in paths)
    assert len(data) == n_in
    with pytest.raises(tn.TnError, match="2 traces but 1 labels"):
        tn.profile.merge_traces(paths, tmp_path / "bad.json", labels=["a"])


# ---------------------------------------------------------------- fork after the device was used
def _child_touches_device(q):
    try:
        torch.ones(2, device="neuron")
        q.put("no error")
    except Exception as e:   # noqa: BLE001 - the message is the result
        q.put(f"{type(e).__name__}: {e}")
    q.put(torch.neuron._is_in_bad_fork())
    from tn.device import allocator

    allocator.reinit_after_fork()                         # the explicit escape (host memory): usable again
    q.put(float(torch.ones(2, device="neuron").sum()))


def test_fork_after_init_is_a_clear_error():
    import torch.multiprocessing as mp

    torch.ones(1, device="neuron")                        # the parent used the device
    assert torch.neuron.is_initialized() and not torch.neuron._is_in_bad_fork()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_touches_device, args=(q,))
    p.start()
    msg, bad, total = q.get(timeout=60), q.get(timeout=60), q.get(timeout=60)
    p.join(timeout=60)
    assert "forked subprocess" in msg and "spawn" in msg and bad is True and total == 2.0


def test_visible_cores_give_a_process_its_own_core(tmp_path):
    # one process per core, as TorchNeuron runs under torchrun: the process's neuron:0 stands for core 3
    with cfg.override(instance="trn2.48xlarge", visible_cores="3"):
        m = machine()
        assert m.devices == (3,) and torch.neuron.device_count() == 1 and m.device_count == 64
        with pytest.raises(RuntimeError, match="sees 1 \\(TN_VISIBLE_CORES\\).*device_count\\(\\) == 1"):
            torch.ones(1, device="neuron:1")
        x = torch.randn(8, 8, device="neuron", requires_grad=True)
        (x * x).sum().backward()                          # autograd works: the process trains on neuron:0
        close(x.grad, 2 * x.detach())
        with tn.profile() as prof:
            torch.mul(x.detach(), 2.0)
        data = json.load(open(prof.save_trace(tmp_path / "t.json")))["traceEvents"]
        assert [e["args"]["name"] for e in data if e.get("name") == "process_name"] == ["neuron:0 (core 3)"]
    with cfg.override(instance="trn2.3xlarge", visible_cores="0-1,3"):
        assert machine().devices == (0, 1, 3) and torch.neuron.device_count() == 3
    for bad in ("4", "1,1", "x"):
        with cfg.override(visible_cores=bad):
            with pytest.raises(cfg.ConfigError, match="TN_VISIBLE_CORES"):
                machine()
