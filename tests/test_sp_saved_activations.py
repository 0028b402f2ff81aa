"""Sequence parallel saves each block's gathered input as the rank's sequence shard
(``parallel/tp/sp_saves.py``): measured with saved-tensor hooks on 2 CPU ranks, the bytes a decoder
layer keeps drop by exactly the two gathered inputs' non-local part, the planner models that same
saving, and the gradients are bitwise those of saving the gathered input (the same arithmetic;
``tests/test_tensor_parallel*.py`` compare both against one process)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks

BATCH, SEQ = 2, 32


def _rank(model, saved_shards: bool):
    """TP 2 + SP over both ranks: (bytes layer 0 saves, loss, every gradient as a local tensor)."""
    from torch.distributed.tensor import DTensor

    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.parallel.options import TPOptions
    from ndparallel.parallel.tp.tensor import apply_tensor_parallel
    from ndparallel.tools.saved_bytes import SavedBytes

    model = copy.deepcopy(model)
    mesh = ParallelismConfig(tp_size=2).build_device_mesh("cpu")["tp"]
    options = TPOptions(
        sequence_parallel=True, loss_parallel=False, sequence_parallel_saved_shards=saved_shards
    )
    apply_tensor_parallel(model, mesh, options)
    counter = SavedBytes(exclude=list(model.parameters()))
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda *_: counter.__enter__() and None)
    layer.register_forward_hook(lambda *_: counter.__exit__(None, None, None))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, -1)
    logits = model(input_ids=ids, position_ids=pos).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    grads = {n: local(p.grad).clone() for n, p in model.named_parameters()}
    return counter.total, loss.item(), grads


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"), dtype=torch.float32)
    return model, {shards: run_on_ranks(_rank, 2, model, shards) for shards in (False, True)}


def test_layer_saves_the_sequence_shards_of_its_block_inputs(measured):
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.memory.activations import layer_activation_bytes_per_token
    from ndparallel.plan.models import from_hf_config
    from ndparallel.plan.settings import Settings

    model, runs = measured
    h, tp = model.config.hidden_size, 2
    gathered, shard = BATCH * SEQ * h * 4, BATCH * SEQ // tp * h * 4  # fp32
    for rank in range(tp):
        whole, sharded = runs[False][rank][0], runs[True][rank][0]
        assert whole - sharded == 2 * (gathered - shard), (whole, sharded)  # attention's and the MLP's
    spec = from_hf_config(model.config.to_dict())
    planned = {
        shards: layer_activation_bytes_per_token(
            spec,
            ParallelDims(tp=tp),
            Settings(sequence_len=SEQ, mixed_precision="fp32", sequence_parallel_saved_shards=shards),
        )
        for shards in (False, True)
    }
    tokens = BATCH * SEQ  # the planner's bytes are per token of the micro-batch (cp-local)
    assert (planned[False] - planned[True]) * tokens == 2 * (gathered - shard)


def test_gradients_are_those_of_saving_the_gathered_input(measured):
    _, runs = measured
    for rank in range(2):
        (_, loss_a, grads_a), (_, loss_b, grads_b) = runs[False][rank], runs[True][rank]
        assert loss_a == loss_b
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name
