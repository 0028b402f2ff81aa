"""The planner: which (pp, dp_replicate, dp_shard, cp, tp, ep) layout fits and is fastest, and with
which settings (docs/planner.md).

One folder per concept, named after what it prices; import each name from its home:

- ``settings.py``: ``Settings``, the run's options as the planner prices them (the YAML's names);
  ``models.py`` and ``hardware.py``: what is planned for.
- ``search/``: the request, the layouts tried, each layout's options, the ranking, ``--max-seq-len``.
- ``memory/``: peak memory per GPU (activations, states, logits, buffers).
- ``time/``: step time (GEMMs, attention, memory-bound ops, recomputation) and the collectives.
- ``pipeline/``, ``adapters/``, ``moe_cost.py``, ``muon_cost.py``: what pipeline parallel, LoRA /
  QLoRA, experts and Muon add to both.
- ``calibrate/``: measuring a machine (``plan --calibrate``).
- ``cli/``: ``ndparallel plan``: its one flag table, parsing, checks and output.
"""
