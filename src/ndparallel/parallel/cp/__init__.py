"""Context parallelism on the ``cp`` mesh: ``context`` (the strategy: validation, attention hook,
batch sharding), ``parallel_attention`` (ring / all-gather exact attention), ``ulysses`` (heads <->
sequence all-to-all), ``sharding`` (load-balanced sequence chunks), ``exchange`` (the collectives)."""
