# tn: PyTorch programs on a software AWS Trainium NeuronCore. This file is the public API surface.
"""tn runs PyTorch programs on a software model of an AWS Trainium NeuronCore.

Doors: ``@tn.jit`` (whole function, cached per signature), ``tn.make_ir``
(look at the IR), ``tn.profile()`` (where the modelled time goes).
"""
from .errors import (ArgumentTypeError, ArgumentValueError, CompileError, DeviceError, ExecutionError,
                     MissingDependencyError, NeuronError, OnChipMemoryError, OutOfMemoryError, TnError, TracingError,
                     UnsupportedOpError)
from .ir import IR, Eqn, Literal, Var
from .profile import profile  # noqa: E402  (collects NeuronCore runs: with tn.profile() as prof)
from . import ops, trace  # noqa: F401
from .jit import jit, make_ir  # the functions shadow the submodule name tn.jit
from . import device as _device  # noqa: F401,E402  (registers the torch device "neuron")
from . import adaptive; from .adaptive import adaptive_report  # noqa: E402,E702  (the module tn.adaptive is callable: tn.adaptive(model))
from . import distributed  # noqa: E402,F401  (registers the torch.distributed backend "neuron")
from . import assess  # noqa: E402,F401  (callable module: tn.assess(model, example_inputs) -> report)

__version__ = "0.1.0"

__all__ = [
    "IR", "Eqn", "Literal", "Var",
    "jit", "make_ir", "profile", "adaptive", "adaptive_report", "assess",
    "TnError", "TracingError", "UnsupportedOpError", "CompileError", "ExecutionError", "NeuronError", "DeviceError",
    "OutOfMemoryError", "OnChipMemoryError", "ArgumentTypeError", "ArgumentValueError", "MissingDependencyError",
]

trace.warm_up()  # last: pays torch's one-time tracing imports (~1 s) here, not in the first trace
