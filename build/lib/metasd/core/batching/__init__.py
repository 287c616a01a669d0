"""Running many requests through one verifier: the ``Scheduler`` (continuous batching: admission, chunked prefill,
one batched verify forward per step), the handles its callers hold, offline batch generation, and adaptive
speculation (the allocator's plan for the running batch)."""
