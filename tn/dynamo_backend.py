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

The name is registered through the ``torch_dynamo_backends`` entry point in
tn's package metadata: Dynamo finds it on first use, whether or not ``tn``
was imported (registering from ``import tn`` as well would make Dynamo's
entry-point loader, which imports tn, register the name twice).
:func:`register` registers by hand where package metadata is missing.
:func:`graphs_compiled` counts the graphs handed to tn.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .errors import TnError

__all__ = ["neuron_backend", "register", "graphs_compiled", "BACKEND_NAME"]

#: The name torch.compile knows the backend by.
BACKEND_NAME = "neuron"

_count_lock = threading.Lock()
_graphs_compiled = 0


def graphs_compiled() -> int:
    """How many AOTAutograd graphs (forward and backward count separately) tn has compiled in this process."""
    return _graphs_compiled


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], tn_backend: str) -> Callable:
    """Wrap one aten-level FX graph as a tn.jit function; ints become static (compile per value)."""
    global _graphs_compiled
    from .jit import jit

    static = tuple(i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor))
    for i in static:
        if not isinstance(example_inputs[i], (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise TnError(f"torch.compile(backend='neuron'): graph input {i} is a "
                          f"{type(example_inputs[i]).__name__}; tn handles tensors and Python numbers")
    jitted = jit(gm, static_argnums=static, backend=tn_backend)
    with _count_lock:
        _graphs_compiled += 1

    def run(args: List[Any]) -> Any:
        # AOTAutograd's boxed calling convention: one list, which the callee may clear to free inputs early.
        flat = list(args)
        args.clear()
        return jitted(*flat)

    run._boxed_call = True
    run.tn_jitted = jitted  # for inspection: run.tn_jitted.cache_info(), .lower(...)
    return run


def neuron_backend(gm: torch.fx.GraphModule, example_inputs: List[Any], options: Optional[Dict[str, Any]] = None,
                   **kwargs: Any) -> Callable:
    """Dynamo backend: AOTAutograd forward/backward graphs compiled by tn for the NeuronCore model.

    ``options`` (``torch.compile(..., options={...})``) may hold
    ``"tn_backend"``: the :func:`tn.jit` backend to use (default ``"neuron"``).
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._decomp import core_aten_decompositions

    options = dict(options or {})
    tn_backend = options.pop("tn_backend", BACKEND_NAME)
    if options:
        raise TnError(f"torch.compile(backend='neuron'): unknown options {sorted(options)}; "
                      f"the only option is 'tn_backend'")

    def compiler(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        return _compile_graph(graph, inputs, tn_backend)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                        decompositions=core_aten_decompositions())(gm, example_inputs)


_registered = False


def register() -> None:
    """Make ``torch.compile(backend="neuron")`` find :func:`neuron_backend` (idempotent)."""
    global _registered
    if _registered:
        return
    from torch._dynamo.backends import registry

    if BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(neuron_backend, name=BACKEND_NAME)
    _registered = True
