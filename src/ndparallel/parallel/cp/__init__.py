"""Context parallelism on the ``cp`` mesh: ``context`` (the strategy: validation, attention hook,
batch sharding), ``parallel_attention`` (ring / all-gather exact attention), ``ulysses`` (heads <->
sequence all-to-all), ``sharding`` (load-balanced sequence chunks), ``exchange`` (the collectives),
and the attention they run: ``attention_kernels`` (the block kernels, log-sum-exp merged) and
``attention_blocks`` (document-aware block geometry; ``parallel/document_attention.py`` runs them
without CP too)."""
