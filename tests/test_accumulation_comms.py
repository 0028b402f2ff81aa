"""Gradient accumulation's communication, counted at run time, equals the planner's prediction:
by default reduce-scatter every micro-batch (gradients stay sharded) and the replica all-reduce
once per step; with ``unsharded_grad_accumulation`` both wait for the last micro-batch."""

import pytest
import torch

from ndparallel.testing import run_on_ranks

GA, ROWS, SEQ = 2, 2, 32


def _counted(unsharded: bool):
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.engine import forward_backward
    from ndparallel.models.presets import preset_config
    from ndparallel.parallel.options import FSDPOptions
    from ndparallel.runtime.comm_profile import CommProfiler

    acc = Accelerator(
        ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
        gradient_accumulation_steps=GA,
        fsdp_options=FSDPOptions(unsharded_grad_accumulation=unsharded),
    )
    torch.manual_seed(0)
    model = acc.prepare(AutoModelForCausalLM.from_config(preset_config("tiny-llama")))
    g = torch.Generator().manual_seed(acc.dp_rank)

    def micro():
        t = torch.randint(0, 256, (ROWS, SEQ + 1), generator=g)
        return {
            "input_ids": t[:, :-1].contiguous(),
            "shift_labels": t[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).expand(ROWS, -1).clone(),
        }

    forward_backward(acc.engine, model, [micro() for _ in range(GA)])  # lazy init outside the record
    model.zero_grad()
    with CommProfiler(acc.torch_device_mesh) as prof:
        forward_backward(acc.engine, model, [micro() for _ in range(GA)])
        prof.step()
    shard, rep = prof.label("dp_shard_cp"), prof.label("dp_replicate")
    # keyed like the planner's ``aggregate``: (kind, mesh dim, bytes per call) -> calls
    return {
        (op, ("dp_shard_cp" if d == shard else "dp_replicate" if d == rep else d), b): n
        for (d, op, b), n in prof.calls(0).items()
    }


@pytest.mark.parametrize("unsharded", [False, True], ids=["sharded", "unsharded"])
def test_hsdp_accumulation_counts_equal_prediction(unsharded):
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.time.comms import aggregate, predict_collectives

    counted = run_on_ranks(_counted, 4, unsharded)[0]
    predicted = aggregate(
        predict_collectives(
            PRESETS["tiny"],
            ParallelDims(dp_replicate=2, dp_shard=2),
            sequence_len=SEQ,
            micro_batch_size=ROWS,
            gradient_accumulation_steps=GA,
            mixed_precision="fp32",
            unsharded_grad_accumulation=unsharded,
        )
    )
    # the only other call is the token count's all-reduce over dp (a scalar, not FSDP's)
    fsdp = {k: v for k, v in counted.items() if k[1] in ("dp_shard_cp", "dp_replicate")}
    assert fsdp == predicted
    reduce_scatters = sum(n for (op, _, _), n in counted.items() if op == "reduce_scatter")
    all_reduces = sum(n for (op, d, _), n in counted.items() if d == "dp_replicate" and op == "all_reduce")
    units = 4  # two decoder layers, the embedding, the final norm + lm_head
    assert reduce_scatters == units * (1 if unsharded else GA)
    assert all_reduces == units
