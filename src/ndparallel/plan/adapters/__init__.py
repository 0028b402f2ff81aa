"""LoRA and QLoRA in the planner (``models/adapters.py``, ``models/quantized.py``): adapter sizes, the
trained copies of tables, the 4-bit base, and what they change in memory, time and collectives."""
