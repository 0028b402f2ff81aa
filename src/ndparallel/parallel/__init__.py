"""The parallel dimensions, a folder each: ``tp/`` (tensor, sequence and loss parallel), ``cp/``
(context parallel), ``pp/`` (pipeline), ``ep/`` (expert), and FSDP / HSDP (``fsdp``). Shared by
them: the strategies' ``options``, ``positions``, the document-masked attention TP and CP both use
(``document_attention`` over ``attention_blocks`` / ``attention_kernels``), ``support`` (can this
layout run this model) and ``parallelize`` (the one order they are applied in)."""
