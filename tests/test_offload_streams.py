"""The offloader's stream protocol, replayed on CPU with simulated asynchronous copies: a copy is
queued on a 'side stream' and lands only when the compute side waits for its event (or a later
one: the queue is FIFO, like one CUDA stream). Restored tensors start as NaN, so using one before
waiting for its copy poisons the gradients. Checks: exact gradients with deferred copies, the
in-flight bound of the forward copies, the prefetch order, and a negative control (a wait that
does nothing) that the check catches."""

import math

import torch

from ndparallel.models.presets import preset_config
from ndparallel.techniques.offload import ActivationOffloader, OffloadedCheckpoint


class DeferredStreams:
    """Simulated side stream: copies run in order, only when an event at or after them is waited."""

    device_type = "cpu"

    def __init__(self, honour_waits: bool = True):
        self.queue: list = []  # (event, kind, copy)
        self.next_event = 0
        self.honour_waits = honour_waits
        self.max_pending_to_host = 0
        self.restored_order: list[float] = []

    def _enqueue(self, kind, copy):
        self.next_event += 1
        self.queue.append((self.next_event, kind, copy))
        pending = sum(1 for _, k, _ in self.queue if k == "to_host")
        self.max_pending_to_host = max(self.max_pending_to_host, pending)
        return self.next_event

    def to_host(self, x):
        host = torch.full(x.shape, math.nan, dtype=x.dtype)
        src = x.detach()
        return host, self._enqueue("to_host", lambda: host.copy_(src))

    def to_device(self, host, device):
        dev = torch.full(host.shape, math.nan, dtype=host.dtype, device=device)

        def copy():
            dev.copy_(host)
            self.restored_order.append(float(host.double().sum()))

        return dev, self._enqueue("to_device", copy)

    def wait(self, event):
        if not self.honour_waits or event is None:
            return
        while self.queue and self.queue[0][0] <= event:
            self.queue.pop(0)[2]()


def _grads(streams=None, max_in_flight=2, layers=4):
    from transformers import AutoModelForCausalLM

    cfg = preset_config("tiny-llama")
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    offloader = None
    if streams is not None:
        offloader = ActivationOffloader(streams, max_in_flight=max_in_flight)
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = OffloadedCheckpoint(
                offloader, layer._gradient_checkpointing_func
            )
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    inputs: list[float] = []  # each layer's input in the forward (the hooks run outside the checkpoint)
    handles = [
        layer.register_forward_pre_hook(lambda m, a: inputs.append(float(a[0].detach().double().sum())))
        for layer in model.model.layers
    ]
    loss = model(input_ids=ids, labels=ids).loss
    for h in handles:
        h.remove()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], offloader, inputs


def test_deferred_copies_give_exact_gradients_and_prefetch_in_backward_order():
    ref, _, _ = _grads()
    streams = DeferredStreams()
    got, off, inputs = _grads(streams)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert (off.stats.offloaded, off.stats.restored, off.stats.prefetched) == (4, 4, 3), off.stats
    # restored last layer first, each next one prefetched: the layer inputs in reverse order
    assert streams.restored_order == list(reversed(inputs)), (streams.restored_order, inputs)


def test_forward_copies_in_flight_are_bounded():
    streams = DeferredStreams()
    _grads(streams, max_in_flight=1)
    assert streams.max_pending_to_host == 2  # the new copy and at most max_in_flight older ones
    streams = DeferredStreams()
    _grads(streams, max_in_flight=3)
    assert streams.max_pending_to_host == 4


def test_negative_control_a_missing_wait_is_caught():
    got, _, _ = _grads(DeferredStreams(honour_waits=False))
    assert not all(torch.isfinite(g).all() for g in got)
