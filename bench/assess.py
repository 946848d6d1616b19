# Bench: how long `tn assess` takes on GPT-2 124M, a small Llama and a HF ResNet (all doors), with each summary printed.
"""Assessment benchmark.

Usage::

    python bench/assess.py [--only gpt2,llama,resnet] [--repeats N] [--json PATH] [--html-dir DIR]

Each workload is a Hugging Face model with random weights from a config
written to a temporary folder (nothing downloaded), assessed exactly as
``python -m tn assess CLASS --hf-config config.json`` does (CPU reference,
then device eager, torch.compile, tn.jit and tn.adaptive, each in its own
process), inference, fp32:

* ``gpt2``: GPT2LMHeadModel, the 124M configuration, batch 1, sequence 128;
* ``llama``: LlamaForCausalLM, 4 layers, width 256, 4 heads (2 KV heads),
  vocab 4096, batch 1, sequence 128;
* ``resnet``: ResNetForImageClassification, ResNet-18 shape (basic blocks,
  depths 2-2-2-2), 1 image of 3x64x64.

The table gives the wall time of the whole assessment (min and median over
``--repeats``), the doors that ran and matched, and the best modelled step.
Verdict lines: ``FAIL`` when a door did not run or match the CPU (a wrong
answer is never timed as a success), and the issue's goal: GPT-2 124M under
180 s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tn  # noqa: E402
from tn.assess import assess_target  # noqa: E402
from tn.assess.target import load_hf  # noqa: E402

GOAL_S = {"gpt2": 180.0}


def _configs(folder: str) -> dict:
    import transformers

    c = transformers.GPT2Config()
    c.architectures = ["GPT2LMHeadModel"]
    gpt2 = os.path.join(folder, "gpt2.json")
    c.to_json_file(gpt2)
    c = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256)
    c.architectures = ["LlamaForCausalLM"]
    llama = os.path.join(folder, "llama.json")
    c.to_json_file(llama)
    c = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                  embedding_size=64, num_labels=10)
    c.architectures = ["ResNetForImageClassification"]
    c.image_size = 64   # read by tn assess's input maker (224 when absent)
    resnet = os.path.join(folder, "resnet.json")
    c.to_json_file(resnet)
    return {"gpt2": (gpt2, 1, 128), "llama": (llama, 1, 128), "resnet": (resnet, 1, 1)}


def main(argv=None) -> int:
    """Run the workloads; print summaries and the table; returns 1 on a failed door or a missed goal."""
    from tabulate import tabulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="gpt2,llama,resnet")
    ap.add_argument("--repeats", type=int, default=1, help="whole assessments per workload (min/median)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--html-dir", metavar="DIR", help="write each workload's HTML report there")
    args = ap.parse_args(argv)
    rows, verdicts, record = [], [], {}
    failed = False
    with tempfile.TemporaryDirectory() as folder:
        cfgs = _configs(folder)
        for name in [w.strip() for w in args.only.split(",") if w.strip()]:
            path, batch, seq = cfgs[name]
            times, result = [], None
            for _ in range(max(1, args.repeats)):
                t0 = time.perf_counter()
                target = load_hf(None, path, batch=batch, seq=seq)
                result = assess_target(target, progress=True)
                times.append(time.perf_counter() - t0)
            print(result.summary())
            print()
            if args.html_dir:
                os.makedirs(args.html_dir, exist_ok=True)
                result.save_html(os.path.join(args.html_dir, f"{name}.html"))
            best = result.best_door()
            matched = [k for k, d in result.doors.items() if d.get("status") == "ok"]
            rows.append({"workload": name, "model": result.label, "assess s min": f"{min(times):.1f}",
                         "assess s median": f"{statistics.median(times):.1f}",
                         "doors ok": f"{len(matched)}/{len(result.doors)}",
                         "best door": best or "-",
                         "device ms": f"{result.doors[best]['device_us'] / 1e3:.3g}" if best else "-",
                         "CPU ms": f"{result.cpu['steady_ms_median']:.4g}"})
            record[name] = {"times_s": times, "result": result.to_dict()}
            if not result.ok:
                failed = True
                verdicts.append(f"FAIL {name}: not every door ran and matched the CPU "
                                f"(" + ", ".join(f"{k}: {d.get('status')}" for k, d in result.doors.items()) + ")")
            else:
                verdicts.append(f"ok   {name}: all {len(result.doors)} doors ran and matched the CPU")
            goal = GOAL_S.get(name)
            if goal is not None:
                if min(times) <= goal:
                    verdicts.append(f"ok   {name}: assessment {min(times):.1f} s <= goal {goal:.0f} s")
                else:
                    failed = True
                    verdicts.append(f"MISS {name}: assessment {min(times):.1f} s > goal {goal:.0f} s")
    print(tabulate(rows, headers="keys", tablefmt="simple"))
    print("\n".join(verdicts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "verdicts": verdicts, "workloads": record, "tn": tn.__version__}, f, indent=1,
                      default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
