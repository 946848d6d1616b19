# The modelled machine: the table of Trainium instances (chips, cores, HBM, links) and the topology of its cores.
"""Which machine tn models: instance type, logical core size (LNC), number of instances.

One table, :data:`INSTANCES`, holds the published AWS numbers of the
instances tn models; :func:`machine` resolves tn's settings into a
:class:`Machine`:

* ``TN_INSTANCE`` / ``tn.config.set(instance=...)``: the instance type
  (unset: the one-chip instance of ``TN_ARCH``, i.e. ``trn2.3xlarge``, or
  ``trn1.2xlarge`` with ``TN_ARCH=trn1``),
* ``TN_LNC``: physical NeuronCores per logical core (torch device); trn2
  accepts 1 or 2 (default 2), trn1 only 1,
* ``TN_INSTANCES``: how many such instances the job spans (default 1; only
  the collective model looks past one instance: a process sees the devices
  of its own instance, as a CUDA process sees the GPUs of its node),
* ``TN_VISIBLE_CORES``: which of the instance's cores the process sees, as
  AWS's ``NEURON_RT_VISIBLE_CORES`` (``"3"``: one device, ``neuron:0``,
  standing for core 3; unset: all). TorchNeuron runs one process per core
  this way; ``Machine.devices[i]`` is the core behind ``neuron:i``.

The architecture follows the instance (trn1.* instances have NeuronCore-v2,
trn2.* NeuronCore-v3); ``TN_ARCH`` naming the other one is a
:class:`tn.config.ConfigError`.

>>> from tn.neuron.machine import machine
>>> m = machine("trn2.48xlarge")
>>> m.device_count, m.cores_per_chip, m.lnc, m.chips
(64, 4, 2, 16)
>>> m.chip_of(5), m.hops(0, 4), m.hops(0, 60), m.same_instance(0, 63)
(1, 1, 2, True)
>>> machine().name     # nothing set: one trn2 chip, 4 logical cores
'trn2.3xlarge'

Numbering
---------
Cores are numbered globally: ``core = instance * device_count + local``,
``local = chip * cores_per_chip + core_in_chip`` (a process's torch device
index is ``local``; a rank of a job is a global core under torchrun's usual
``rank = node * nproc_per_node + local_rank``). Chips of an instance sit on
its torus grid row by row (chip ``c`` at ``(c // cols, c % cols)``).

How LNC is modelled (a decision of tn's, tested in ``tests/test_device_multi.py``)
------------------------------------------------------------------------------
A logical core is one torch device with the HBM capacity of its ``lnc``
physical cores (``hbm_bytes_per_device``). Its programs are timed on *one*
physical NeuronCore model (:func:`tn.neuron.arch.get_arch`, engines, SBUF and
the HBM bandwidth share of one physical core): tn's compiler does not split a
program over the pair, so at LNC=2 the modelled compute time is an upper
bound (AWS's compiler shards a program over both physical cores).
``Machine.core_arch`` is that Arch. Collective costs use the chip's
NeuronLink and the instances' EFA regardless of LNC; only the number of
cores sharing a chip changes.

Topology helpers the collective model uses: :meth:`Machine.chip_of`,
:meth:`Machine.instance_of`, :meth:`Machine.same_chip`,
:meth:`Machine.same_instance`, :meth:`Machine.hops`, :meth:`Machine.link`,
:meth:`Machine.ring_order`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .. import config
from ..config import ConfigError
from .arch import get_arch

__all__ = ["Instance", "Machine", "Link", "INSTANCES", "machine", "instance_names", "MAX_DEVICES"]

GiB = 1 << 30

#: Upper bound of devices per process (trn2.48xlarge at LNC=1: 16 chips x 8 cores); the native allocator keeps
#: one arena per device up to this many.
MAX_DEVICES = 128

_TRN1_DOC = "AWS Neuron docs, 'Amazon EC2 Trn1/Trn1n Architecture' and 'Trainium Architecture'"
_TRN2_DOC = "AWS Neuron docs, 'Trainium2 Architecture' and 'Amazon EC2 Trn2 Architecture'"
_ISSUE = "tn issue 12 / DESIGN.md 'Many cores' (collective latency guidance)"


@dataclass(frozen=True)
class Instance:
    """One instance type: chips, cores, memory and links, each number with its source in ``sources``.

    Bandwidths are bytes/s; ``link_bytes_per_s`` is one chip's NeuronLink
    bandwidth inside the instance (all its links together), ``efa_bytes_per_s``
    the instance's network bandwidth to other instances. Latencies are ns per
    hop. ``torus`` is the chip grid ``(rows, cols)`` of the 2-D torus (``None``
    for a one-chip instance).
    """

    name: str
    arch: str
    chips: int
    physical_cores_per_chip: int
    hbm_bytes_per_chip: int
    hbm_bytes_per_s_per_chip: float
    torus: Optional[Tuple[int, int]]
    link: str
    link_bytes_per_s: float
    efa_bytes_per_s: float
    lnc_choices: Tuple[int, ...]
    lnc_default: int
    intra_hop_ns: float
    inter_hop_ns: float
    collective_cores_per_chip: int
    sources: Dict[str, str] = field(default_factory=dict, compare=False, hash=False)


def _gbps(x: float) -> float:
    return x * 1e9 / 8


_TRN1_COMMON = dict(arch="trn1", physical_cores_per_chip=2, hbm_bytes_per_chip=32 * GiB,
                    hbm_bytes_per_s_per_chip=820 * GiB, lnc_choices=(1,), lnc_default=1,
                    intra_hop_ns=1500.0, inter_hop_ns=15000.0, collective_cores_per_chip=0)
_TRN2_COMMON = dict(arch="trn2", physical_cores_per_chip=8, hbm_bytes_per_chip=96 * GiB,
                    hbm_bytes_per_s_per_chip=2.9e12, lnc_choices=(1, 2), lnc_default=2,
                    intra_hop_ns=1500.0, inter_hop_ns=15000.0, collective_cores_per_chip=20)
_TRN1_SOURCES = {
    "physical_cores_per_chip": _TRN1_DOC + ": 2 NeuronCore-v2 per Trainium chip",
    "hbm_bytes_per_chip": _TRN1_DOC + ": 32 GiB device memory per chip",
    "hbm_bytes_per_s_per_chip": _TRN1_DOC + ": 820 GiB/s per chip (instance table: 13,120 GiB/s for 16 chips)",
    "lnc_choices": "AWS Neuron docs, 'Logical NeuronCore configuration': LNC is a Trainium2 feature; trn1 is LNC=1",
    "intra_hop_ns": "assumption: " + _ISSUE + " gives ~1-2 us per hop inside an instance; 1.5 us taken",
    "inter_hop_ns": "assumption: " + _ISSUE + " gives ~15 us per hop between instances",
    "collective_cores_per_chip": "not modelled for trn1 (collectives still overlap compute in the model)",
}
_TRN2_SOURCES = {
    "physical_cores_per_chip": _TRN2_DOC + ": 8 NeuronCore-v3 per Trainium2 chip",
    "hbm_bytes_per_chip": _TRN2_DOC + ": 96 GiB of device memory per chip",
    "hbm_bytes_per_s_per_chip": _TRN2_DOC + ": 2.9 TB/s per chip",
    "lnc_choices": "AWS Neuron docs, 'Logical NeuronCore configuration': LNC=2 (default, 4 logical cores per "
                   "chip) or LNC=1 (8)",
    "intra_hop_ns": "assumption: " + _ISSUE + " gives ~1-2 us per hop inside an instance; 1.5 us taken",
    "inter_hop_ns": "assumption: " + _ISSUE + " gives ~15 us per hop between instances",
    "collective_cores_per_chip": "AWS NKI 'Trainium2 Architecture Guide': 20 CC-Cores per chip",
}


def _instance(name: str, common: dict, base_sources: dict, extra_sources: dict, **kw) -> Instance:
    return Instance(name=name, **common, **kw, sources={**base_sources, **extra_sources})


#: Every instance type tn models, by name.
INSTANCES: Dict[str, Instance] = {i.name: i for i in (
    _instance("trn1.2xlarge", _TRN1_COMMON, _TRN1_SOURCES, {
        "chips": _TRN1_DOC + " instance table: 1 Trainium chip",
        "link_bytes_per_s": _TRN1_DOC + " instance table: NeuronLink-v2 N/A (one chip)",
        "efa_bytes_per_s": _TRN1_DOC + " instance table: up to 25 Gbps network (no EFA)"},
        chips=1, torus=None, link="none", link_bytes_per_s=0.0, efa_bytes_per_s=_gbps(25)),
    _instance("trn1.32xlarge", _TRN1_COMMON, _TRN1_SOURCES, {
        "chips": _TRN1_DOC + " instance table: 16 Trainium chips",
        "torus": _TRN1_DOC + ": chips connected in a 2-D torus (4 x 4 assumed for 16 chips)",
        "link_bytes_per_s": _TRN1_DOC + " instance table: NeuronLink-v2 384 GiB/s per chip",
        "efa_bytes_per_s": _TRN1_DOC + " instance table: EFA 800 Gbps"},
        chips=16, torus=(4, 4), link="NeuronLink-v2", link_bytes_per_s=384 * GiB, efa_bytes_per_s=_gbps(800)),
    _instance("trn1n.32xlarge", _TRN1_COMMON, _TRN1_SOURCES, {
        "chips": _TRN1_DOC + " instance table: 16 Trainium chips",
        "torus": _TRN1_DOC + ": chips connected in a 2-D torus (4 x 4 assumed for 16 chips)",
        "link_bytes_per_s": _TRN1_DOC + " instance table: NeuronLink-v2 768 GiB/s per chip",
        "efa_bytes_per_s": _TRN1_DOC + " instance table: EFA 1600 Gbps"},
        chips=16, torus=(4, 4), link="NeuronLink-v2", link_bytes_per_s=768 * GiB, efa_bytes_per_s=_gbps(1600)),
    _instance("trn2.3xlarge", _TRN2_COMMON, _TRN2_SOURCES, {
        "chips": _TRN2_DOC + ": trn2.3xlarge has 1 Trainium2 chip",
        "link_bytes_per_s": "one chip: no chip-to-chip link",
        "efa_bytes_per_s": "assumption: 200 Gbps network (not in the docs read; only matters past one instance)"},
        chips=1, torus=None, link="none", link_bytes_per_s=0.0, efa_bytes_per_s=_gbps(200)),
    _instance("trn2.48xlarge", _TRN2_COMMON, _TRN2_SOURCES, {
        "chips": _TRN2_DOC + ": 16 Trainium2 chips",
        "torus": _TRN2_DOC + ": NeuronLink-v3 4 x 4 2-D torus",
        "link_bytes_per_s": _TRN2_DOC + ": NeuronLink-v3 1.28 TB/s per chip (the issue's '~1 TB/s')",
        "efa_bytes_per_s": _TRN2_DOC + ": EFAv3 3200 Gbps"},
        chips=16, torus=(4, 4), link="NeuronLink-v3", link_bytes_per_s=1.28e12, efa_bytes_per_s=_gbps(3200)),
)}

#: The instance used when only the architecture (or nothing) is set: one chip, as one-process work expects.
DEFAULT_INSTANCE = {"trn1": "trn1.2xlarge", "trn2": "trn2.3xlarge"}


def instance_names() -> List[str]:
    """Names of the modelled instance types."""
    return list(INSTANCES)


@dataclass(frozen=True)
class Link:
    """How two cores talk: ``kind`` (``"self"``, ``"chip"``: same chip, ``"neuronlink"``: chips of one instance,
    ``"efa"``: between instances), ``hops`` (links crossed), ``latency_ns`` (hops x per-hop latency) and
    ``bytes_per_s`` (the bandwidth of the slowest link on the way). Cores of one chip exchange data through the
    chip's HBM: latency one DMA fixed cost, bandwidth the chip's HBM bandwidth (a modelling choice)."""

    kind: str
    hops: int
    latency_ns: float
    bytes_per_s: float


@dataclass(frozen=True)
class Machine:
    """The modelled machine: ``instances`` x ``instance``, each chip's physical cores grouped ``lnc`` per device."""

    instance: Instance
    lnc: int
    instances: int = 1
    visible: Optional[Tuple[int, ...]] = None

    @property
    def devices(self) -> Tuple[int, ...]:
        """The cores of the instance this process sees, in device order: ``devices[i]`` is the core behind
        ``neuron:i`` (``TN_VISIBLE_CORES``; default every core)."""
        return self.visible if self.visible is not None else tuple(range(self.device_count))

    @property
    def process_device_count(self) -> int:
        """Devices this process sees: what ``torch.neuron.device_count()`` reports."""
        return len(self.devices)

    # ------------------------------------------------------------ sizes
    @property
    def name(self) -> str:
        """The instance type's name (``"trn2.48xlarge"``)."""
        return self.instance.name

    @property
    def arch_name(self) -> str:
        """``"trn1"`` or ``"trn2"``: the NeuronCore architecture of the instance."""
        return self.instance.arch

    @property
    def core_arch(self):
        """The :class:`tn.neuron.arch.Arch` each device's programs are timed on (one physical core, see the
        module docstring for LNC)."""
        return get_arch(self.instance.arch)

    @property
    def chips(self) -> int:
        """Chips per instance."""
        return self.instance.chips

    @property
    def cores_per_chip(self) -> int:
        """Logical cores (torch devices) per chip."""
        return self.instance.physical_cores_per_chip // self.lnc

    @property
    def device_count(self) -> int:
        """Logical cores of one instance (``torch.neuron.device_count()`` unless ``TN_VISIBLE_CORES`` picks
        fewer)."""
        return self.chips * self.cores_per_chip

    @property
    def world_size(self) -> int:
        """Logical cores over all instances."""
        return self.device_count * self.instances

    @property
    def hbm_bytes_per_device(self) -> int:
        """HBM capacity of one logical core (its ``lnc`` physical cores' share of the chip's HBM)."""
        return self.instance.hbm_bytes_per_chip // self.cores_per_chip

    @property
    def hbm_bytes_per_s_per_device(self) -> float:
        """HBM bandwidth of one logical core (its physical cores' share of the chip's)."""
        return self.instance.hbm_bytes_per_s_per_chip / self.cores_per_chip

    # ------------------------------------------------------------ topology
    def _check(self, core: int) -> int:
        core = int(core)
        if not 0 <= core < self.world_size:
            raise ConfigError(f"core {core} does not exist on {self.describe()} (cores 0..{self.world_size - 1})")
        return core

    def instance_of(self, core: int) -> int:
        """Instance (node) index of global core ``core``."""
        return self._check(core) // self.device_count

    def local_index(self, core: int) -> int:
        """Device index of ``core`` inside its instance (the torch device index of its process)."""
        return self._check(core) % self.device_count

    def chip_of(self, core: int) -> int:
        """Chip index (inside its instance) of global core ``core``."""
        return self.local_index(core) // self.cores_per_chip

    def same_instance(self, a: int, b: int) -> bool:
        """True when cores ``a`` and ``b`` are in the same instance."""
        return self.instance_of(a) == self.instance_of(b)

    def same_chip(self, a: int, b: int) -> bool:
        """True when cores ``a`` and ``b`` are on the same chip of the same instance."""
        return self.same_instance(a, b) and self.chip_of(a) == self.chip_of(b)

    def chip_position(self, chip: int) -> Tuple[int, int]:
        """``(row, col)`` of ``chip`` on the instance's torus grid (``(0, 0)`` for a one-chip instance)."""
        if not 0 <= chip < self.chips:
            raise ConfigError(f"chip {chip} does not exist on {self.name} (chips 0..{self.chips - 1})")
        if self.instance.torus is None:
            return (0, 0)
        return divmod(chip, self.instance.torus[1])

    def chip_hops(self, c1: int, c2: int) -> int:
        """NeuronLink hops between chips ``c1`` and ``c2`` of one instance (shortest way round the torus)."""
        (r1, k1), (r2, k2) = self.chip_position(c1), self.chip_position(c2)
        if self.instance.torus is None:
            return 0
        rows, cols = self.instance.torus
        dr, dc = abs(r1 - r2), abs(k1 - k2)
        return min(dr, rows - dr) + min(dc, cols - dc)

    def hops(self, a: int, b: int) -> int:
        """Links crossed from core ``a`` to core ``b``: 0 on one chip, torus hops between chips of an instance,
        and between instances one EFA hop plus the torus hops from each side's chip to chip 0 (the model's
        network attachment point, an assumption)."""
        if self.same_instance(a, b):
            return self.chip_hops(self.chip_of(a), self.chip_of(b))
        return 1 + self.chip_hops(self.chip_of(a), 0) + self.chip_hops(self.chip_of(b), 0)

    def link(self, a: int, b: int) -> Link:
        """The :class:`Link` between cores ``a`` and ``b`` (kind, hops, latency, bottleneck bandwidth)."""
        inst = self.instance
        if self._check(a) == self._check(b):
            return Link("self", 0, 0.0, self.hbm_bytes_per_s_per_device)
        if self.same_chip(a, b):   # through the chip's HBM: one DMA's fixed cost
            return Link("chip", 0, self.core_arch.dma_fixed_ns, inst.hbm_bytes_per_s_per_chip)
        if self.same_instance(a, b):
            h = self.hops(a, b)
            return Link("neuronlink", h, h * inst.intra_hop_ns, inst.link_bytes_per_s)
        h = self.hops(a, b)
        lat = inst.inter_hop_ns + (h - 1) * inst.intra_hop_ns
        return Link("efa", h, lat, inst.efa_bytes_per_s)

    def ring_order(self, cores: Optional[Sequence[int]] = None) -> List[int]:
        """``cores`` (default: all) in ring order: instance by instance, chips in a snake over the torus grid
        (each step one NeuronLink hop; the wrap-around closes the ring), the cores of a chip consecutive."""
        cores = list(range(self.world_size)) if cores is None else [self._check(c) for c in cores]
        if self.instance.torus is None:
            snake = list(range(self.chips))
        else:
            rows, cols = self.instance.torus
            snake = []
            for r in range(rows):
                row = [r * cols + k for k in range(cols)]
                snake.extend(row if r % 2 == 0 else reversed(row))
        chip_rank = {c: i for i, c in enumerate(snake)}
        return sorted(cores, key=lambda c: (self.instance_of(c), chip_rank[self.chip_of(c)], self.local_index(c)))

    def describe(self) -> str:
        """One line: instance, LNC, devices, HBM per device."""
        more = f" x {self.instances} instances" if self.instances > 1 else ""
        return (f"{self.name}{more} (LNC={self.lnc}: {self.device_count} devices of "
                f"{self.hbm_bytes_per_device / GiB:.0f} GiB HBM, {self.instance.arch})")


def parse_cores(text: str, count: int) -> Tuple[int, ...]:
    """``"3"``, ``"0-3"``, ``"0,2,5"`` as a tuple of core indices, each below ``count`` (a ConfigError otherwise)."""
    cores = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            rng = range(int(lo), int(hi) + 1) if sep else [int(lo)]
        except ValueError:
            raise ConfigError(f"TN_VISIBLE_CORES={text!r}: use core numbers and ranges like '3', '0-3' or '0,2'") \
                from None
        cores.extend(rng)
    if not cores or len(set(cores)) != len(cores) or not all(0 <= c < count for c in cores):
        raise ConfigError(f"TN_VISIBLE_CORES={text!r}: need distinct cores 0..{count - 1} of the instance")
    return tuple(cores)


def machine(instance: Optional[str] = None, lnc: Optional[int] = None, instances: Optional[int] = None) -> Machine:
    """The :class:`Machine` of the arguments, else of tn's settings (``instance``, ``lnc``, ``instances``,
    ``arch``): see the module docstring. Raises :class:`tn.config.ConfigError` naming an unknown instance, an
    LNC the instance does not offer, or an architecture that contradicts the instance."""
    arch = config.get("arch")
    name = instance if instance is not None else config.get("instance")
    if not name:
        name = DEFAULT_INSTANCE[arch or "trn2"]
    inst = INSTANCES.get(name)
    if inst is None:
        raise ConfigError(f"TN_INSTANCE={name!r} is not a modelled instance type; use one of "
                          f"{', '.join(INSTANCES)}")
    if instance is None and arch and arch != inst.arch:
        raise ConfigError(f"TN_ARCH={arch!r} contradicts TN_INSTANCE={name!r} (a {inst.arch} instance); unset "
                          f"TN_ARCH (the architecture follows the instance)")
    lnc = lnc if lnc is not None else config.get("lnc")
    lnc = inst.lnc_default if lnc is None else int(lnc)
    if lnc not in inst.lnc_choices:
        raise ConfigError(f"TN_LNC={lnc} is not available on {name}: use {' or '.join(map(str, inst.lnc_choices))}")
    n = instances if instances is not None else config.get("instances")
    if int(n) < 1:
        raise ConfigError(f"TN_INSTANCES={n} must be at least 1")
    m = Machine(inst, lnc, int(n))
    vis = config.get("visible_cores")
    if vis:
        m = Machine(inst, lnc, int(n), parse_cores(vis, m.device_count))
    if m.device_count > MAX_DEVICES:
        raise ConfigError(f"{m.describe()}: more than {MAX_DEVICES} devices per process is not supported")
    return m
