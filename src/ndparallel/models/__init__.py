"""Model-family knowledge: presets, decoder-layer classes, TP plans. No parallel code here."""
