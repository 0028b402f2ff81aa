"""The YAML front door (beside ``ndparallel.accelerator``, the Python one): a config file read
(``load``), Axolotl's keys translated into ``TrainConfig``'s fields (``translate``, ``layout``,
``checkpoint``, driven by the table in ``keys``), and the docs' key tables generated (``doc``)."""

from ndparallel.axolotl.load import load_config, own_keys
from ndparallel.config.errors import ConfigError

__all__ = ["ConfigError", "load_config", "own_keys"]
