# A script for torchrun (tests/test_distributed.py runs it): DDP steps on the neuron backend, one JSON line per rank.
"""Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_torchrun_script.py OUT_DIR``;
each rank writes ``OUT_DIR/rank<R>.json`` with what it saw (rank, world, backend, devices, cores, losses,
collective counts)."""
import glob
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tn


def main(out_dir):
    dist.init_process_group(backend="neuron")          # rank, world size and master come from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4).to("neuron"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    with tn.profile() as prof:
        for _ in range(3):
            loss = model(torch.randn(8, 16, generator=g).to("neuron")).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    weights = model.module.weight.detach().cpu()
    gathered = [torch.empty_like(weights).to("neuron") for _ in range(world)]
    dist.all_gather(gathered, weights.to("neuron"))
    same = all(torch.equal(w.cpu(), weights) for w in gathered)
    out = {"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
           "backend": dist.get_backend(), "device_count": torch.neuron.device_count(),
           "cores": dist.group.WORLD.cores, "losses": losses, "weights_equal_across_ranks": same,
           "all_reduce_calls": torch.neuron.collective_stats().get("all_reduce", {}).get("calls", 0),
           "records": sum(1 for r in prof.records if r.track == "collectives")}
    prof.save_trace(os.path.join(out_dir, f"rank{rank}.trace.json"))
    dist.destroy_process_group()
    # native threads still alive after destroy_process_group (Linux names them in /proc): gloo's must be gone
    out["threads_after_destroy"] = sorted(open(t).read().strip() for t in glob.glob("/proc/self/task/*/comm"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
