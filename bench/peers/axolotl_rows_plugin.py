"""An Axolotl plugin (``plugins: [axolotl_rows_plugin.RecordRows]``) that records which of its
training examples each packed row holds, for ``axolotl_rows.py``: per micro-batch its training
step receives, each row cut where ``position_ids`` restarts at 0 (a packed sample starts there),
each piece looked up by its tokens among the trainer's dataset (Axolotl's shuffled, prepared
examples). It runs in Axolotl's venv and changes no batch. Written to
``output_dir/rows_rank<R>.json`` when training ends."""

from __future__ import annotations

import json
import os
from pathlib import Path

from axolotl.integrations.base import BasePlugin


class RecordRows(BasePlugin):
    def post_trainer_create(self, cfg, trainer):
        rank = int(os.environ.get("RANK", "0"))
        self.path = Path(cfg.output_dir) / f"rows_rank{rank}.json"
        index = {tuple(ex["input_ids"]): i for i, ex in enumerate(trainer.train_dataset)}
        self.out = {"examples": len(index), "micro_batches": []}
        inner = trainer.training_step

        def training_step(model, inputs, *args, **kwargs):
            rows = []
            for ids, pos in zip(inputs["input_ids"].tolist(), inputs["position_ids"].tolist()):
                starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
                pieces = [tuple(ids[a:b]) for a, b in zip(starts, starts[1:])]
                # the padding after the last sample restarts at 0 too: not an example
                rows.append([index[p] for p in pieces if p in index])
            step = trainer.state.global_step
            self.out["micro_batches"].append({"step": step, "rows": rows})
            return inner(model, inputs, *args, **kwargs)

        trainer.training_step = training_step

    def post_train(self, cfg, model):
        self.path.write_text(json.dumps(self.out))
