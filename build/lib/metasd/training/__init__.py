"""Training (``metasd train``): verifier feature sets over ShareGPT, then the steering, block, TreeFlash and
hidden-state trainers on one step loop (``loop.py``). Builds on ``metasd.config``, the drafters' networks and
everything below them; nothing below imports it."""
