"""Print each rank's mesh coordinates and process groups.

ndparallel launch --nproc-per-node 8 examples/show_mesh.py --dp-shard 2 --cp 2 --tp 2
ndparallel launch --nproc-per-node 8 examples/show_mesh.py --pp 2 --dp-shard 2 --tp 2
"""

import argparse

import torch.distributed as dist

from ndparallel import ParallelismConfig
from ndparallel.layout.mesh import coordinates, group_ranks
from ndparallel.runtime.distributed import init_distributed, shutdown

parser = argparse.ArgumentParser()
parser.add_argument("--dp-replicate", type=int, default=1)
parser.add_argument("--dp-shard", type=int, default=-1)
parser.add_argument("--cp", type=int, default=1)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--pp", type=int, default=1)
args = parser.parse_args()

info = init_distributed()
pc = ParallelismConfig(args.dp_replicate, args.dp_shard, args.tp, args.cp, pp_size=args.pp).resolve(
    info.world_size
)
mesh = pc.build_device_mesh(info.device_type)
coords = " ".join(f"{k}={v}" for k, v in coordinates(mesh).items())
groups = " ".join(f"{d}={group_ranks(mesh, d)}" for d in ("pp", "dp", "dp_shard_cp", "dp_cp", "cp", "tp"))
for r in range(info.world_size):  # print in rank order
    if r == info.rank:
        if r == 0:
            print(f"{pc!r}  [{pc.describe()}]", flush=True)
        print(f"rank {r}: {coords} | {groups}", flush=True)
    dist.barrier()
shutdown()
