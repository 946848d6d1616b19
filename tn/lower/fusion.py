# Fusion planning: groups of equations lowered together so intermediates stay in SBUF (elementwise chains, row reductions, epilogues).
"""Fusion of equations into groups lowered as one (see :mod:`tn.lower.base` for the hooks)."""
from __future__ import annotations

from typing import Any, Dict


def plan(ir: Any, host: Dict[int, str]) -> Dict[int, Any]:
    """Fused groups of ``ir``: first equation index -> group (none planned yet)."""
    return {}
