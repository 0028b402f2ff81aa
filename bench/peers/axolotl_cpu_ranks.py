"""Runs inside Axolotl's venv, under ``torchrun`` on CPU: Axolotl's own ``train`` CLI with each
rank's model loaded on the CPU.

    python -m torch.distributed.run --nproc-per-node N axolotl_cpu_ranks.py CFG.yaml

Axolotl 0.19's ``normalize_config`` sets ``device_map: {"": LOCAL_RANK}`` whenever ``WORLD_SIZE`` > 1,
which transformers reads as a CUDA device ("Cannot access accelerator device when none is
available"); on a machine without one, this puts each rank's model on the CPU after it (Axolotl has
no key for it: the line overrides the config's ``device_map``). Nothing else changes: the trainer,
its DDP over gloo and its loss are Axolotl's.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # its axolotl.py is not Axolotl


def main() -> None:
    import axolotl.cli.config as cli_config
    import fire
    from axolotl.cli.train import do_cli

    normalize = cli_config.normalize_config

    def normalize_on_cpu(cfg):
        normalize(cfg)
        if cfg.device == "cpu":
            cfg.device_map = {"": "cpu"}

    cli_config.normalize_config = normalize_on_cpu
    sys.argv = ["axolotl.cli.train", *sys.argv[1:]]
    fire.Fire(do_cli)


if __name__ == "__main__":
    main()
