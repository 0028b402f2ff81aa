"""``runtime/memory_probe.py``'s tensor bytes, what ``simulate`` measures on CPU: host copies (the
activation offloader's, pinned host memory on a GPU) are counted apart from the device's bytes,
and ``trace`` names what is alive at the peak."""

from __future__ import annotations

import torch

from ndparallel.runtime.memory_probe import LiveBytes, host_allocations

MiB = 2**20


def test_host_allocations_are_counted_apart():
    x = torch.ones(MiB // 4)  # made before the window: not counted
    live = LiveBytes()
    with live:
        a = x * 2  # 1 MiB of device memory
        with host_allocations():
            h = a.clone()  # 1 MiB of host memory
        del a
        b = h + 1  # back on the device: 1 MiB
        del h
    assert live.peak == MiB, live.peak
    assert (live.host_peak, live.host_cur) == (MiB, 0), (live.host_peak, live.host_cur)
    assert live.cur == MiB and b.numel() == MiB // 4


def test_trace_names_the_allocations_alive_at_the_peak():
    x = torch.ones(MiB // 4)
    live = LiveBytes(trace=True)
    with live:
        a = x * 2
        b = x + 1
        del a
        c = torch.cat([b, b])  # the peak: b (1 MiB) and c (2 MiB)
        del b, c
    held = {origin[0]: n for origin, n in live.at_peak()}
    assert live.peak == 3 * MiB and held == {"add.Tensor": MiB, "cat.default": 2 * MiB}, held
    origin = live.at_peak()[0][0]
    assert origin[2].startswith("test_memory_probe.py:"), origin  # the frame that made it


def test_offloaded_layer_inputs_are_host_memory():
    """A 2-layer model with checkpointing and CPU offloading: the offloader's host copies are
    ``host_peak`` (its own count of them), not the device's bytes; each restore in backward is a
    fresh device tensor, as a GPU allocates one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ndparallel.techniques.offload import ActivationOffloader

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    offloader = ActivationOffloader()
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = offloader.wrap(layer._gradient_checkpointing_func)
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    live = LiveBytes()
    with live:
        model(input_ids=ids, labels=ids).loss.backward()
    layer_input = 256 * 64 * 4
    assert offloader.stats.offloaded == 2 and offloader.stats.restored == 2
    assert live.host_peak == offloader.stats.peak_host_bytes == 2 * layer_input, live.host_peak
    assert live.host_cur == 0  # freed with the graph


def test_rmsnorm_backward_holds_five_fp32_copies_of_its_input():
    """What ``plan/memory/activations.py: norm_backward_per_token`` counts (``20·h`` per token):
    HF's RMSNorm
    (fp32 inside, bf16 weight as under FSDP's param dtype) allocates in its backward, alive at once
    at the peak, five fp32 ``[T, h]`` tensors — the gradient through ``x·rsqrt``, the mean's
    expanded gradient, and pow's ``x¹``, ``2·x¹`` and product — plus per-token and per-channel
    vectors. The same autograd formulas run on a GPU."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    tokens, h = 512, 256
    norm = LlamaRMSNorm(h).to(torch.bfloat16)
    x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    live = LiveBytes(trace=True)
    with live:
        y.backward(torch.randn_like(y))
    made_in_backward = {origin: n for origin, n in live.at_peak() if origin[1]}
    fp32_copies = [n for n in made_in_backward.values() if n == 4 * tokens * h]
    assert len(fp32_copies) == 5, made_in_backward
    assert sum(made_in_backward.values()) - 5 * 4 * tokens * h <= 4 * (tokens + h), made_in_backward
