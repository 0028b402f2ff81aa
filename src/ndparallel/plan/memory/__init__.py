"""Peak memory per GPU of one layout and its settings: the states (parameters, gradients, optimizer),
the saved activations and what backward holds beyond them, the logits, FSDP's buffers; each
runtime option's share in the module named after it."""
