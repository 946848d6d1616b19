# bench/distributed.py: modelled all-reduce bus bandwidth over sizes and ranks on trn1/trn2 instances.
"""Print the all-reduce bus-bandwidth table of :mod:`tn.neuron.collectives` (every row is modelled, not
measured: the ring model over :func:`tn.neuron.machine.machine`). ``--json PATH`` writes the rows."""
import argparse
import json

from tabulate import tabulate

from tn.neuron import collectives as C
from tn.neuron.machine import machine

SIZES = [1 << 10, 1 << 20, 1 << 24, 1 << 28]
RANKS = [2, 4, 8, 16, 64]


def rows():
    """One row per (instance, ranks, bytes): modelled µs and bus bandwidth GB/s."""
    out = []
    for name in ("trn2.48xlarge", "trn1.32xlarge"):
        one = machine(name)
        for n in RANKS:
            m = one if n <= one.device_count else machine(name, instances=-(-n // one.device_count))
            for nb in SIZES:
                ns = C.collective_ns("all_reduce", m, nb, list(range(n)))
                out.append({"instance": name, "ranks": n, "bytes": nb, "us": ns / 1e3,
                            "busbw_GBps": C.bus_bandwidth("all_reduce", nb, ns, n) / 1e9, "kind": "modelled"})
    return out


def main():
    """Print the table; verdict fails if the model stops being monotone in bytes."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    r = rows()
    print(tabulate([[x["instance"], x["ranks"], x["bytes"], f"{x['us']:.2f}", f"{x['busbw_GBps']:.2f}", x["kind"]]
                    for x in r], headers=["instance", "ranks", "bytes", "all-reduce µs", "busbw GB/s", "kind"]))
    ok = all(r[i]["us"] < r[i + 1]["us"] for i in range(len(r) - 1) if r[i]["ranks"] == r[i + 1]["ranks"]
             and r[i]["instance"] == r[i + 1]["instance"])
    print("verdict:", "ok (time grows with bytes)" if ok else "FAIL: time not monotone in bytes")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
