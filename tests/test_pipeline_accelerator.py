"""The Accelerate-compatible facade under pipeline parallel: ``ParallelismConfig(pp_size=2)``,
``prepare``, ``pipeline_step``, ``clip_grad_norm_``, ``optimizer.step`` train the same model as the
plain per-micro-batch loop on one process."""

from __future__ import annotations

import torch

from ndparallel.testing import run_on_ranks

STEPS, MICRO, ROWS, SEQ = 2, 2, 2, 16


def _batches(vocab: int):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(MICRO):
            t = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)
            step.append(
                {
                    "input_ids": t[:, :-1].contiguous(),
                    "shift_labels": t[:, 1:].contiguous(),
                    "position_ids": torch.arange(SEQ).expand(ROWS, -1).clone(),
                }
            )
        out.append(step)
    return out


def _loop(pp: int):
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.presets import preset_config
    from ndparallel.tools.equivalence import full_parameters

    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=pp))
    config = preset_config("tiny-llama-tied", num_hidden_layers=4)
    torch.manual_seed(0)
    model = acc.prepare(AutoModelForCausalLM.from_config(config))
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for step in _batches(config.vocab_size):
        if pp > 1:
            loss = acc.pipeline_step(model, step)
        else:
            n = acc.global_num_items(step)
            loss = torch.zeros(())
            for mb in step:
                part = acc.forward_loss(model, mb, n)
                acc.backward(part, num_items_in_batch=n)
                loss += part.detach()
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    params = full_parameters(model)
    if pp > 1:
        from ndparallel.parallel.pp.schedule import gather_stage_states

        params = gather_stage_states(acc.engine, params)
    return losses, params


def test_pipeline_step_trains_what_one_process_trains():
    ref_losses, ref_params = run_on_ranks(_loop, 1, 1)[0]
    losses, params = run_on_ranks(_loop, 2, 2)[0]
    assert max(abs(a - b) / abs(a) for a, b in zip(ref_losses, losses)) <= 1e-5, (ref_losses, losses)
    assert set(params) == set(ref_params)
    assert max((params[k] - ref_params[k]).abs().max().item() for k in params) <= 1e-6
