"""Run by ``accelerate launch --num_machines 2 --machine_rank M ...`` on each "machine": every
rank writes what the ``Accelerator`` says about where it sits (``OUT/rank-N.json``)."""

import json
import os
import sys

import torch
import torch.distributed as dist

from ndparallel import Accelerator, ParallelismConfig

acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
total = torch.tensor([float(acc.process_index)])
dist.all_reduce(total)  # every rank of both machines in one group
info = {
    "num_processes": acc.num_processes,
    "process_index": acc.process_index,
    "local_process_index": acc.local_process_index,
    "is_local_main_process": acc.is_local_main_process,
    "is_main_process": acc.is_main_process,
    "sum": float(total),
    "machine": int(os.environ["GROUP_RANK"]),
    "tp_group": sorted(dist.get_process_group_ranks(acc.mesh("tp").get_group())),
}
with open(os.path.join(sys.argv[1], f"rank-{acc.process_index}.json"), "w") as f:
    json.dump(info, f)
acc.end_training()
