# `python -m tn COMMAND`: tn's command line (assess: will my model run on Trainium).
"""``python -m tn assess TARGET ...``: see :mod:`tn.assess.cli` (``python -m tn assess --help``)."""
from __future__ import annotations

import sys

from .assess.cli import main as assess_main


def main(argv=None) -> int:
    """Dispatch ``argv[0]`` to its command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m tn assess TARGET [options]   (python -m tn assess --help)\n"
              "  assess   will my model run on Trainium, how fast, what breaks (a report per door)")
        return 0 if argv else 2
    if argv[0] == "assess":
        return assess_main(argv[1:])
    print(f"python -m tn: unknown command {argv[0]!r}; commands: assess", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
