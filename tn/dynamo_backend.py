# torch.compile(backend="neuron"): Dynamo graphs through AOTAutograd into tn's tracer, passes and NeuronCore compiler.
"""The ``"neuron"`` backend of ``torch.compile``.

Dynamo captures FX graphs (breaking the graph where Python needs real values,
as with any backend); AOTAutograd splits each into a forward and, when
gradients are needed, a backward graph of aten ops. Each of those graphs is
handed to :func:`tn.jit` as an ordinary Python function: tn traces it into
its IR (shapes only), optimises it and compiles it for the NeuronCore model
(``backend="neuron"``, or whatever :func:`tn.jit` backend is named in
``options={"tn_backend": ...}``), cached per input signature. Python ints
among the graph inputs (dynamic sizes) are static arguments of the jitted
graph: each distinct value compiles once.

Use::

    import tn
    model = torch.compile(model, backend="neuron")

Inputs on the ``neuron`` device (``model.to("neuron")``) are read in place
(the device's memory is host memory) and results come back as device
tensors; in-place updates (BatchNorm running stats, AOTAutograd's input
mutations) land in device memory. ``F.scaled_dot_product_attention`` is
traced through its math backend, so attention differentiates into ops tn
compiles; the fused CPU kernel's backward op, which still appears in the
graphs of ``nn.MultiheadAttention``, is decomposed by :mod:`tn.ops.attention_grad`.
:func:`host_ops` lists the ops of the compiled graphs that run on the host
instead of the NeuronCore (none for an MLP, GPT-2, Llama or BERT).

The name is registered through the ``torch_dynamo_backends`` entry point in
tn's package metadata: Dynamo finds it on first use, whether or not ``tn``
was imported (registering from ``import tn`` as well would make Dynamo's
entry-point loader, which imports tn, register the name twice).
:func:`register` registers by hand where package metadata is missing.
:func:`graphs_compiled` counts the graphs handed to tn.

Where Dynamo refuses by design (Python branching on, or taking an op's constant from, a tensor's values
inside ``torch.nn``: ``BatchNorm(momentum=None)`` in training, ``GaussianNLLLoss``), it runs that call
eagerly: on the ``neuron`` device that is tn's device door, whose Python Dynamo must not trace as user code
(:func:`skip_tn_runtime_in_dynamo`).
"""
from __future__ import annotations

import contextlib
import logging
import operator
import pkgutil
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch._dynamo.config as dynamo_config
from torch._decomp import core_aten_decompositions
from torch._dynamo import disable, trace_rules
from torch._dynamo.backends import registry
from torch._dynamo.backends.common import aot_autograd
from torch._library.fake_class_registry import FakeScriptObject
from torch._library.opaque_object import is_opaque_value
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import config, ops
from .device.allocator import cpu_alias
from .device.eager import to_device
from .errors import ArgumentTypeError, ArgumentValueError, UnsupportedOpError
from .jit import jit
from .ops.low_precision import fp32_gradients_while_tracing, is_low_precision
from .ops.table import DECOMPOSITIONS
from .profile import note_host_op

__all__ = ["neuron_backend", "register", "allow_rnn_in_dynamo", "skip_tn_runtime_in_dynamo", "capture_value_reads", "graphs_compiled", "host_ops",
           "host_ops_of", "executables_of", "compiled_graphs", "graphs_run_op_by_op", "BACKEND_NAME",
           "CAPTURE_SETTINGS", "OP_BY_OP"]

log = logging.getLogger("tn")

#: The name torch.compile knows the backend by.
BACKEND_NAME = "neuron"

_count_lock = threading.Lock()
_graphs_compiled = 0
_jitted_graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()


def graphs_compiled() -> int:
    """How many AOTAutograd graphs (forward and backward count separately) tn has compiled in this process."""
    return _graphs_compiled


def executables_of(jitted: Any) -> List[Any]:
    """The compiled programs (backend run objects) a :func:`tn.jit` function or module holds, one per signature.

    With the ``"neuron"`` backend these are :class:`tn.lower.NeuronExecutable`
    s (``.stats``, ``.last_profile``).
    """
    attrs = getattr(jitted, "__dict__", {})
    core = attrs.get("_core") or attrs.get("_tn_core")  # JittedFunction / JittedModule
    if core is None or not hasattr(core, "cache"):
        raise ArgumentTypeError(f"host_ops_of/executables_of: expected a tn.jit function or module, got "
                                f"{type(jitted).__name__}")
    with core.lock:
        return [e.run for e in core.cache.values()]


def compiled_graphs() -> List[Any]:
    """The :func:`tn.jit` functions of every graph torch.compile(backend="neuron") handed to tn (still alive)."""
    return list(_jitted_graphs)


def host_ops_of(jitted: Any) -> Dict[str, int]:
    """``{op: count}`` of IR equations that run on the host, over every program ``jitted`` has compiled.

    ``jitted`` is a :func:`tn.jit` function or module. Counts are static (per
    compiled program, not per call) and come from the ``"neuron"`` backend's
    :class:`tn.lower.NeuronExecutable` ``stats``; other backends report none.
    """
    total: Dict[str, int] = {}
    for run in executables_of(jitted):
        stats = getattr(run, "stats", None)
        for name, n in (stats or {}).get("host_ops", {}).items():
            total[name] = total.get(name, 0) + n
    return total


def host_ops() -> Dict[str, int]:
    """``{op: count}`` of host fallbacks over every graph torch.compile(backend="neuron") handed to tn (still alive)."""
    total: Dict[str, int] = {}
    for j in list(_jitted_graphs):
        for name, n in host_ops_of(j).items():
            total[name] = total.get(name, 0) + n
    return total


_DEVICE = "neuron"


def _run_on_device(jitted: Callable, flat: List[Any]) -> Any:
    """Run a jitted graph on neuron-device inputs without copying them to the host.

    The device's memory is host memory, so each device input is passed as a
    CPU tensor aliasing it (:func:`tn.device.allocator.cpu_alias`); the
    program reads it in place and in-place updates (mutations) write straight
    through. Results are copied once into new device tensors, as the device's
    eager ops do; a result that *is* an input (a mutated input returned) is
    returned as the original device tensor. tn.jit's own route for device
    inputs (copy every input to the host, every result back) costs one more
    copy of every input, parameters included, per call.
    """
    back: Dict[int, torch.Tensor] = {}
    args = []
    for a in flat:
        if isinstance(a, torch.Tensor) and a.device.type == _DEVICE:
            alias = cpu_alias(a)
            back[id(alias)] = a
            args.append(alias)
        else:
            args.append(a)
    out = jitted(*args)

    def put(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in back:
            return back[id(o)]
        if o.device.type == "cpu":
            return to_device(o)
        return o

    if isinstance(out, (list, tuple)):
        return type(out)(put(o) for o in out)
    return put(out)


def _input_layouts(example_inputs: Sequence[Any]) -> Dict[int, Tuple[int, ...]]:
    """``{input index: perm}`` for graph inputs laid out as a dense permutation of row-major.

    tn traces a function from its inputs' shapes only, as if they were
    contiguous; AOTAutograd graphs, though, were traced for their inputs'
    strides and may ``view`` an input in a way only that layout allows (the
    backward graph of a channels-last ConvNeXt block receives permuted saved
    activations). ``x.permute(perm)`` of such an input is contiguous in
    memory: the graph is handed that and permutes it back (a view with the
    original strides), so no data moves and the graph sees the layout it
    was traced for.
    """
    perms: Dict[int, Tuple[int, ...]] = {}
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            continue
        try:
            if x.is_contiguous():
                continue
            strides = x.stride()
            # largest stride first; size-1 dims keep their place among equals
            perm = tuple(sorted(range(x.dim()), key=lambda d: (-strides[d], d)))
            if x.permute(perm).is_contiguous():
                perms[i] = perm
        except Exception:  # symbolic sizes/strides we cannot read: trace as contiguous
            continue
    return perms


def _mutated_placeholders(gm: Any) -> List[int]:
    """Indices of the graph inputs some node of ``gm`` writes in place (e.g. ``copy_`` of BatchNorm stats)."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return []
    places = [n for n in graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(places)}
    out = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for k, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            a = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                if x in index:
                    out.add(index[x])
    return sorted(out)


def _with_layouts(gm: Callable, perms: Dict[int, Tuple[int, ...]]) -> Callable:
    """``gm`` taking the inputs of ``perms`` permuted into memory order (undone by a view before the graph)."""
    inverse = {i: tuple(sorted(range(len(p)), key=lambda d: p[d])) for i, p in perms.items()}

    def graph(*flat: Any) -> Any:
        flat = [a.permute(inverse[i]) if i in inverse else a for i, a in enumerate(flat)]
        return gm(*flat)

    graph.__name__ = getattr(gm, "__name__", type(gm).__name__)
    return graph


def _is_opaque(x: Any) -> bool:
    """Whether graph input ``x`` is an opaque object (a DTensor's device mesh, a process group: AOTAutograd passes
    them as ``FakeScriptObject`` / ``ScriptObject`` or registered opaque types)."""
    return isinstance(x, (FakeScriptObject, torch.ScriptObject)) or is_opaque_value(x)


class _OpaqueSlot:
    """Stands for opaque graph input ``index`` while tn traces the graph (which only passes it through)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<opaque graph input {self.index}>"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _OpaqueSlot) and other.index == self.index

    def __hash__(self) -> int:
        return hash(("_OpaqueSlot", self.index))


def _with_opaque_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opaque: Sequence[int],
                        tn_backend: str) -> Callable:
    """Compile ``gm`` whose inputs ``opaque`` are opaque objects (DTensor graphs get the device mesh): tn compiles
    the graph over the other inputs with a placeholder for each opaque one, and every call puts the call's
    objects where the graph returns them. A graph whose ops read an opaque object fails to trace."""
    slots = set(opaque)
    rest = [i for i in range(len(example_inputs)) if i not in slots]
    n = len(example_inputs)

    def over_rest(*vals: Any) -> Any:
        flat: List[Any] = [None] * n
        for i, v in zip(rest, vals):
            flat[i] = v
        for i in opaque:
            flat[i] = _OpaqueSlot(i)
        return gm(*flat)

    over_rest.__name__ = getattr(gm, "__name__", type(gm).__name__)
    written = set(_mutated_placeholders(gm))
    inner = _compile_graph(over_rest, [example_inputs[i] for i in rest], tn_backend,
                           mutated=[k for k, i in enumerate(rest) if i in written])

    def run(args: List[Any]) -> Any:
        flat = list(args)
        args.clear()
        out = inner([flat[i] for i in rest])
        if isinstance(out, (list, tuple)):
            return type(out)(flat[o.index] if isinstance(o, _OpaqueSlot) else o for o in out)
        return flat[out.index] if isinstance(out, _OpaqueSlot) else out

    run._boxed_call = True
    run.tn_jitted = inner.tn_jitted
    return run


_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)

#: aten ops that give a graph input's metadata as a number: replayed on the real input, as the view ops are.
_METADATA_OPS = frozenset((torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                           torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default))


def _is_view_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an aten view op (its first result aliases an argument without writing it)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _is_number_op(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a Python number from numbers or a tensor's metadata (``s0 + 1``, ``sym_size``),
    i.e. can be replayed outside tn given its arguments."""
    if node.op != "call_function":
        return False
    if node.target in _METADATA_OPS:
        return True
    # operator.add / torch.sym_max / math.floor ... : plain Python callables, not aten ops
    return not isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and \
        node.target is not operator.getitem and isinstance(node.meta.get("val"), (int, float, bool) + _SYM_TYPES)


def _symbolic_value(val: Any) -> bool:
    """Whether a node's example value is a symbolic number or a tensor with a symbolic size or stride."""
    if isinstance(val, _SYM_TYPES):
        return True
    if isinstance(val, torch.Tensor):
        try:
            return any(isinstance(d, torch.SymInt) for d in (*val.shape, *val.stride()))
        except Exception:   # a layout without strides
            return any(isinstance(d, torch.SymInt) for d in val.shape)
    return False


class _InputViews:
    """How to rebuild the graph outputs that are views of graph inputs with data-dependent or dynamic view
    arguments (``x.narrow(0, t.item(), 3)``, ``x[:, s0:]``) as real views of the call's inputs.

    AOTAutograd gives the caller such an output as a view of the input, regenerated from the backend's result:
    it replays the view ops it recorded when their arguments are constants, and otherwise takes the *result's*
    size, stride and storage offset (``as_strided`` of the input). tn's programs return a new tensor (storage
    offset 0, contiguous), so every element of ``x[s0:]`` came back as ``x[0:...]``. For those outputs the
    view chain of the graph is replayed on the real inputs (the values are the input's own); the numbers it
    needs that only the graph computes (``_local_scalar_dense`` of a tensor, a data-dependent size) are added
    to the graph's results and taken from tn's run. ``outputs``: ``{output index: node}``; ``extra``: the
    added result nodes; ``order``: the nodes to replay, in graph order."""

    def __init__(self, outputs: Dict[int, torch.fx.Node], extra: List[torch.fx.Node], order: List[torch.fx.Node],
                 n_out: int, places: Dict[torch.fx.Node, int]):
        self.outputs = outputs
        self.extra = extra
        self.order = order
        self.n_out = n_out
        self.places = places

    @staticmethod
    def find(gm: torch.fx.GraphModule) -> Optional["_InputViews"]:
        """The input views of ``gm``'s outputs that AOTAutograd cannot rebuild itself (None if there are none);
        adds the numbers they need to ``gm``'s results (in place)."""
        graph = getattr(gm, "graph", None)
        if graph is None:
            return None
        out_node = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
        if out_node is None or not isinstance(out_node.args[0], (list, tuple)):
            return None
        results = list(out_node.args[0])
        # what each node is, in graph order: "input" (an input or a view of one), "number" (computed from
        # inputs' numbers and metadata), "extra" (a number only tn's run knows: ``_local_scalar_dense``, a
        # data-dependent size), or None (anything else)
        kind: Dict[torch.fx.Node, Optional[str]] = {}
        replayable = ("input", "number")
        known = ("input", "number", "extra")     # what a replayed node may take as arguments
        for node in graph.nodes:
            args = node.all_input_nodes
            val = node.meta.get("val")
            if node.op == "placeholder":
                k = "input" if isinstance(val, torch.Tensor) else "number"
            elif node.op != "call_function":
                k = None
            elif _is_view_node(node) or (node.target is operator.getitem and args and kind[args[0]] == "input"):
                k = "input" if args and kind[args[0]] == "input" and all(kind[a] in known for a in args) else None
            elif _is_number_op(node) and all(kind[a] in known for a in args):
                k = "number"
            elif isinstance(val, (int, float, bool) + _SYM_TYPES):
                k = "extra"
            else:
                k = None
            kind[node] = k

        outputs = {i: r for i, r in enumerate(results)
                   if isinstance(r, torch.fx.Node) and r.op != "placeholder" and kind.get(r) == "input"}
        if not outputs:
            return None
        needed: set = set()      # the nodes the views need
        stack = list(outputs.values())
        while stack:
            node = stack.pop()
            if node in needed:
                continue
            needed.add(node)
            if kind[node] in replayable:
                stack.extend(node.all_input_nodes)
        symbolic = any(kind[n] == "extra" or _symbolic_value(n.meta.get("val")) for n in needed)
        if not symbolic:
            return None    # constant view arguments: AOTAutograd replays the views itself
        order = [n for n in graph.nodes if n in needed]
        extra = [n for n in order if kind.get(n) == "extra"]
        if extra:
            out_node.args = (tuple(results) + tuple(extra),) + tuple(out_node.args[1:])
            gm.recompile()
        places = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
        return _InputViews(outputs, extra, order, len(results), places)

    def rebuild(self, flat: Sequence[Any], out: Any) -> Any:
        """``out`` (tn's results for inputs ``flat``, the added numbers last) with the input views replayed."""
        results = list(out)
        numbers = results[self.n_out:]
        del results[self.n_out:]
        env: Dict[torch.fx.Node, Any] = dict(zip(self.extra, numbers))
        for node in self.order:
            if node in env:
                continue
            if node.op == "placeholder":
                env[node] = flat[self.places[node]]
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            env[node] = node.target(*args, **kwargs)
        for i, node in self.outputs.items():
            results[i] = env[node]
        return type(out)(results) if isinstance(out, tuple) else results


def _reads_values(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` has data-dependent numbers (unbacked symbols: ``.item()``, ``nonzero``'s size), i.e. tn.jit
    will run it as device windows split at its value reads rather than as one program."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        try:
            if val is not None and free_unbacked_symbols(val):
                return True
        except Exception:   # a value free_unbacked_symbols cannot walk: not a number or a tensor
            continue
    return False


def _factories_follow_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Make the tensors ``gm`` creates (``arange(..., device=cpu)``) follow its inputs' device at run time (in
    place); returns how many nodes changed.

    AOTAutograd writes the device of every factory call into the graph. A graph that reads values runs as
    tn.jit's split windows on the ``neuron`` device with its inputs moved there, so a factory pinned to the
    inputs' (host) device made a CPU tensor beside device tensors (``narrow(x, 0, t.item(), 3) *
    torch.arange(3.)`` raised). The pinned device becomes the device of the graph's first tensor input, which
    is the host device while tn traces the graph and the device the windows run on when it splits."""
    devices = {x.device for x in example_inputs if isinstance(x, torch.Tensor)}
    if len(devices) != 1:
        return 0
    home = devices.pop()
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"
                  and isinstance(n.meta.get("val"), torch.Tensor)), None)
    if first is None:
        return 0
    pinned = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.kwargs.get("device"), torch.device)
              and n.kwargs["device"] == home]
    if not pinned:
        return 0
    with gm.graph.inserting_after(first):
        where = gm.graph.call_function(getattr, (first, "device"))
    for n in pinned:
        n.kwargs = {**n.kwargs, "device": where}
    gm.recompile()
    return len(pinned)


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], tn_backend: str,
                   mutated: Optional[Sequence[int]] = None) -> Callable:
    """Wrap one aten-level FX graph as a tn.jit function; ints become static (compile per value). ``mutated``:
    the inputs the graph writes in place (default: read from ``gm``'s nodes)."""
    global _graphs_compiled

    opaque = [i for i, x in enumerate(example_inputs) if _is_opaque(x)]
    if opaque:
        return _with_opaque_inputs(gm, example_inputs, opaque, tn_backend)
    static = tuple(i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor))
    for i in static:
        if not isinstance(example_inputs[i], (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise ArgumentTypeError(f"torch.compile(backend='neuron'): graph input {i} is a "
                                    f"{type(example_inputs[i]).__name__}; tn handles tensors and Python numbers")
    views = None
    if isinstance(gm, torch.fx.GraphModule):
        views = _InputViews.find(gm)
        if _reads_values(gm):
            _factories_follow_inputs(gm, example_inputs)
    perms = _input_layouts(example_inputs)
    for i in (_mutated_placeholders(gm) if mutated is None else mutated):
        perms.pop(i, None)  # written in place: keep the graph's own input object (write-back, aliasing)
    if perms:
        jitted = jit(_with_layouts(gm, perms), static_argnums=static, backend=tn_backend)
    else:
        jitted = jit(gm, static_argnums=static, backend=tn_backend)
    with _count_lock:
        _graphs_compiled += 1
        _jitted_graphs.add(jitted)

    def call(*flat: Any) -> Any:
        if perms:
            flat = tuple(a.permute(perms[i]) if i in perms and isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(flat))
        return jitted(*flat)

    def run(args: List[Any]) -> Any:
        # AOTAutograd's boxed calling convention: one list, which the callee may clear to free inputs early.
        flat = list(args)
        args.clear()
        if any(isinstance(a, torch.Tensor) and a.device.type == _DEVICE for a in flat):
            out = _run_on_device(call, flat)
        else:
            out = call(*flat)
        return out if views is None else views.rebuild(flat, out)

    run._boxed_call = True
    run.tn_jitted = jitted  # for inspection: run.tn_jitted.cache_info(), .lower(...)
    return run


def _sdpa_math(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to its math backend (matmul, softmax, matmul).

    On CPU, SDPA picks a fused kernel whose autograd formula calls
    ``_scaled_dot_product_flash_attention_for_cpu_backward``, an op tn cannot
    trace; AOTAutograd traces this wrapper instead, so the backward graph is
    made of ordinary ops. Same arguments and mask handling as SDPA itself.
    """
    with sdpa_kernel([SDPBackend.MATH]):
        return torch._C._nn.scaled_dot_product_attention(*args, **kwargs)


_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


def _sdpa_as_math(gm: torch.fx.GraphModule) -> int:
    """Point every SDPA call of a Dynamo graph at :func:`_sdpa_math` (in place); returns how many."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SDPA_TARGETS:
            node.target = _sdpa_math
            n += 1
    if n:
        gm.recompile()
    return n


def _single_use_call(node: Any, target: Any) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target
            and len(node.users) == 1 and not node.kwargs and len(node.args) == 2)


def _addcdiv_whole(gm: torch.fx.GraphModule) -> int:
    """Give a Dynamo graph back the ``torch.addcdiv`` calls Dynamo split (in place, 16-bit results only);
    returns how many.

    Dynamo rewrites ``torch.addcdiv(x, t1, t2, value=v)`` as ``torch.add(x, torch.mul(torch.div(t1, t2), v))``
    whatever the backend (``handle_addcdiv`` in ``torch/_dynamo/variables/torch.py``, not governed by
    ``enable_dynamo_decompositions``). In bf16 that rounds ``t1 / t2`` and ``* v`` to bf16 in the forward, and
    autograd's backward rounds ``grad * v`` to bf16 before the divisions and the broadcast sums that cancel
    (op_db's addcdiv sample 3: 0.0129 off at an element of 0.626, 86% at one of -0.0038). Eager runs one op,
    computed in fp32 and rounded once, and differentiates it with ``AddcdivBackward``; so does the compile door
    after this. float32 graphs are left as Dynamo made them."""
    g = gm.graph
    n = 0
    for add in list(g.nodes):
        if not (add.op == "call_function" and add.target is torch.add and not add.kwargs and len(add.args) == 2):
            continue
        x, mul = add.args
        if not _single_use_call(mul, torch.mul):
            continue
        div, value = mul.args
        if not _single_use_call(div, torch.div) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out = add.meta.get("example_value")
        if not isinstance(out, torch.Tensor) or not is_low_precision(out.dtype) or not isinstance(x, torch.fx.Node):
            continue
        with g.inserting_before(add):
            fused = g.call_function(torch.addcdiv, (x, *div.args), {"value": value})
        fused.meta = dict(add.meta)
        add.replace_all_uses_with(fused)
        for dead in (add, mul, div):
            g.erase_node(dead)
        n += 1
    if n:
        gm.recompile()
    return n


def _inline_effects(gm: torch.fx.GraphModule) -> int:
    """Replace every ``with_effects(token, op, *args)`` of an AOTAutograd graph (in place) by ``op(*args)``;
    returns how many. AOTAutograd threads effectful ops (``_linalg_check_errors`` of every ``torch.linalg``
    call) through a token input/output; tn's tracer orders effectful ops itself and keeps the token as a
    pass-through: result 0 (the new token) becomes the token given, result ``i`` the op's result ``i - 1``."""
    effects = torch.ops.higher_order.with_effects
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not effects:
            continue
        token, op, *rest = node.args
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(op, tuple(rest), dict(node.kwargs))
        returns = len(op._schema.returns)
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise UnsupportedOpError(f"torch.compile(backend='neuron'): with_effects({op}) result used "
                                         f"by {user.format_node()}")
            i = user.args[1]
            if i == 0:
                user.replace_all_uses_with(token)
            elif returns == 1:
                user.replace_all_uses_with(call)
            else:
                with gm.graph.inserting_before(user):
                    item = gm.graph.call_function(operator.getitem, (call, i - 1))
                user.replace_all_uses_with(item)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        n += 1
    if n:
        gm.recompile()
    return n


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: List[Any], options: Optional[Dict[str, Any]] = None,
                   **kwargs: Any) -> Callable:
    """Dynamo backend: AOTAutograd forward/backward graphs compiled by tn for the NeuronCore model.

    ``options`` (``torch.compile(..., options={...})``) may hold
    ``"tn_backend"``: the :func:`tn.jit` backend to use (default ``"neuron"``).
    """
    skip_device_rng_in_dynamo()
    allow_rnn_in_dynamo()
    options = dict(options or {})
    tn_backend = options.pop("tn_backend", BACKEND_NAME)
    if options:
        raise ArgumentValueError(f"torch.compile(backend='neuron'): unknown options {sorted(options)}; "
                                 f"the only option is 'tn_backend'")

    def compiler(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        _inline_effects(graph)
        return _compile_graph(graph, inputs, tn_backend)

    _sdpa_as_math(gm)
    _addcdiv_whole(gm)
    # AOTAutograd traces the joint graph here; 16-bit norms/divisions are differentiated in fp32 (tn.ops.low_precision)
    with _torch_python_kernels_off(), fp32_gradients_while_tracing():
        try:
            return aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                                decompositions=_aot_table())(gm, example_inputs)
        except GuardOnDataDependentSymNode as err:
            return _op_by_op(gm, err)


_graphs_op_by_op = 0

#: What :func:`_op_by_op` graphs count as in ``tn.profile()``'s host ops when they run on CPU tensors.
OP_BY_OP = "<graph run op by op: data-dependent result structure>"


def graphs_run_op_by_op() -> int:
    """How many Dynamo graphs the neuron backend handed back to run op by op (see :func:`_op_by_op`)."""
    return _graphs_op_by_op


def _op_by_op(gm: torch.fx.GraphModule, err: Exception) -> Callable:
    """The Dynamo graph ``gm`` as a callable that runs its ops one by one, for a graph AOTAutograd cannot
    trace because a result's number or shape needs a tensor's value as a Python int (``torch.tensor_split(x,
    sections)`` with a 0-d tensor ``sections``: how many tensors it returns). Dynamo puts such calls into the
    graph only because tn turns on ``capture_scalar_outputs`` (:func:`capture_value_reads`); with torch's
    defaults it breaks the graph there and runs the call itself, which is what this does for the graph. On
    ``neuron`` tensors the ops run on the device (op by op or in its windows); on CPU tensors they run on the
    host and count as :data:`OP_BY_OP` host work in ``tn.profile()``. Under ``TN_STRICT=1`` this raises
    :class:`tn.UnsupportedOpError` instead."""
    global _graphs_op_by_op
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if config.get("strict"):
        raise UnsupportedOpError(f"torch.compile(backend='neuron'): a graph needs a tensor's value to know its "
                                 f"results' number or shape, which AOTAutograd cannot trace ({first}); with "
                                 f"TN_STRICT=1 it is not run op by op") from err
    with _count_lock:
        _graphs_op_by_op += 1
    if config.log_enabled("splits"):
        log.warning("torch.compile(backend='neuron'): a graph runs op by op: a result's number or shape needs a "
                    "tensor's value as a Python int, which AOTAutograd cannot trace (%s)", first)

    def run(*args: Any) -> Any:
        if not any(isinstance(a, torch.Tensor) and a.device.type == _DEVICE for a in args):
            note_host_op(OP_BY_OP)
        return gm(*args)

    return run


#: ``(number of registered operator names, table)`` of the last :func:`_aot_table`
_AOT_TABLE: List[Any] = [-1, None]


def _aot_table() -> Dict[Any, Callable]:
    """:func:`aot_decompositions` of torch's ``core_aten_decompositions()``, built once and rebuilt only when
    operators were registered since (a ``torch.library`` op with a CompositeImplicitAutograd kernel joins
    torch's table). Materialising torch's table walks every registered operator (~0.1 s), which was a third
    of a small graph's ``torch.compile`` time when it ran on every compile."""
    registered = len(torch._C._dispatch_get_all_op_names())
    if _AOT_TABLE[0] != registered:
        _AOT_TABLE[:] = [registered, aot_decompositions(core_aten_decompositions())]
    return _AOT_TABLE[1]


def aot_decompositions(table: Dict[Any, Callable]) -> Dict[Any, Callable]:
    """``table`` (torch's decompositions for AOTAutograd) without the overloads tn decomposes itself
    (:data:`tn.ops.table.DECOMPOSITIONS`): those stay in the graphs and tn's decomposition runs when
    tn.jit traces them, as on the other doors. Taking torch's instead gave wrong answers
    (``multilabel_margin_loss_forward``: the target slots after the first -1 counted, a 1-d input's
    unreduced loss shaped ``(1,)``); the reason tn's wins for each is in :data:`tn.ops.table.OVERRIDE_REASONS`."""
    return {k: v for k, v in table.items() if k not in DECOMPOSITIONS}


#: Dispatch keys of torch's Python kernels that decompose an op while AOTAutograd traces (with the Python
#: dispatcher on), whatever the decomposition table says.
_DECOMPOSING_KEYS = (torch._C.DispatchKey.Autograd, torch._C.DispatchKey.CompositeImplicitAutograd)


@contextlib.contextmanager
def _torch_python_kernels_off():
    """Take out, for the duration, torch's Python kernels at :data:`_DECOMPOSING_KEYS` of the overloads tn
    decomposes itself, so the op reaches the graph (and its C++ autograd formula gives the backward op, which tn
    also decomposes). torch registers its ``multilabel_margin_loss_forward`` decomposition as the op's Autograd
    kernel, so leaving it out of the table alone does not keep it out of the graph."""
    taken = []
    for ov in DECOMPOSITIONS:
        kernels = getattr(ov, "py_kernels", None)
        for k in _DECOMPOSING_KEYS if kernels else ():
            if k in kernels:
                taken.append((ov, k, kernels.pop(k)))
                ov._dispatch_cache.clear()
    try:
        yield
    finally:
        for ov, k, fn in taken:
            ov.py_kernels[k] = fn
            ov._dispatch_cache.clear()


_registered = False

#: torch.neuron functions torch calls from inside user code (``torch.manual_seed`` seeds every backend, OpInfo
#: wrappers and ``fork_rng`` save/restore its generator state).
_DEVICE_RNG_FUNCTIONS = ("manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state",
                         "set_rng_state", "get_rng_state_all", "set_rng_state_all")


def skip_device_rng_in_dynamo() -> None:
    """Keep Dynamo out of the neuron device's generator functions (idempotent).

    They are plain Python in tn, so Dynamo would inline them into a compiled frame that calls
    ``torch.manual_seed`` and trace ``torch.set_rng_state`` on a fake tensor (an AssertionError about
    ``no_dispatch``); disabled, they run eagerly, as CUDA's do."""
    mod = getattr(torch, "neuron", None)
    if mod is None or getattr(mod, "_tn_dynamo_skips_rng", False):
        return

    for name in _DEVICE_RNG_FUNCTIONS:
        fn = getattr(mod, name, None)
        if callable(fn):
            setattr(mod, name, disable(fn, recursive=True))
    mod._tn_dynamo_skips_rng = True


#: tn's runtime: Python that runs under torch's dispatcher (the ``neuron`` device's kernels, and the tracer,
#: passes, compiler and NeuronCore model its eager programs go through), never user code Dynamo should trace.
_RUNTIME_PACKAGES = ("tn.device", "tn.neuron", "tn.lower", "tn.ops", "tn.trace", "tn.jit", "tn.passes", "tn.ir",
                     "tn.shapes", "tn.profile", "tn.pytree", "tn.reference", "tn.bucketing")
#: Modules of tn.ops that stay off Dynamo's skip list: functions tn installs into torch that torch calls from
#: code torch.compile traces (a call into a skipped file is a graph break).
_TRACEABLE_OPS_MODULES = ("tn.ops.torch_options",)
_runtime_skipped = False


def skip_tn_runtime_in_dynamo() -> None:
    """Keep Dynamo from tracing tn's runtime (:data:`_RUNTIME_PACKAGES`) as user code (idempotent).

    Where Dynamo gives up on a call and runs it eagerly (a graph break inside ``torch.nn``: BatchNorm with
    ``momentum=None``, GaussianNLLLoss), the ops run on their tensors' device while Dynamo's frame hook is
    still on: on the ``neuron`` device that is tn's Python kernels, whose frames Dynamo then tried to compile
    as if they were the model (it failed inside the NeuronCore model's program builder, and otherwise traced
    timers and caches). Their directories join Dynamo's skip list (``torch._dynamo.trace_rules.add``), as
    torch's own packages are: those frames run as plain Python."""
    global _runtime_skipped
    if _runtime_skipped:
        return
    for name in _RUNTIME_PACKAGES:
        if name != "tn.ops":
            trace_rules.add(name)
    # tn.ops module by module (the package itself would put its whole directory on the list), leaving out
    # _TRACEABLE_OPS_MODULES: code torch calls from inside traced programs
    for mod in pkgutil.iter_modules(ops.__path__):
        if f"tn.ops.{mod.name}" not in _TRACEABLE_OPS_MODULES:
            trace_rules.add(f"tn.ops.{mod.name}")
    _runtime_skipped = True


def allow_rnn_in_dynamo() -> None:
    """Let Dynamo put ``nn.RNN``/``nn.GRU``/``nn.LSTM`` modules into graphs (``torch._dynamo.config.allow_rnn``).

    Dynamo's default graph-breaks on every one of them ("Attempted to wrap RNN, GRU, or LSTM"), so they never
    reached a backend: they ran eagerly on the CPU (or op by op on the device) outside the compiled graph. tn's
    backend takes them (AOTAutograd hands it the cells' matmuls and gates, forward and backward). The setting is
    process-wide in torch, so it is turned on when the neuron backend is looked up or registered, for every
    backend of the process alike."""
    dynamo_config.allow_rnn = True


#: Dynamo settings tn turns on (process-wide) when the neuron backend is looked up; see :func:`capture_value_reads`.
CAPTURE_SETTINGS = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")


def capture_value_reads() -> None:
    """Let Dynamo put value reads into graphs instead of breaking them (``torch._dynamo.config``'s
    ``capture_scalar_outputs`` and ``capture_dynamic_output_shape_ops``; idempotent).

    By default Dynamo graph-breaks at ``.item()`` and at ops whose result size depends on values (``nonzero``,
    ``unique``, ``masked_select``, ``x[mask]``, accumulating ``index_put``), so those ops never reached the
    backend: they ran eagerly outside the compiled graph. With both on, the graph reaches tn, which runs it
    as windows split at its value reads on the ``neuron`` device (as :func:`tn.jit` does). Outputs that are
    views of inputs at data-dependent offsets are rebuilt on the real inputs (:class:`_InputViews`).

    The settings are process-wide in torch, and torch gives a backend named in ``torch.compile(backend=...)``
    no hook that runs while Dynamo traces its frames (``backend_ctx_ctor`` is not passed through
    ``torch.compile``'s wrapper), so they cannot be scoped to the neuron backend: they are turned on when the
    backend is looked up or registered, as :func:`allow_rnn_in_dynamo`, and apply to every backend of the
    process from then on (inductor and ``aot_eager`` take such graphs too). ``TN_DYNAMO_CAPTURE=0`` leaves
    torch's settings alone; setting them back after the first ``torch.compile(backend="neuron")`` works too."""
    if not config.get("dynamo_capture"):
        return
    for name in CAPTURE_SETTINGS:
        setattr(dynamo_config, name, True)


def register() -> None:
    """Make ``torch.compile(backend="neuron")`` find :func:`neuron_backend` (idempotent)."""
    global _registered
    if _registered:
        return

    if BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(neuron_backend, name=BACKEND_NAME)
    skip_device_rng_in_dynamo()
    skip_tn_runtime_in_dynamo()
    allow_rnn_in_dynamo()
    capture_value_reads()
    _registered = True


skip_device_rng_in_dynamo()   # imported by torch.compile's backend lookup: before it traces
skip_tn_runtime_in_dynamo()
allow_rnn_in_dynamo()
capture_value_reads()
