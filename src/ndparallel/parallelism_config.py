"""``from ndparallel.parallelism_config import ParallelismConfig`` mirrors Accelerate's module path,
so a script ports by replacing ``accelerate`` with ``ndparallel`` in its imports."""

from ndparallel.layout.config import ParallelismConfig

__all__ = ["ParallelismConfig"]
