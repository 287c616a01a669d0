"""metasd: lossless speculative decoding with a pool of drafters and a bandit policy.

>>> import metasd
>>> engine = metasd.load_pool()              # the embedded default pool (bundled Qwen pair); = Engine.from_config()
>>> engine.generate("Write a haiku about caches.", max_new_tokens=64, chat=True).text

Layers, lowest first (docs/architecture.md): ``metasd.core`` (one request), ``metasd.models`` (loading, cache,
quantization), ``metasd.drafters`` and ``metasd.policies`` (the plugins), ``metasd.config`` (pool files),
``metasd.bench`` (``metasd bench``) and ``metasd.training``, ``metasd.cli``.
"""
from metasd.config import ConfigError, load_pool
from metasd.core import (Draft, Drafter, Engine, GenerationResult, Policy, RequestStats, SamplingParams, StepContext,
                         StepFeedback, Verifier, register_drafter, register_policy)

__version__ = "0.1.0"
__all__ = [
    "ConfigError", "Draft", "Drafter", "Engine", "GenerationResult", "Policy", "RequestStats", "SamplingParams",
    "StepContext", "StepFeedback", "Verifier", "load_pool", "register_drafter", "register_policy",
]
