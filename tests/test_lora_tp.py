"""Tensor-parallel LoRA adds no activation collective: A/B are sharded with their base linear.

One forward and one backward under TP 2 are recorded with ``CommProfiler`` for the same model
trained fully and with LoRA on every linear. Forward: the very same collectives. Backward: LoRA
issues a subset of the full model's (a frozen base needs no input gradient below the first
adapter) plus exactly one all-reduce of r·d elements per adapted linear, the gradient of its
replicated factor (A for column-wise, B for row-wise bases).
"""

from collections import Counter

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch

from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import TPOptions
from ndparallel.testing import run_on_ranks

R = 4
CONFIG = preset_config("tiny-llama")
N_ADAPTED = CONFIG.num_hidden_layers * 7  # q k v o gate up down


def _profile(lora: bool, sequence_parallel: bool):
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapters import lora_config
    from ndparallel.runtime.comm_profile import CommProfiler

    acc = Accelerator(ParallelismConfig(tp_size=2), tp_options=TPOptions(sequence_parallel=sequence_parallel))
    adapter = lora_config(r=R, alpha=2 * R, target_linear=True) if lora else None
    model = acc.load_model(CONFIG, adapter=adapter)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, CONFIG.vocab_size, (2, 32), generator=g)
    pos = torch.arange(32).expand(2, -1)
    n = acc.global_num_items([{"shift_labels": labels}])
    with CommProfiler(acc.torch_device_mesh) as prof:
        logits = model(input_ids=ids, position_ids=pos).logits
        loss = acc.causal_lm_loss(logits, labels, n)
        prof.step()
        acc.backward(loss, num_items_in_batch=n)
        prof.step()
    trainable = sum(p.requires_grad for p in model.parameters())
    return prof.calls(0), prof.calls(1), trainable


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_lora_adds_only_the_replicated_factor_gradients(sequence_parallel):
    full_fwd, full_bwd, _ = run_on_ranks(_profile, 2, False, sequence_parallel)[0]
    lora_fwd, lora_bwd, trainable = run_on_ranks(_profile, 2, True, sequence_parallel)[0]
    assert trainable == 2 * N_ADAPTED
    assert lora_fwd == full_fwd  # forward: identical collectives, op by op and byte by byte
    extra = Counter(lora_bwd) - Counter(full_bwd)
    # the replicated factor: A (r × hidden) of q,k,v,gate,up; B (hidden × r) of o_proj, down_proj
    assert extra == Counter({("tp", "all_reduce", R * CONFIG.hidden_size * 4): N_ADAPTED}), extra
    assert sum(lora_bwd.values()) - N_ADAPTED <= sum(full_bwd.values())
    # the activation collectives of backward are still there (not everything vanished)
    assert any(bytes_ >= 2 * 32 * CONFIG.hidden_size for (_, _, bytes_) in lora_bwd)
