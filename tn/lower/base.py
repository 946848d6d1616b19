# The contract between the compiler framework and the lowerings: CannotLower, LowerCtx, the @lowering decorator.
"""What every lowering of :mod:`tn.lower` codes against.

A *lowering* turns one IR equation into NeuronCore instructions::

    from tn.lower.base import CannotLower, lowering

    @lowering("neg")
    def _neg(ctx, eqn, ins, outs):
        ...emit into ctx.prog...

Signature: ``fn(ctx: LowerCtx, eqn: tn.ir.Eqn, ins: list, outs: list) -> None``.

* ``ins[i]`` is a :class:`tn.neuron.HbmTensor` (contiguous row-major, the
  Var's shape; a 0-d Var has shape ``(1,)``) for a Var input, or the plain
  Python value for a :class:`tn.ir.Literal` input.
* ``outs[j]`` is an HbmTensor for each output Var.
* The lowering emits instructions into ``ctx.prog`` that read its inputs and
  completely write its outputs (HBM -> SBUF -> engines -> HBM), tiling to the
  SBUF/PSUM limits, and frees every SBUF/PSUM tile it allocated before it
  returns. Dependencies between instructions are derived by the Program from
  operand overlap, so lowerings emit in plain sequential order.
* When it cannot handle a case (dtype, shape, attribute) it raises
  :class:`CannotLower` with a reason, *preferably before emitting anything*
  (if it raises later the compiler rebuilds the program without it, which
  costs compile time). The compiler then runs that equation on the host
  through ``op.impl``, visibly (counted per op in ``NeuronExecutable.stats``);
  in strict mode (``strict=True`` / ``TN_STRICT=1``) it is an error.
* Dtypes: ``ctx.neuron_dtype(var.dtype)`` maps torch dtypes to NeuronCore
  dtype names and raises CannotLower for float64/complex/int16/int8.
  int64 exists in HBM and on DMA only (no engine computes on it).

Fusion hooks (how lowerings cooperate with the framework)
---------------------------------------------------------
1. **Storing output tiles: ``ctx.store(dst, tile)``.** A lowering that
   produces an output tile by tile (matmul, reductions, elementwise) should
   write each finished tile with ``ctx.store(outs[j][region], tile)`` instead
   of ``ctx.prog.dma_copy``. ``dst`` is a view of one of ``outs`` obtained by
   basic indexing/reshape of the HbmTensor (so the framework can find the
   same region in other tensors); ``tile`` may be in SBUF or PSUM (fp32) and
   may have another dtype than ``dst`` (the store casts). By default it
   evacuates PSUM / casts if needed and DMAs to ``dst``. When the compiler
   has fused an *epilogue* (a chain of elementwise equations consuming this
   output, e.g. ``+ bias``, ``gelu``, ``* scale``, a residual add), the same
   call applies the chain to the tile on chip (ScalarE/VectorE; other
   operands of the chain are loaded for the same region, broadcasting by
   stride-0 access patterns) and writes the chain's result instead: the
   intermediate never goes to HBM. ``ctx.store`` has finished reading
   ``tile`` when it returns (the program's dependency tracking orders later
   writes to it), so the lowering may free or reuse it right away.
2. **Elementwise tile rules: ``op.tile_rule`` (``@tn.lower.elementwise.tile_rule``).**
   ``eqn.op.tile_rule(ctx, eqn, out_tile, in_tiles)`` computes one
   elementwise op on SBUF tiles of equal partition count and free shape
   (``in_tiles[i]`` is a Tile, possibly a stride-0 broadcast view or a PSUM
   tile, or a Python scalar for a Literal). Any lowering may use them to
   compute elementwise math on its own tiles; the fusion engine
   (:mod:`tn.lower.fusion`) runs chains of them, and row reductions over the
   last axis (softmax, layer/RMS norm), with every intermediate in SBUF.

``ctx.scratch(shape, dtype)`` gives a fresh HBM temporary (spill space).
``ctx.range_check(bad_tile)`` flags results the chip computed out of its
exact range (the compiler then recomputes that call on the host, visibly).

Helpers shared by the lowerings: :class:`TileScope` (tiles freed together),
:class:`Ring` (tiles handed out in turn, so consecutive users overlap),
:class:`Copier` (PSUM/SBUF copies alternating VectorE/ScalarE) and
:func:`dataflow` (producer/users/outputs of an IR, for the planners).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from .. import ops
from ..errors import ArgumentValueError
from ..ir import Var
from ..neuron import isa

__all__ = ["CannotLower", "ExecutableWrapper", "HandoffError", "LowerCtx", "lowering", "NEURON_DTYPES", "neuron_dtype", "TileScope", "resident_view",
           "handoff_shape", "Ring", "Copier", "dataflow"]


class CannotLower(Exception):
    """Raised by a lowering that cannot handle this equation (dtype, shape or attribute).

    The message says why; the compiler runs the equation on the host instead
    (or raises :class:`tn.UnsupportedOpError` with that reason in strict mode).
    """


class HandoffError(CannotLower):
    """A lowering cannot keep or read ``var`` in SBUF as the compiler planned: it rebuilds the program with
    that value going through HBM (see :meth:`LowerCtx.publish`)."""

    def __init__(self, var: Any, reason: str):
        super().__init__(reason)
        self.var = var


#: torch dtype -> NeuronCore dtype name.
NEURON_DTYPES: Dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def neuron_dtype(dtype: torch.dtype) -> str:
    """NeuronCore dtype name of a torch dtype; raises :class:`CannotLower` when the chip has none."""
    try:
        return NEURON_DTYPES[dtype]
    except KeyError:
        raise CannotLower(f"dtype {dtype} has no NeuronCore equivalent (the chip computes in fp32/bf16/fp16/"
                          f"int32/uint8/bool); cast it first or let it run on the host") from None


class ExecutableWrapper:
    """Base of an executable that adapts another's calling convention (complex pairs, status checks): its own
    fields are the names in ``_OWN``; every other attribute (``stats``, ``last_profile``, ``schedule``...) is
    the wrapped executable's ``exe``, read and written (a door's setting, e.g. tn.device.windows turning the
    layout variant off, reaches the real executable)."""

    _OWN: Tuple[str, ...] = ("exe",)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["exe"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.exe, name, value)


class UnitOrders:
    """What the emitter asks of the lowering of the current schedule unit, and what the lowering answers.

    The emitter (:mod:`tn.lower.emit`) fills one from the unit of the
    :class:`tn.lower.schedule.Schedule` it emits (the planned SBUF hand-offs,
    the prologues bound to their HBM sources, a fused epilogue's store hook
    and bias) and checks the answers after the lowering; lowerings read and
    answer it through :attr:`LowerCtx.unit` and never plan anything
    themselves.

    Attributes:
        publish: outputs the lowering should leave in SBUF (:meth:`LowerCtx.wants`; the schedule's hand-offs).
        prologues: prologues offered to the lowering (matmul operand Var -> ``tn.lower.prologue.Bound``); it
            applies them while it transposes the operand's source and marks them taken.
        store_hook: the fused epilogue's hook (see :meth:`LowerCtx.store`), or None.
        matmul_bias: a row-vector HbmTensor the matmul may add to its result in PSUM (its fused epilogue starts
            with ``+ bias``), or None.
        taken: answer: the resident Vars the lowering read from SBUF (:meth:`LowerCtx.take`).
        bias_added: answer: the matmul added ``matmul_bias``.
    """

    __slots__ = ("publish", "prologues", "store_hook", "matmul_bias", "taken", "bias_added")

    def __init__(self) -> None:
        self.publish: set = set()
        self.prologues: Dict[Any, Any] = {}
        self.store_hook: Optional[Callable[[Any, Any], bool]] = None
        self.matmul_bias: Any = None
        self.taken: set = set()
        self.bias_added = False


class LowerCtx:
    """State shared by the lowerings of one program.

    Attributes:
        prog: the :class:`tn.neuron.Program` being built.
        arch: its :class:`tn.neuron.Arch`.
        eqn: the equation being lowered (set by the compiler before each call).
        unit: the :class:`UnitOrders` of the schedule unit being lowered (set by the emitter).
    """

    def __init__(self, prog: Any):
        self.prog = prog
        self.arch = prog.arch
        self.eqn = None
        self._nscratch = 0
        #: what the emitter asks of the current lowering (the schedule's plan for its unit) and its answers.
        self.unit = UnitOrders()
        #: ``[P, 1]`` fp32 accumulator of range-check failures (see :meth:`range_check`), or None.
        self.flag_tile = None
        #: the program's :class:`tn.lower.layout.WeightStream` of laid-out weight groups, or None.
        self.weights = None
        #: SBUF hand-off (see :meth:`publish`): Vars whose whole value sits in an SBUF tile ``[rows, cols]``
        #: (row-major), by Var, across the program's units until their last consumer.
        self.resident: Dict[Any, Any] = {}

    # ------------------------------------------------------------------ SBUF hand-off
    def wants(self, var: Any) -> bool:
        """Whether the compiler asks the current lowering to leave output ``var`` in SBUF (its consumers,
        the next lowerings of the program, read it there; the HBM copy is then not written)."""
        return var in self.unit.publish

    def publish(self, var: Any, tile: Any) -> None:
        """Hand over ``tile`` (SBUF ``[rows, cols]``: ``var`` row-major, rows = all axes but the last) as the
        value of output ``var``; the compiler frees it after its last consumer. Only for :meth:`wants` Vars,
        and then the lowering does not store ``var`` to HBM."""
        self.resident[var] = tile

    def take(self, var: Any) -> Any:
        """The SBUF tile holding input ``var`` (``[rows, cols]``, row-major) when the producer left it there, else
        None. A lowering that gets a tile must read ``var`` from it: its HBM copy may not have been written."""
        t = self.resident.get(var)
        if t is not None:
            self.unit.taken.add(var)
        return t

    def range_check(self, bad: Any) -> None:
        """Record that the program's results are invalid where ``bad`` (an SBUF tile) is non-zero.

        Used where the chip computes a value approximately by design, e.g.
        int64 values carried as int32 low words and computed in fp32 (exact
        below 2**24). The compiler turns the accumulated flag into a program
        output; when it is set after a run, the executable recomputes that
        call on the host (counted in the profile's ``host_ops``).
        """
        prog = self.prog
        if self.flag_tile is None:
            self.flag_tile = prog.sbuf((self.arch.partitions, 1), "float32", name="range_flag")
            prog.memset(self.flag_tile, 0.0, engine="vector")
        p = bad.shape[0]
        red = prog.sbuf((p, 1), "float32")
        axes = tuple(range(1, len(bad.shape)))
        if axes:
            prog.tensor_reduce(red, bad, "max", axis=axes)
        else:
            prog.tensor_copy(red, bad)
        prog.tensor_tensor(self.flag_tile[:p], self.flag_tile[:p], red, "max")
        prog.free(red)

    def scratch(self, shape, dtype) -> Any:
        """A fresh HBM temporary of ``shape`` (``()`` becomes ``(1,)``) and ``dtype`` (torch dtype or name)."""
        if isinstance(dtype, torch.dtype):
            dtype = self.neuron_dtype(dtype)
        shape = tuple(int(s) for s in shape) or (1,)
        self._nscratch += 1
        return self.prog.hbm(f"_tmp{self._nscratch}", shape, dtype, kind="scratch")

    @staticmethod
    def neuron_dtype(dtype: torch.dtype) -> str:
        """NeuronCore dtype name of a torch dtype (raises :class:`CannotLower` for float64, complex, ...)."""
        return neuron_dtype(dtype)

    def store(self, dst: Any, tile: Any) -> None:
        """Write an output ``tile`` (SBUF or PSUM, any dtype) to ``dst`` (a view of one of the outputs).

        Applies a fused epilogue when the compiler installed one (see the
        module docstring); otherwise casts/evacuates as needed and DMAs.
        """
        hook = self.unit.store_hook
        if hook is not None and hook(dst, tile):
            return
        store_tile(self.prog, dst, tile)


class TileScope:
    """SBUF/PSUM tiles allocated for one lowering and freed together (newest first) when the block ends.

    ::

        with TileScope(prog) as tiles:
            a = tiles.sbuf((128, 512), "bfloat16", "a")
            acc = tiles.psum((128, 512), "float32", "acc")
            ...                                   # freed on exit, also when emission raises
    """

    def __init__(self, prog: Any):
        self.prog = prog
        self.tiles: List[Any] = []

    def sbuf(self, shape: Any, dtype: str, name: Optional[str] = None) -> Any:
        """An SBUF tile that lives until the scope ends."""
        t = self.prog.sbuf(shape, dtype, name=name)
        self.tiles.append(t)
        return t

    def psum(self, shape: Any, dtype: str, name: Optional[str] = None) -> Any:
        """A PSUM tile that lives until the scope ends."""
        t = self.prog.psum(shape, dtype, name=name)
        self.tiles.append(t)
        return t

    def __enter__(self) -> "TileScope":
        return self

    def __exit__(self, *exc: Any) -> bool:
        for t in reversed(self.tiles):
            self.prog.free(t)
        self.tiles.clear()
        return False


class Ring:
    """Tiles handed out in turn (PSUM banks, staging buffers), so consecutive users overlap."""

    def __init__(self, tiles: Any):
        self.tiles = list(tiles)
        self.i = 0

    def take(self) -> Any:
        """The next tile of the ring."""
        t = self.tiles[self.i % len(self.tiles)]
        self.i += 1
        return t


class Copier:
    """PSUM/SBUF copies with dtype casts, alternating between VectorE and ScalarE (the first on VectorE)."""

    def __init__(self, prog: Any):
        self.prog = prog
        self.n = 0

    def __call__(self, out: Any, src: Any) -> None:
        """``tensor_copy(out, src)`` on the next engine of the alternation."""
        # tensor_copy on ScalarE costs what an identity activation does in the model, and its native kernel
        # is several times faster for bf16 operands
        self.n += 1
        self.prog.tensor_copy(out, src, engine="vector" if self.n % 2 else "scalar")


def dataflow(ir: Any) -> Tuple[Dict[Var, int], Dict[Var, List[int]], Set[Var]]:
    """``(producer, users, outset)`` of ``ir`` for the planners: the index of the equation that makes each Var,
    the indices of the equations that read each Var (in order, once per reading operand), and the Vars among
    the program's outputs."""
    producer: Dict[Var, int] = {}
    users: Dict[Var, List[int]] = {}
    for k, e in enumerate(ir.eqns):
        for v in e.outputs:
            producer[v] = k
        for a in e.inputs:
            if isinstance(a, Var):
                users.setdefault(a, []).append(k)
    outset = {a for a in ir.outputs if isinstance(a, Var)}
    return producer, users, outset


def handoff_shape(var: Any) -> Optional[tuple]:
    """``(rows, cols)`` of ``var`` as an SBUF hand-off tile (rows = product of all axes but the last)."""
    shape = tuple(int(s) for s in getattr(var, "shape", ())) or (1,)
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows, shape[-1]


def resident_view(tile: Any, cols: int, view: Any) -> Any:
    """The SBUF view of resident ``tile`` (``[rows, cols]``, a value row-major) matching ``view``, an HBM view
    of the same value whose first axis walks rows (stride ``cols``) and whose other axes stay inside a row.
    None when ``view`` has another shape of access."""
    dims = list(view.dims)
    if not dims:
        return None
    n0, s0 = dims[0]
    r, c = divmod(view.offset, cols)
    if n0 > 1 and s0 != cols:
        return None
    free = dims[1:]
    if any(s < 0 for _, s in free) or c + sum((n - 1) * s for n, s in free) >= cols or r + n0 > tile.shape[0]:
        return None
    sub = tile[r:r + n0]
    return sub._derive(offset=sub.offset + c * sub.itemsize, dims=[(n, s) for n, s in free] or [(1, 1)])


def store_tile(prog: Any, dst: Any, tile: Any) -> None:
    """Plain store: PSUM or dtype-mismatched tiles go through an SBUF copy (cast), then a DMA to ``dst``."""
    if tile.mem == isa.MEM_PSUM or tile.dtype != dst.dtype:
        tmp = prog.sbuf(tile.shape, dst.dtype)
        prog.tensor_copy(tmp, tile, engine="scalar" if tile.mem == isa.MEM_PSUM else "vector")
        prog.dma_copy(dst, tmp)
        prog.free(tmp)
    else:
        prog.dma_copy(dst, tile)


def stage_vector_rows(prog: Any, st: Any, flat: Any, n: int, part: int = 128) -> None:
    """DMA a flat HBM vector of ``n`` elements into SBUF tile ``st`` as rows of ``part``: element ``r*part + p`` at
    ``[r, p]``, the unused tail of the last row zeroed. One TensorE transpose of ``st`` then gives the vector as
    per-partition columns (the layout per-feature scales, shifts and biases take in feature-major lowerings)."""
    rows, rem = divmod(n, part)
    if rem:
        prog.memset(st, 0.0, engine="gpsimd")
    if rows:
        prog.dma_copy(st[:rows, :], flat[0:rows * part].reshape(rows, part))
    if rem:
        prog.dma_copy(st[rows:rows + 1, :rem], flat[rows * part:n].reshape(1, rem))


def lowering(*op_names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: register the function as the lowering of the ops ``op_names`` (sets ``OPS[name].lowering``)."""
    for name in op_names:
        if name not in ops.OPS:
            raise ArgumentValueError(f"@lowering({name!r}): tn.ops has no op named {name!r}; the core ops are listed in "
                                     f"tn.ops.OPS")

    def deco(fn: Callable[..., None]) -> Callable[..., None]:
        for name in op_names:
            ops.OPS[name].lowering = fn
        return fn

    return deco
