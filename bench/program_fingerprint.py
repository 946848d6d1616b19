# Fingerprints of the instruction streams tn's compiler emits for a fixed set of models: a refactor's proof of no change.
"""Fingerprint the NeuronCore programs the compiler emits, names aside.

Usage::

    python bench/program_fingerprint.py --write bench/results/program_fingerprints.json
    python bench/program_fingerprint.py --check bench/results/program_fingerprints.json

Each workload (MLPs, a convolution net, attention, LayerNorm/softmax rows, an
HF GPT-2 block and BERT layer in fp32 and bf16, a training step) is traced
with ``tn.make_ir`` and compiled with ``tn.lower.compile_ir`` (trn2, and trn1
for two of them). Its fingerprint is a SHA-256 over every step of the
executable in order: for a program, its instruction records, semaphore waits,
side data and its HBM tensors' shapes, dtypes and kinds (not their names:
renaming a buffer or a program is not a change); for a host step, the op name;
the laid-out weight variant is included when the compiler plans one. The
table prints per workload: programs, instructions, host steps, fingerprint.

``--check`` compares against a file written earlier and exits 1 naming the
workloads whose streams changed. A change that is meant to alter programs
(a new fusion, a timing fix that changes scheduling) rewrites the file in the
same commit and says why; a refactor must leave it unchanged. Nothing is run
on the chip model, so the script takes seconds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.nn as nn

os.environ.setdefault("TN_NO_WARMUP", "1")
import tn  # noqa: E402
import tn.lower  # noqa: E402


def _hf_block(kind: str):
    from transformers import BertConfig, GPT2Config
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    if kind == "gpt2":
        block = GPT2Block(GPT2Config(n_embd=256, n_head=4, n_positions=128, attn_implementation="sdpa"))
        return block.eval(), (torch.randn(2, 64, 256),)
    cfg = BertConfig(hidden_size=256, num_attention_heads=4, intermediate_size=1024, attn_implementation="sdpa")
    return BertLayer(cfg).eval(), (torch.randn(1, 64, 256),)


def _workloads():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).eval()
    conv = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3),
                         nn.BatchNorm2d(32), nn.ReLU()).eval()
    qkv = nn.Linear(256, 768)
    norm = nn.LayerNorm(512)

    def rows(x):
        return torch.softmax(norm(x) * 2.0, dim=-1)

    def attention(x):
        q, k, v = qkv(x).view(2, 64, 3, 8, 32).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def train_step(x, y):
        with torch.enable_grad():  # fingerprint() traces under no_grad
            return _grads(x, y)

    def _grads(x, y):
        out = mlp(x)
        loss = torch.nn.functional.mse_loss(out, y)
        return torch.autograd.grad(loss, list(mlp.parameters()))

    bf = torch.bfloat16
    items = [
        ("mlp f32", mlp, (torch.randn(32, 256),), None, "trn2"),
        ("mlp bf16", mlp, (torch.randn(32, 256),), bf, "trn2"),
        ("mlp f32 trn1", mlp, (torch.randn(32, 256),), None, "trn1"),
        ("conv net f32", conv, (torch.randn(2, 3, 32, 32),), None, "trn2"),
        ("attention f32", attention, (torch.randn(2, 64, 256),), None, "trn2"),
        ("layernorm softmax f32", rows, (torch.randn(256, 512),), None, "trn2"),
        ("mlp train step f32", train_step, (torch.randn(32, 256), torch.randn(32, 256)), None, "trn2"),
    ]
    for kind in ("gpt2", "bert"):
        try:
            block, args = _hf_block(kind)
        except ImportError:  # transformers missing: the HF rows are left out (the table says so)
            continue
        items.append((f"{kind} block f32", block, args, None, "trn2"))
        items.append((f"{kind} block bf16", block, args, bf, "trn2"))
        if kind == "gpt2":
            items.append(("gpt2 block bf16 trn1", block, args, bf, "trn1"))
    return items


def _step_digest(h, exe) -> tuple:
    from tn.lower.compiler import _ProgStep

    programs = instructions = host = 0
    for st in exe._steps:
        if isinstance(st, _ProgStep):
            enc = st.enc
            programs += 1
            instructions += len(enc)
            h.update(b"P")
            h.update(enc.records.tobytes())
            h.update(b"D" + enc.deps.tobytes())
            h.update(b"A" + enc.aux.tobytes())
            for t in enc.hbm:
                h.update(repr((tuple(t.shape), str(t.dtype), t.kind)).encode())
            h.update(repr((st.ins, [(i, s, tuple(sh), str(d)) for i, s, sh, d in st.outs], st.eqns,
                           st.flag)).encode())
        else:
            host += 1
            h.update(b"H" + st.name.encode())
    return programs, instructions, host


def fingerprint(fn, args, autocast_dtype, arch) -> dict:
    """``{"programs", "instructions", "host_steps", "sha256"}`` of what the compiler emits for ``fn(*args)``."""
    with torch.no_grad():
        if autocast_dtype is not None:
            with torch.autocast("cpu", dtype=autocast_dtype):
                ir = tn.make_ir(fn)(*args)
        else:
            ir = tn.make_ir(fn)(*args)
    exe = tn.lower.compile_ir(ir, arch=arch)
    h = hashlib.sha256()
    programs, instructions, host = _step_digest(h, exe)
    if exe._layout is not None:
        child = exe._laid_out_variant()
        if child is not None:
            h.update(b"L")
            p2, i2, h2 = _step_digest(h, child)
            programs, instructions, host = programs + p2, instructions + i2, host + h2
    return {"programs": programs, "instructions": instructions, "host_steps": host, "sha256": h.hexdigest()}


def main(argv=None) -> int:
    """Print the fingerprint table; ``--write`` saves it, ``--check`` compares with a saved one."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", metavar="PATH", help="save the fingerprints as JSON")
    ap.add_argument("--check", metavar="PATH", help="compare with fingerprints saved earlier; exit 1 on change")
    opts = ap.parse_args(argv)
    from tabulate import tabulate

    torch.set_num_threads(1)
    got = {}
    for name, fn, args, dt, arch in _workloads():
        got[name] = fingerprint(fn, args, dt, arch)
    want = {}
    if opts.check:
        with open(opts.check) as f:
            want = json.load(f)["workloads"]
    rows = []
    changed = []
    for name, fp in got.items():
        verdict = ""
        if opts.check:
            old = want.get(name)
            verdict = "new" if old is None else ("same" if old["sha256"] == fp["sha256"] else "CHANGED")
            if verdict != "same":
                changed.append(name)
        rows.append([name, fp["programs"], fp["instructions"], fp["host_steps"], fp["sha256"][:16], verdict])
    missing = sorted(set(want) - set(got))
    print(tabulate(rows, headers=["workload", "programs", "instructions", "host steps", "sha256", "vs saved"]))
    if opts.write:
        os.makedirs(os.path.dirname(os.path.abspath(opts.write)), exist_ok=True)
        with open(opts.write, "w") as f:
            json.dump({"torch": torch.__version__, "workloads": got}, f, indent=1)
            f.write("\n")
    if opts.check:
        if missing:
            print(f"missing workloads (in the saved file, not run): {', '.join(missing)}")
        print(f"verdict: {'programs unchanged' if not changed and not missing else 'CHANGED: ' + ', '.join(changed + missing)}")
        return 1 if changed or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
