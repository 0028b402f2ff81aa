"""An Axolotl plugin (``plugins: [axolotl_count_plugin.CountTokens]``) that measures what Axolotl's
trainer computes, for ``axolotl_speed.py``: per micro-batch its training step receives (the
batches are collated in its loader's workers), the tokens that are not padding (``attention_mask``
!= 0: its packed batches number the samples 1, 2, ... there) and all the tokens (``input_ids``);
and the wall time of each optimizer step (a ``TrainerCallback``: from the
start of training, then from the end of the step before). It runs in Axolotl's venv; it changes
no batch. Written to ``output_dir/measured.json`` when training ends."""

from __future__ import annotations

import json
import time
from pathlib import Path

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback


class _Steps(TrainerCallback):
    def __init__(self, out: dict):
        self.out = out
        self.last = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.out["step_s"].append(now - self.last)
        self.last = now


class CountTokens(BasePlugin):
    def post_trainer_create(self, cfg, trainer):
        self.out = {"batches": [], "step_s": []}
        self.path = Path(cfg.output_dir) / "measured.json"
        inner = trainer.training_step  # the batches as the step gets them (collated in workers)

        def training_step(model, inputs, *args, **kwargs):
            ids, mask = inputs["input_ids"], inputs.get("attention_mask")
            real = int((mask != 0).sum()) if mask is not None else ids.numel()
            self.out["batches"].append({"real": real, "computed": ids.numel(), "rows": ids.shape[0]})
            return inner(model, inputs, *args, **kwargs)

        trainer.training_step = training_step
        trainer.add_callback(_Steps(self.out))

    def post_train(self, cfg, model):
        self.path.write_text(json.dumps(self.out))
