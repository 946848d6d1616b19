# The `python -m tn assess` command: parse options, load TARGET, assess, print the summary, write JSON/HTML, exit code.
"""``python -m tn assess TARGET [options]`` (``--help`` lists them).

Exit codes: 0 every requested door ran and matched the CPU; 1 some door
failed, crashed, timed out or differed; 2 bad input (TARGET, options, a
model that does not run on the CPU), printed as one clear message.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..errors import TnError
from . import assess_target
from .target import load_target

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``tn assess``."""
    p = argparse.ArgumentParser(
        prog="python -m tn assess",
        description="Will my model run on Trainium, how fast, what breaks: runs the model on the CPU and through "
                    "each tn door (device eager, torch.compile, tn.jit, tn.adaptive), each in its own process.")
    p.add_argument("target", nargs="?", help="path/to/file.py:factory (factory() returns model, example inputs) "
                   "or a Hugging Face model class with --hf-config (default: the config's architectures[0])")
    p.add_argument("--hf-config", metavar="config.json", help="local HF config: random weights, nothing downloaded")
    p.add_argument("--batch", type=int, default=1, help="batch size of generated HF inputs (default 1)")
    p.add_argument("--seq", type=int, default=128, help="sequence length of generated HF inputs (default 128)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: torch.autocast (default fp32)")
    p.add_argument("--train", action="store_true", help="a training step (loss + backward) instead of inference")
    p.add_argument("--doors", default="eager,compile,jit,adaptive", help="comma list (default all four)")
    p.add_argument("--repeats", type=int, default=2, help="steady calls timed per door (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per door before it is stopped (600)")
    p.add_argument("--arch", choices=("trn1", "trn2"), help="NeuronCore modelled (tn.config arch)")
    p.add_argument("--instance", help="instance type modelled, e.g. trn2.48xlarge (tn.config instance)")
    p.add_argument("--lnc", type=int, choices=(1, 2), help="logical NeuronCore size (tn.config lnc)")
    p.add_argument("--cores", type=int, default=1,
                   help="with --train: DDP scaling over 1, 2, 4, ... CORES cores (simulated ranks and modelled rows)")
    p.add_argument("--simulate-ranks", type=int, default=None, metavar="K",
                   help="real DDP ranks run for --cores (default min(CORES, 4); 0: modelled rows only)")
    p.add_argument("--json", metavar="PATH", help="write everything measured as JSON")
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command; returns the exit code (see the module docstring)."""
    args = parser().parse_args(argv)
    if args.batch < 1 or args.seq < 1:
        print("tn assess: error: --batch and --seq must be positive", file=sys.stderr)
        return 2
    try:
        target = load_target(args.target, args.hf_config, args.batch, args.seq, args.train)
        result = assess_target(target, doors=args.doors, dtype=args.dtype, train=args.train, repeats=args.repeats,
                               timeout=args.timeout, arch=args.arch, instance=args.instance, lnc=args.lnc,
                               cores=args.cores, simulate_ranks=args.simulate_ranks, progress=not args.quiet)
    except TnError as e:
        print(f"tn assess: error: {e}", file=sys.stderr)
        return 2
    print(result.summary())
    if args.json:
        print(f"wrote {result.save_json(args.json)}")
    if args.html:
        try:
            print(f"wrote {result.save_html(args.html)}")
        except TnError as e:
            print(f"tn assess: error: {e}", file=sys.stderr)
            return 2
    return 0 if result.ok else 1
