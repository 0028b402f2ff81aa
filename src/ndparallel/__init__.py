"""ndparallel: N-dimensional parallel training (DP, FSDP2, TP, CP, PP, EP) for Hugging Face causal LMs."""

from ndparallel.layout.config import ParallelismConfig, ParallelismConfigError

__version__ = "0.1.0"

__all__ = ["ParallelismConfig", "ParallelismConfigError", "__version__"]


def __getattr__(name: str):
    # The Accelerator pulls in torch.distributed and transformers: import it only when asked for.
    if name == "Accelerator":
        from ndparallel.accelerator import Accelerator

        return Accelerator
    raise AttributeError(name)
