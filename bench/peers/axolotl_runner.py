"""Runs inside Axolotl's venv: ``axolotl preprocess``'s own steps (``axolotl.cli.preprocess.do_cli``:
``load_cfg`` then ``load_datasets``) for each config given, in one process (Axolotl's imports take
minutes on a loaded CPU), and writes the prepared training examples as JSON.

    python axolotl_runner.py OUT_DIR CASE.yaml ...
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

os.environ.update(AXOLOTL_IS_PREPROCESS="1", AXOLOTL_DO_NOT_TRACK="1", DO_NOT_TRACK="1")


class Warnings(logging.Handler):
    """Axolotl's own warnings (not its dependencies')."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        if record.name.startswith("axolotl"):
            self.lines.append(record.getMessage())


def main(out: str, *paths: str) -> None:
    from axolotl.cli.args import PreprocessCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.utils.trainer import disable_datasets_caching

    for path in paths:
        name = Path(path).stem
        handler = Warnings()
        for logger in ("", "axolotl"):  # Axolotl's own logger does not propagate to the root
            logging.getLogger(logger).addHandler(handler)
        try:
            cfg = load_cfg(path, is_preprocess=True)
            cfg.is_preprocess = True
            with disable_datasets_caching():
                meta = load_datasets(cfg=cfg, cli_args=PreprocessCliArgs())
            ds = meta.train_dataset
            cols = [c for c in ("input_ids", "labels", "position_ids") if c in ds.column_names]
            rows = [{c: [int(v) for v in r[c]] for c in cols} for r in ds]
            result = {"examples": rows}
        except Exception as e:  # noqa: BLE001 - recorded in the fixture
            result = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for logger in ("", "axolotl"):
                logging.getLogger(logger).removeHandler(handler)
        result["warnings"] = sorted(set(handler.lines))
        Path(out, f"{name}.json").write_text(json.dumps(result))
        print(f"{name}: {len(result.get('examples', []))} examples", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
