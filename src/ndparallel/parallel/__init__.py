"""One module per parallel strategy; each is a function ``(model, mesh, options) -> model``."""
