# tn.adaptive: the per-region eager/jit controller; installed as the subpackage tn.adaptive, callable as tn.adaptive(model).
"""The adaptive controller: chooses eager or compiled execution per region of a model.

``tn.adaptive(model, **policy)`` (this module is callable) returns an
:class:`AdaptiveModel`; ``tn.adaptive_report(m)`` prints the per-region
table. Layout: :mod:`.policy` (knobs and cost model), :mod:`.region` (one
region: signatures, eager/compiled/padded calls, autograd; the padding
proofs and the bucket rule are :mod:`tn.bucketing`, shared with the
device's adaptive eager windows),
:mod:`.state` (KV caches and other mutable state objects as arguments),
:mod:`.placement` (where eager calls run: a CPU model's on the NeuronCore model),
:mod:`.wrapper` (finding regions, the wrapper, the report).
"""
from __future__ import annotations

import os
import sys
import types

from ..trace import register_internal_dir
from .policy import Policy, make_policy
from .state import register_state_type
from .wrapper import AdaptiveModel, adaptive, adaptive_report, default_regions

__all__ = ["adaptive", "adaptive_report", "AdaptiveModel", "Policy", "make_policy", "default_regions",
           "register_state_type"]


class _CallableModule(types.ModuleType):
    """The ``tn.adaptive`` module, callable as ``tn.adaptive(model, **policy)``."""

    def __call__(self, model, **policy):
        return adaptive(model, **policy)


sys.modules[__name__].__class__ = _CallableModule
register_internal_dir(os.path.dirname(os.path.abspath(__file__)))  # installed beside tn/, not inside it
