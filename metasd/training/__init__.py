"""Training recipes for drafters and steering modules, on verifier features over ShareGPT."""
