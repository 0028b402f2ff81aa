"""A cheap multi-rank job (torch only, no model) for the launcher and signal tests.

    ndparallel launch --nproc-per-node N signal_job.py MODE DIR

Every rank writes ``DIR/pid-<rank>`` (its pid) once the process group is up, then:

* ``loop``: all-reduces forever (0.05 s apart) — to be killed from outside;
* ``stop-rank-K``: rank K stops itself (SIGSTOP) after the first collective; the others wait for
  it in the next one until the collective timeout;
* ``preempt``: all-reduces in a loop under a ``PreemptionWatch``; when the ranks agree to stop,
  each writes ``DIR/stopped-<rank>`` with the agreed step and exits with ``PREEMPTED_EXIT``.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ndparallel.runtime.distributed import init_distributed, shutdown
from ndparallel.runtime.preemption import PREEMPTED_EXIT, PreemptionWatch

mode, out = sys.argv[1], Path(sys.argv[2])
torch.set_num_threads(1)
info = init_distributed("cpu")
t = torch.ones(1)
dist.all_reduce(t)
(out / f"pid-{info.rank}").write_text(str(os.getpid()))
if mode == "loop":
    while True:
        dist.all_reduce(t)
        time.sleep(0.05)
elif mode.startswith("stop-rank-"):
    if info.rank == int(mode.rsplit("-", 1)[1]):
        os.kill(os.getpid(), 19)  # SIGSTOP
    dist.all_reduce(t)
    (out / f"finished-{info.rank}").write_text("should not happen")
elif mode == "preempt":
    with PreemptionWatch(timeout_s=60) as watch:
        step = 0
        while True:
            step += 1
            dist.all_reduce(t)
            time.sleep(0.05)
            if step == 3:
                (out / f"ready-{info.rank}").write_text("")
            if watch.should_stop():
                (out / f"stopped-{info.rank}").write_text(f"{step} {watch.signal_name}")
                watch.finished()
                break
    shutdown()
    sys.exit(PREEMPTED_EXIT)
