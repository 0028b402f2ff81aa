"""Step time: the compute of one micro-batch by op class (GEMMs, attention, memory-bound ops,
recomputation), the step's extras, and every collective with the links it runs on."""
