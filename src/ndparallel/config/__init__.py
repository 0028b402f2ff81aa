"""The typed run configuration: ``TrainConfig`` (``schema``) and its parts — field groups
(``fields``), ``datasets:`` entries (``datasets``), quantisation (``quant``), pipeline stages
(``pipeline``), one-line validation messages (``errors``) and ``--set`` overrides (``overrides``).
It knows ndparallel's fields only: the YAML front door (``ndparallel.axolotl``) translates
Axolotl's keys into them."""

from ndparallel.config.errors import ConfigError
from ndparallel.config.schema import TrainConfig

__all__ = ["ConfigError", "TrainConfig"]
