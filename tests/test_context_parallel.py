"""A tiny llama trained with CP 2 / 4 (ring and all-gather) equals one process, step by step.

Parameters are replicated over cp (FSDP is not part of this test): each rank's gradient is its
share of the global loss, so summing grads over the cp group gives the one-process gradient.
Loss = sum of token CE over non-ignored shift_labels / non-ignored count over the cp group.
This hand-written loop has no second way, so the bound is the project's rule's fp32 floor
(``agreement.model_floor``: log2(n) ulp per step, n the parameter count; measured ~1e-7 of ~7e-6).
"""

import pytest
import torch

from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import model_floor

STEPS, BATCH = 3, 2


def _data(seq: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, 256, (steps, BATCH, seq + 1), generator=g)
    batches = []
    for s in range(steps):
        labels = tokens[s, :, 1:].clone()  # shifted before sharding
        labels[:, :3] = -100
        batches.append(
            {
                "input_ids": tokens[s, :, :-1].clone(),
                "shift_labels": labels,
                "position_ids": torch.arange(seq).expand(BATCH, seq).clone(),
            }
        )
    return batches


def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = preset_config("tiny-llama")
    config.use_cache = False
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _bound() -> float:
    """The rule's fp32 floor for this model over ``STEPS`` steps (relative, on the losses)."""
    return model_floor(preset_config("tiny-llama"), STEPS)


def _loss(model, batch, group=None):
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    labels = batch["shift_labels"]
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    count = (labels != -100).sum()
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(count, group=group)
    return total / count


def _train_single(batches):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        loss = _loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train_cp(batches, strategy, pad_to_cp):
    import torch.distributed as dist

    from ndparallel import ParallelismConfig
    from ndparallel.parallel.cp.context import (
        apply_context_parallel,
        context_parallel_buffers,
    )
    from ndparallel.parallel.cp.sharding import pad_for_cp
    from ndparallel.parallel.options import CPOptions

    cp = dist.get_world_size()
    mesh = ParallelismConfig(cp_size=cp).build_device_mesh("cpu")["cp"]
    group = mesh.get_group()
    model = apply_context_parallel(_model(), mesh, CPOptions(comm_strategy=strategy))
    assert model.config._attn_implementation.startswith(f"ndparallel_cp_{strategy}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        if pad_to_cp:
            batch = pad_for_cp(batch, cp, pad_token_id=0)
        full_len = batch["input_ids"].shape[1]
        keys = ["input_ids", "shift_labels", "position_ids"]
        with context_parallel_buffers(mesh, [batch[k] for k in keys], [1, 1, 1]):
            assert batch["input_ids"].shape[1] == full_len // cp
            loss = _loss(model, batch, group)
            loss.backward()
        assert batch["input_ids"].shape[1] == full_len  # restored
        for p in model.parameters():  # replicated over cp: sum the per-rank shares
            dist.all_reduce(p.grad, group=group)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item())
    return losses


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_cp_training_equals_one_process(cp, strategy):
    batches = _data(seq=32)
    expected = _train_single(batches)
    got = run_on_ranks(_train_cp, cp, batches, strategy, False, timeout_s=180)
    for rank_losses in got:
        rel = max(abs(a - b) / abs(b) for a, b in zip(rank_losses, expected))
        assert rel <= _bound(), (rel, _bound(), rank_losses, expected)


def test_cp_training_with_padding_equals_unpadded_one_process():
    """Odd length 30 padded to 32 (ignored labels, positions continuing): same losses as 30."""
    batches = _data(seq=30)
    expected = _train_single(batches)
    got = run_on_ranks(_train_cp, 4, batches, "ring", True, timeout_s=180)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, expected)) <= _bound(), (got, expected)


def _buffers_and_errors():
    import torch.distributed as dist

    from ndparallel.parallel.cp.context import (
        apply_context_parallel,
        context_parallel_buffers,
    )

    group = dist.group.WORLD
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    ids_storage = ids.untyped_storage().data_ptr()
    with context_parallel_buffers(group, [ids, labels, ids], [1, 1, 1], no_restore_buffers=[labels]):
        local = ids.tolist()
    assert ids.shape == (2, 8) and ids.untyped_storage().data_ptr() == ids_storage
    assert torch.equal(ids, torch.arange(16).view(2, 8))
    assert labels.shape == (2, 4)  # listed in no_restore_buffers: stays sharded
    try:
        with context_parallel_buffers(group, [torch.zeros(1, 6)], [1]):
            pass
        raise AssertionError("length 6 with cp 2 must raise")
    except ValueError as e:
        assert "pad_for_cp" in str(e)
    model = apply_context_parallel(_model(), group)
    x = torch.arange(8).view(1, 8)
    try:
        model(input_ids=x, position_ids=x, attention_mask=torch.tensor([[1] * 7 + [0]]))
        raise AssertionError("a padding mask must raise")
    except ValueError as e:
        assert "padding mask" in str(e)
    return local


def test_buffers_sharded_in_place_and_restored_and_padding_mask_rejected():
    r0, r1 = run_on_ranks(_buffers_and_errors, 2, timeout_s=60)
    assert r0 == [[0, 1, 6, 7], [8, 9, 14, 15]] and r1 == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_validate_context_parallel_errors():
    from ndparallel.parallel.cp.context import validate_context_parallel

    config = preset_config("tiny-llama")  # 4 heads, 2 kv heads
    validate_context_parallel(config, cp_size=2, seq_len=64, tp_size=2)
    with pytest.raises(ValueError, match=r"sequence_len=30 .*context_parallel_size = 4"):
        validate_context_parallel(config, cp_size=2, seq_len=30)
    with pytest.raises(ValueError, match="num_key_value_heads=2 .*tensor_parallel_size=4"):
        validate_context_parallel(config, cp_size=2, seq_len=64, tp_size=4)
    with pytest.raises(ValueError, match="cp_comm_strategy='nccl'"):
        validate_context_parallel(config, cp_size=2, strategy="nccl")
    # ulysses: query heads per TP rank divisible by cp; K/V heads per TP rank divide or are divided
    validate_context_parallel(config, cp_size=4, seq_len=64, strategy="ulysses")  # 4 | 4, 2 | 4
    validate_context_parallel(config, cp_size=2, seq_len=64, tp_size=2, strategy="ulysses")
    with pytest.raises(ValueError, match=r"ulysses.*4 attention heads .* context_parallel_size=8"):
        validate_context_parallel(config, cp_size=8, seq_len=64, strategy="ulysses")
    config.num_attention_heads, config.num_key_value_heads = 12, 6
    with pytest.raises(ValueError, match=r"6 key/value heads .*context_parallel_size=4"):
        validate_context_parallel(config, cp_size=4, seq_len=64, strategy="ulysses")
