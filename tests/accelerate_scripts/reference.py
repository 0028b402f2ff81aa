"""Our own loop (``ndparallel.engine.forward_backward``, layout-invariant loss) on one
process, over the same global batches the Accelerate-style scripts see, for the comparison."""

import torch
from transformers import AutoModelForCausalLM

from ndparallel import Accelerator
from ndparallel.engine import forward_backward

from .nd_utils import get_dataset, setup_tokenizer


def global_batches(model_dir: str, seq_len: int, dp: int, steps: int, micro: int = 1):
    """Step k, micro-batch m: dataset rows of the interleaved dp sharding (dp rank r reads rows
    r, r+dp, ...), i.e. rows [(k·micro+m)·dp, ...+dp)."""
    ds = get_dataset(setup_tokenizer(model_dir), seq_len)
    out = []
    for k in range(steps):
        mbs = []
        for m in range(micro):
            rows = ds[(k * micro + m) * dp : (k * micro + m + 1) * dp]
            mbs.append(
                {
                    "input_ids": torch.tensor(rows["input_ids"]),
                    "shift_labels": torch.tensor(rows["shift_labels"]),
                    "position_ids": torch.tensor(rows["position_ids"]),
                }
            )
        out.append(mbs)
    return out


def reference_losses(
    model_dir: str, seq_len: int, dp: int, steps: int, lr: float, micro: int = 1, return_params: bool = False
):
    acc = Accelerator(gradient_accumulation_steps=micro)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_cache=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt = acc.prepare(model, opt)
    losses = []
    for mbs in global_batches(model_dir, seq_len, dp, steps, micro):
        losses.append(float(forward_backward(acc.engine, model, mbs)))
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()} if return_params else None
    return (losses, params) if return_params else losses
