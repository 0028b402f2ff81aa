"""Pipeline parallelism on the ``pp`` mesh: ``split`` (which layers each stage runs; pure
arithmetic), ``stages`` (cut a Hugging Face model into stages), ``schedule`` (one step's
micro-batches through torch's pipeline schedules)."""
