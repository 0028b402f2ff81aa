"""Training techniques that are not a parallel dimension: they split nothing over ranks and compose
with every layout. Precision (``float8``, ``qat``, ``master_weights``), activation memory
(``tiled_mlp``, ``offload``), ``compile``, and the layout-invariant loss (``loss``, ``lm_loss``,
``chunked_ce``, ``router_loss``) and gradient norm (``grad_norm``). ``parallel/parallelize.py``
applies them in its order; nothing here imports ``ndparallel.parallel``."""
