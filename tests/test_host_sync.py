"""The training step never waits for the device: no value is read back to the host (``.item()``,
``float()``, ``bool()``, data-dependent shapes) during forward, backward and gradient clipping.

On CUDA each such read is a device synchronisation that stalls the queue of kernels; the trainer
reads the loss and grad norm only on logging steps. CPU has no device queue, so the reads are
counted instead: a dispatch mode records the ops that synchronise on CUDA (``_local_scalar_dense``
behind ``item``/``float``/``bool``, ``nonzero`` and friends behind boolean indexing), on every
rank and every layout below. The negative control proves the counter sees a ``float(loss)``.

One read is transformers' own and expected: with ``position_ids`` and no attention mask, its mask
code checks whether a row packs several documents (``find_packed_sequence_indices``: one
``.all()`` per forward). It is counted apart, and must be exactly one per micro-batch.
Under CP the document-masked attention plans its blocks on the host from one host copy of the
position ids per micro-batch (``attention_blocks.document_starts``; the planning itself then runs on that
CPU copy and is not a device read). The copies are counted apart too: one per micro-batch.
"""

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.parallel.options import TPOptions
from ndparallel.testing import run_on_ranks

SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "is_nonzero",
    "equal",
    "repeat_interleave",
}


class HostSyncCounter(TorchDispatchMode):
    """Counts aten ops that make a CUDA host wait for the device (DTensor ops are seen once their
    local tensors are dispatched)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func.overloadpacket.__name__
        if name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            name = "index(bool mask)"  # the mask's nonzero count sets the output shape
        if _called_from(CP_PLAN):
            pass  # host-side planning on the host copy made by document_starts (counted apart)
        elif name in SYNC_OPS or name == "index(bool mask)":
            self.calls.append(HF_PACKED if _called_from(HF_PACKED) else name)
        return func(*args, **(kwargs or {}))


HF_PACKED = "find_packed_sequence_indices"
CP_COPY, CP_PLAN = "document_starts", "_chunk_runs"


def _count_host_copies() -> list[str]:
    """A list that receives one entry per call of ``document_starts`` (the one host copy of the
    position ids) by the CP attention or the document attention TP + SP uses: the name is looked up
    at call time in each module, so rebinding it works (in a forked rank only)."""
    import ndparallel.parallel.cp.parallel_attention as cpa
    import ndparallel.parallel.document_attention as doc

    original, calls = cpa.document_starts, []

    def counting(*args, **kwargs):
        calls.append(CP_COPY)
        return original(*args, **kwargs)

    cpa.document_starts = doc.document_starts = counting
    return calls


def _called_from(function_name: str) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function_name:
            return True
        frame = frame.f_back
    return False


def _count_step_syncs(layout, parallel_kwargs, control=False):
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.engine import forward_backward
    from ndparallel.models.presets import preset_config
    from ndparallel.tools.equivalence import (
        TrainSetup,
        build_model,
        make_global_batches,
    )

    setup = TrainSetup(preset_config("tiny-llama"), steps=2, global_micro_batch=4, seq_len=32, grad_accum=2)
    acc = Accelerator(ParallelismConfig(**layout), gradient_accumulation_steps=2, **parallel_kwargs)
    model = acc.prepare(build_model(setup))
    counts, copies = [], _count_host_copies()
    for micro in make_global_batches(setup):  # step 1 warms up (lazy init), step 2 is counted
        rows = setup.global_micro_batch // acc.dp_size
        local = [{k: v[acc.dp_rank * rows : (acc.dp_rank + 1) * rows] for k, v in mb.items()} for mb in micro]
        copies.clear()
        with HostSyncCounter() as counter:
            loss = forward_backward(acc.engine, model, local)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            if control:
                float(loss)
        model.zero_grad(set_to_none=True)
        counts.append(counter.calls + copies)
    return counts[-1]


CASES = {
    "one process": ({}, 1, {}),
    "fsdp2": ({"dp_shard_size": 2}, 2, {}),
    "tp2 sp": ({"tp_size": 2}, 2, {"tp_options": TPOptions(sequence_parallel=True)}),
    "cp2": ({"cp_size": 2}, 2, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_step_reads_nothing_back(case):
    layout, world, kwargs = CASES[case]
    for rank, calls in enumerate(run_on_ranks(_count_step_syncs, world, layout, kwargs)):
        ours = [c for c in calls if c not in (HF_PACKED, CP_COPY)]
        assert ours == [], f"rank {rank}: host syncs in the step: {calls}"
        assert calls.count(HF_PACKED) == 2, calls  # transformers' check: one per micro-batch
        # ndparallel's document attention (CP, and TP + sequence parallel, whose mask transformers
        # cannot build from the sharded length): one host copy of the positions per micro-batch,
        # shared by every layer and backward
        ours_attention = (
            layout.get("cp_size", 1) > 1 or kwargs.get("tp_options", TPOptions()).sequence_parallel
        )
        assert calls.count(CP_COPY) == (2 if ours_attention else 0), calls


def test_negative_control_counts_a_float_of_the_loss():
    calls = run_on_ranks(_count_step_syncs, 1, {}, {}, True)[0]
    assert [c for c in calls if c != HF_PACKED] == ["_local_scalar_dense"], calls


def test_counter_sees_item_and_boolean_indexing():
    x = torch.arange(6.0)
    with HostSyncCounter() as counter:
        x.sum().item()
        x[x > 2].sum()
        bool(x.any())
    assert counter.calls == ["_local_scalar_dense", "index(bool mask)", "_local_scalar_dense"], counter.calls
