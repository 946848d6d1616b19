# The numbers of the modelled NeuronCores (trn1 = NeuronCore-v2, trn2 = NeuronCore-v3): memories, clocks, bandwidths, costs.
"""Architecture configurations of the software NeuronCore, in one place.

Every number the model uses lives here: memory sizes, engine clocks, HBM
bandwidth, DMA fixed costs and the per-instruction cost constants. The values
come from the AWS Neuron architecture guides (see ``DESIGN.md``); the few that
are modelling choices of tn (marked *model*) are documented where they are set.

>>> from tn.neuron.arch import get_arch
>>> a = get_arch("trn2")
>>> a.sbuf_partition_bytes, a.psum_bank_bytes, a.clock_hz["pe"]
(229376, 2048, 2400000000.0)

Engines and queues
------------------
Queue ids (as encoded in a program): ``0`` TensorE (``pe``), ``1`` ScalarE
(``act``), ``2`` VectorE (``dve``), ``3`` GpSimd (``pool``), ``4 ..
4+dma_queues-1`` the DMA queues. Each queue executes its instructions in order.

Timing model
------------
Sources (aws-neuron/aws-neuron-sdk, cited by short name below and next to each field):
[arch-v2] ``nki/guides/architecture/trainium_inferentia2_arch.rst``; [arch-v3]
``nki/guides/architecture/trainium2_arch.rst``; [isa] the "Estimated instruction cost" of each
``nki.isa`` instruction (SDK 2.25 API docs) and the engine-selection table of ``nki/api/nki.api.shared.rst``;
[perf] ``nki/deep-dives/nki_perf_guide.rst``; [dma] ``nki/get-started/about/nki-dma-overview.rst``;
[dma-bw] ``nki/deep-dives/nki-dma-bandwidth-guide.rst``; [dge] ``nki/deep-dives/nki-dge.rst``.

* Compute engines: an instruction *occupies* its engine (its queue is busy, the
  next instruction of the same engine may start after it) for its issue
  interval, the [isa] formula of :func:`tn.neuron.isa.cost_cycles` in cycles of
  the engine's clock (MIN_II = 64 cycles; the rules and their sources are listed
  there). Its result is committed ``static_overhead_cycles`` (ScalarE, VectorE,
  GpSimd) + 2 x ``access_cycles`` (the SBUF/PSUM access start-up of its read
  and of its write) later: that is *latency*, seen only by instructions that
  wait for this one (semaphores), not occupancy. A matmul accumulating into the
  PSUM group of the previous matmul on TensorE waits for its issue interval only.
  A chain of dependent 1-element ScalarE instructions therefore starts one every
  64 + 100 + 2 x 60 = 284 cycles ([perf] measured 264). On trn1 (NeuronCore-v2)
  VectorE and GpSimd share one SBUF port and ScalarE and VectorE one PSUM port
  (``shared_ports``): an instruction holds the port(s) it needs for its issue
  interval and waits for an idle span of them.
* ScalarE activation tables (*assumption*, no published cost): an activation
  whose function needs another table than the one loaded last on ScalarE
  first loads it, ``act_table_switch_cycles`` more ScalarE cycles of
  occupancy; identity/copy, relu, square, abs and sign need no table. Each
  program starts with no table loaded.
* DMA ([dma], [dma-bw]): a core has ``dma_engines`` (16) DMA engines, each
  moving ``dma_engine_bytes_per_s``; engine ``e`` serves SBUF partitions
  ``8e .. 8e+7``, so a transfer uses the engines of the partitions it touches
  (a ``[4, 4096]`` tile: one engine; ``[128, F]``: all 16); an HBM -> HBM copy
  is spread over all engines (*assumption*: no partition side to split by).
  tn's DMA queue ``q`` is queue ``q`` of every engine; an engine serves the
  transfers of one queue in order and shares its bandwidth between queues (the
  hardware's round robin, modelled by filling idle time in time order). Which
  queue a transfer uses is the program's choice; [dma] ties it to the trigger
  engine and the descriptor generation, which the hand-written kernels follow
  (:data:`tn.neuron.nki_matmul.IO_QUEUE_RULE`). A
  transfer starts moving data ``dma_fixed_ns`` after its trigger (descriptor
  setup and semaphore-to-start latency, [dma-bw] ~1300 ns); that latency
  overlaps the transfers ahead of it on the queue (a queue holds several
  outstanding transfers), so back-to-back DMAs on a queue do not pay it
  serially. A queue may trigger its next DMA ``dma_issue_ns`` after the
  previous trigger (trn2: the hardware descriptor generator's ~600 ns per DMA
  instruction, [arch-v3]/[dge]). Each engine moves its share of ``bytes +
  runs * dma_chunk_overhead_bytes`` (``runs``: contiguous runs, i.e.
  descriptors). A queue starts a transfer on an engine no sooner than
  ``dma_transfer_min_ns`` after its previous one there (the per-transfer
  packet rate that makes small DMAs overhead-bound; both constants read off
  [dma]'s throughput-vs-bytes-per-partition figure, see the fields); other
  queues use the engine meanwhile. The HBM bytes read and written
  (an HBM -> HBM copy counts both) also pass the core's share of HBM
  bandwidth, ``hbm_bytes_per_s``. The DMA queue's busy time is its transfer
  span.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import config
from ..errors import NeuronError

__all__ = ["Arch", "TRN1", "TRN2", "get_arch", "default_arch_name", "ENGINES", "ENGINE_NAMES", "NUM_ENGINES"]

#: Compute engines in queue-id order (queue id = index).
ENGINES = ("pe", "act", "dve", "pool")
#: Human names of the compute engines, by short name.
ENGINE_NAMES = {"pe": "TensorE", "act": "ScalarE", "dve": "VectorE", "pool": "GpSimd"}
#: Number of compute-engine queues; DMA queues follow them.
NUM_ENGINES = 4


@dataclass(frozen=True)
class Arch:
    """One NeuronCore configuration: memory geometry, clocks, bandwidth and cost constants."""

    name: str
    generation: str
    partitions: int
    sbuf_partition_bytes: int
    psum_partition_bytes: int
    psum_bank_bytes: int
    clock_hz: dict = field(default_factory=dict)
    hbm_bytes_per_s: float = 0.0
    dma_queues: int = 16
    #: [dma] "Each NeuronCore (v2-v4) is paired with 16 DMA engines"; each serves 128 / 16 = 8 partitions.
    dma_engines: int = 16
    #: Per-engine DMA bandwidth, [dma-bw] table "BW / Engine" (17 B/ns trn1, 23 B/ns trn2; [dma] gives 27.2 GB/s
    #: as the theoretical peak, [dma] example 1 measures 32 KiB in 1416 ns on trn2 = 23.1 B/ns).
    dma_engine_bytes_per_s: float = 23e9
    #: [dma-bw]: "descriptor setup, synchronization, and semaphore-to-start latency (~1300 ns cross-engine)".
    dma_fixed_ns: float = 1300.0
    #: Time a DMA queue is occupied by triggering one DMA (see the TRN1/TRN2 tables).
    dma_issue_ns: float = 0.0
    #: Per-descriptor (contiguous run) overhead of a DMA engine in byte-equivalents, and (next field) the
    #: per-transfer minimum: both read off [dma]'s figure "DMA Throughput varying Bytes per Partition for
    #: p_dim = 128" (nki-dma-intro-1.jpg; the points, as fractions of the 32 KiB plateau: 256 B 0.105, 512 B
    #: 0.208, 1 KiB 0.423, 2 KiB 0.813, 4 KiB 0.964, 8 KiB 0.983, 16 KiB 0.990). Throughput proportional to
    #: the bytes up to 1 KiB means a fixed time per transfer; the least-squares fit of
    #: ``b / max(T, b + o)`` to the points gives T = 2424 B and o = 185 B per partition (every point within
    #: 4 %). [arch-v2]: "some performance overhead at both DMA buffer and transfer levels"; [dma-bw]: with
    #: small payloads "the DMA packet rate ... becomes the limiting factor". Not fitted to any anchor.
    dma_chunk_overhead_bytes: int = 185
    #: Per-transfer minimum in bytes per partition (see above): a DMA queue starts a transfer on an engine
    #: no sooner than :attr:`dma_transfer_min_ns` (the time the engine moves this many bytes on each of its
    #: partitions) after its previous one there. *Assumption*: the limit is per queue (the curve is one
    #: stream of DMAs; "DMA transfers within a queue on the same DMA engine are executed in order", [dma]), so
    #: transfers of other queues use the engine's bandwidth meanwhile. [arch-v2] reads against it: "Each DMA
    #: engine can process one DMA transfer at a time", which would make the minimum hold the engine for every
    #: queue. Kept per queue here: the compiler spreads its DMAs over all 16 queues, so the engine reading would
    #: change every compiled program's time (left to a decision, issue 16: holding each engine max(minimum,
    #: bytes time) per transfer made the fingerprint workloads 0.5-33 % slower, the conv net 2.7x, BERT's layer
    #: +13-16 %); the hand-written kernels put all their IO on one queue
    #: (:data:`tn.neuron.nki_matmul.IO_QUEUE_RULE`), where the two readings agree (within 2 %).
    #: Known disagreement (issue 16, unresolved): the published trn1 matmul v1 and trn2 tiled kernels interleave
    #: a small load with a large one on one queue and pay ~the small one's bandwidth time for it, not a second
    #: minimum; dropping the minimum (the fixed cost then only once per queue start, pipelined) fits those two
    #: but halves the published v2/v3 times, and reading the curve per descriptor charges what the minimum does
    #: (``bench/fidelity.py``: DMA_RULE_TESTED and the rows' notes). No published cost splits the two.
    dma_transfer_min_partition_bytes: int = 2424
    #: [arch-v2] "Tensor access overhead": ~60 cycles to start an SBUF/PSUM access (NC-v2; kept for v3).
    access_cycles: int = 60
    #: [arch-v2] VectorE cost model: "a static instruction overhead of 100 engine cycles" for dependent
    #: instructions; [perf] "~100 cycles" on ScalarE. Applied to ScalarE, VectorE and GpSimd (GpSimd:
    #: *assumption*, no number published); TensorE has none (its costs are published as initiation intervals).
    static_overhead_cycles: int = 100
    #: NeuronCore-v3 extras ([arch-v3]): VectorE performance modes for bf16/fp16, TensorE fp32 transpose mode.
    fast_modes: bool = False
    #: NeuronCore-v2 ([arch-v2] "Concurrent SBUF/PSUM accesses by engines"): VectorE and GpSimd cannot access SBUF
    #: in parallel, VectorE and ScalarE cannot access PSUM in parallel; lifted on NeuronCore-v3 ([arch-v3]).
    shared_ports: bool = False
    #: *Assumption*: the NKI docs say a change of activation function may reload ScalarE's table (and advise
    #: grouping activations by function) but publish no cost. A table load is a small transfer into the engine,
    #: so we charge about what a short DMA costs: 1024 ScalarE cycles (0.73 us on trn1, 0.85 us on trn2).
    act_table_switch_cycles: int = 1024
    matmul_max_k: int = 128
    matmul_max_m: int = 128
    matmul_max_n: int = 512
    max_free_elems: int = 65536
    bn_stats_max_free: int = 512
    peak_flops_bf16: float = 0.0
    peak_flops_fp32: float = 0.0

    @property
    def sbuf_bytes(self) -> int:
        """Total SBUF bytes (partitions x partition bytes)."""
        return self.partitions * self.sbuf_partition_bytes

    @property
    def psum_bytes(self) -> int:
        """Total PSUM bytes (partitions x partition bytes)."""
        return self.partitions * self.psum_partition_bytes

    @property
    def psum_banks(self) -> int:
        """Number of PSUM banks (each ``psum_bank_bytes`` per partition)."""
        return self.psum_partition_bytes // self.psum_bank_bytes

    @property
    def dma_transfer_min_ns(self) -> float:
        """Minimum ns between the starts of two transfers of one DMA queue on one engine: the engine's time
        to move :attr:`dma_transfer_min_partition_bytes` on each of the partitions it serves (trn1 ~1141 ns,
        trn2 ~843 ns)."""
        per_engine = -(-self.partitions // self.dma_engines)
        return per_engine * self.dma_transfer_min_partition_bytes / self.dma_engine_bytes_per_s * 1e9

    @property
    def num_queues(self) -> int:
        """Compute-engine queues plus DMA queues."""
        return NUM_ENGINES + self.dma_queues

    def queue_name(self, q: int) -> str:
        """Display name of queue ``q`` (``TensorE``, ..., ``DMA3``)."""
        if 0 <= q < NUM_ENGINES:
            return ENGINE_NAMES[ENGINES[q]]
        return f"DMA{q - NUM_ENGINES}"

    def queue_clock_hz(self, q: int) -> float:
        """Clock of the engine behind queue ``q`` (DMA queues report 1 GHz: their costs are in ns)."""
        if 0 <= q < NUM_ENGINES:
            return self.clock_hz[ENGINES[q]]
        return 1e9

    def result_latency_cycles(self, engine: str) -> int:
        """Cycles from the end of an instruction's issue interval on ``engine`` (``"pe"``, ``"act"``, ``"dve"``,
        ``"pool"``) until its result is committed: the static instruction overhead (not on TensorE) and the
        SBUF/PSUM access start-up of its read and of its write (see the module docstring)."""
        return (0 if engine == "pe" else self.static_overhead_cycles) + 2 * self.access_cycles

    def timing_vector(self):
        """Float64 numpy vector of the timing constants the native engine reads (see ``engine.pyx``)."""
        return np.array(
            [self.clock_hz["pe"], self.clock_hz["act"], self.clock_hz["dve"], self.clock_hz["pool"],
             self.hbm_bytes_per_s, self.dma_fixed_ns, float(self.dma_chunk_overhead_bytes),
             float(self.access_cycles), float(self.act_table_switch_cycles), float(self.dma_engines),
             self.dma_engine_bytes_per_s, self.dma_issue_ns, float(self.static_overhead_cycles),
             1.0 if self.fast_modes else 0.0, 1.0 if self.shared_ports else 0.0, self.dma_transfer_min_ns],
            dtype=np.float64,
        )

    def limits_vector(self):
        """Int64 numpy vector of the memory geometry and limits the native engine checks."""
        return np.array(
            [self.partitions, self.sbuf_partition_bytes, self.psum_partition_bytes, self.psum_bank_bytes,
             self.num_queues, self.matmul_max_k, self.matmul_max_m, self.matmul_max_n,
             self.max_free_elems, self.bn_stats_max_free],
            dtype=np.int64,
        )


#: NeuronCore-v2 (Trainium1): 2 cores per chip sharing 820 GB/s of HBM.
TRN1 = Arch(
    name="trn1",
    generation="NeuronCore-v2",
    partitions=128,
    sbuf_partition_bytes=192 * 1024,
    psum_partition_bytes=16 * 1024,
    psum_bank_bytes=2 * 1024,
    clock_hz={"pe": 2.8e9, "act": 1.4e9, "dve": 1.12e9, "pool": 1.4e9},
    hbm_bytes_per_s=820e9 / 2,
    dma_queues=16,
    dma_engine_bytes_per_s=17e9,
    # *assumption*: trn1 DMAs run on descriptors the runtime generated before execution (static DMA, [arch-v3]
    # "Descriptor Generation Engine"), so a trigger is one sequencer instruction: no queue occupancy modelled
    dma_issue_ns=0.0,
    shared_ports=True,
    peak_flops_bf16=2 * 128 * 128 * 2.8e9,
    peak_flops_fp32=2 * 128 * 128 * 2.8e9 / 4,
)

#: NeuronCore-v3 (Trainium2, the default): 8 cores per chip sharing 2.9 TB/s of HBM.
TRN2 = Arch(
    name="trn2",
    generation="NeuronCore-v3",
    partitions=128,
    sbuf_partition_bytes=224 * 1024,
    psum_partition_bytes=16 * 1024,
    psum_bank_bytes=2 * 1024,
    clock_hz={"pe": 2.4e9, "act": 1.2e9, "dve": 0.96e9, "pool": 1.2e9},
    hbm_bytes_per_s=2.9e12 / 8,
    dma_queues=16,
    dma_engine_bytes_per_s=23e9,
    # [arch-v3]/[dge]: "Each DGE-based DMA instruction takes about 600 ns"; tn's programs are assumed to use
    # the hardware DGE (the recommended mode on trn2)
    dma_issue_ns=600.0,
    fast_modes=True,
    peak_flops_bf16=2 * 128 * 128 * 2.4e9,
    peak_flops_fp32=2 * 128 * 128 * 2.4e9 / 4,
)

_ARCHS = {"trn1": TRN1, "trn2": TRN2, "NeuronCore-v2": TRN1, "NeuronCore-v3": TRN2}


def default_arch_name() -> str:
    """The architecture in force: ``TN_ARCH`` / ``tn.config.set(arch=...)``, else the one of ``TN_INSTANCE``
    (``trn1.*`` instances are trn1), else ``"trn2"``."""
    name = config.get("arch")
    if name:
        return name
    instance = config.get("instance")
    if instance:
        return "trn1" if instance.startswith("trn1") else "trn2"
    return "trn2"


def get_arch(arch=None) -> Arch:
    """The :class:`Arch` for ``arch`` (an Arch, ``"trn1"``, ``"trn2"``; ``None``: :func:`default_arch_name`)."""
    if arch is None:
        return _ARCHS[default_arch_name()]
    if isinstance(arch, Arch):
        return arch
    try:
        return _ARCHS[arch]
    except (KeyError, TypeError):
        raise NeuronError(f"unknown NeuronCore architecture {arch!r}: use 'trn1' or 'trn2' (the default)") from None
