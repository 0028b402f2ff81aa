"""Init discipline of ``prepare``: fp32 master weights whatever dtype the model comes in (with a
warning), the unsharded model never moved to the device whole, shards materialised where they live."""

import warnings

import pytest
import torch

from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks
from ndparallel.tools.equivalence import TrainSetup, make_global_batches

SETUP = TrainSetup(preset_config("tiny-llama"), steps=2, global_micro_batch=2, seq_len=16)


def _train_from(dtype, layout):
    """Prepare a model initialised in ``dtype`` (its fp32 copy for ``float32``), train 2 steps."""
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.engine import forward_backward
    from ndparallel.optim.build import build_optimizer

    acc = Accelerator(ParallelismConfig(**layout))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(SETUP.model_config, dtype=torch.bfloat16)
    if dtype == torch.float32:  # the same values, already fp32 (buffers as from_config made them)
        model = model.float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = acc.prepare(model)
    warned = any("upcasting them to torch.float32 master weights" in str(w.message) for w in caught)
    dtypes = {p.dtype for p in model.parameters()}
    opt = build_optimizer(model.parameters(), "sgd", lr=0.1)
    losses = []
    rows = SETUP.global_micro_batch // acc.dp_size
    for micro in make_global_batches(SETUP):
        local = [{k: v[acc.dp_rank * rows : (acc.dp_rank + 1) * rows] for k, v in mb.items()} for mb in micro]
        loss = forward_backward(acc.engine, model, local)
        torch.distributed.all_reduce(loss, group=acc.mesh("dp_cp").get_group())
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return warned, dtypes, losses


@pytest.mark.parametrize(
    "layout,world",
    [({}, 1), ({"dp_shard_size": 2}, 2), ({"tp_size": 2}, 2)],
    ids=["one-rank", "fsdp2", "tp2"],
)
def test_bf16_model_trains_with_fp32_master_weights(layout, world):
    bf16 = run_on_ranks(_train_from, world, torch.bfloat16, layout)[0]
    fp32 = run_on_ranks(_train_from, world, torch.float32, layout)[0]
    assert bf16[0] and not fp32[0], "the upcast warns exactly when the model is not fp32"
    assert bf16[1] == {torch.float32} == fp32[1]
    # same values (bf16 -> fp32 is exact), same fp32 training
    assert bf16[2] == pytest.approx(fp32[2], rel=1e-6)


def _root_moves(layout):
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(ParallelismConfig(**layout))
    model = AutoModelForCausalLM.from_config(SETUP.model_config)
    calls = []
    original = type(model).to

    def spy(self, *args, **kwargs):
        calls.append((args, kwargs))
        return original(self, *args, **kwargs)

    type(model).to = spy
    try:
        acc.prepare(model)
    finally:
        type(model).to = original
    return calls


def test_prepare_never_moves_the_whole_model():
    """FSDP and TP move each shard as they create it; a whole-model ``.to(device)`` before sharding
    would put the unsharded model on every GPU (280 GB for 70B)."""
    assert run_on_ranks(_root_moves, 2, {"dp_shard_size": 2})[0] == []
    assert run_on_ranks(_root_moves, 2, {"tp_size": 2})[0] == []
