"""Drafters: one family per module. Each registers itself by ``kind`` for pool configs."""
from metasd.drafter import DRAFTERS, Drafter, StepContext, StepFeedback, register_drafter

from .ngram import NGramDrafter
from .pretrained import PretrainedDrafter

__all__ = ["DRAFTERS", "Drafter", "NGramDrafter", "PretrainedDrafter", "StepContext", "StepFeedback", "register_drafter"]
