"""Executing forwards: how a verify forward over a draft tree (or a drafter's forward) runs and what it leaves in
the KV cache. The verifier for one request (``Verifier``) and for a batch (``BatchVerifier`` over ``BatchCache``),
KV-cache bookkeeping (keep / drop positions), draft trees and their ancestor masks, the hidden-state store, host ->
device staging and the step clock. Imports nothing else of the core (docs/architecture.md#the-execution-layer-runners-kv-memory-and-random-streams)."""
