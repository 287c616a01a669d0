"""metasd: lossless speculative decoding with a pool of drafters and a bandit policy.

>>> from metasd import Engine
>>> engine = Engine.from_config()            # the embedded default pool (bundled Qwen pair)
>>> engine.generate("Write a haiku about caches.", max_new_tokens=64, chat=True).text
"""
from .config import ConfigError, load_pool
from .drafter import Drafter, StepContext, StepFeedback, register_drafter
from .engine import Engine, GenerationResult
from .metrics import RequestStats
from .policy import Policy, register_policy
from .sampling import SamplingParams
from .tree import Draft
from .verifier import Verifier

__version__ = "0.1.0"
__all__ = [
    "ConfigError", "Draft", "Drafter", "Engine", "GenerationResult", "Policy", "RequestStats", "SamplingParams",
    "StepContext", "StepFeedback", "Verifier", "load_pool", "register_drafter", "register_policy",
]
