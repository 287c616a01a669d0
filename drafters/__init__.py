"""Drafters: one family per module. Each registers itself by ``kind`` for pool configs."""
from metasd.drafter import DRAFTERS, Drafter, StepContext, StepFeedback, register_drafter

from .block import BlockDrafter
from .hidden_state import HiddenStateDrafter
from .ngram import NGramDrafter
from .pretrained import PretrainedDrafter
from .pretrained_tree import PretrainedTreeDrafter
from .treeflash import TreeFlashDrafter
from .steered import SteeredDrafter, SteeredTreeDrafter

__all__ = ["BlockDrafter", "DRAFTERS", "Drafter", "HiddenStateDrafter", "NGramDrafter", "PretrainedDrafter", "PretrainedTreeDrafter", "SteeredDrafter", "SteeredTreeDrafter", "StepContext", "StepFeedback", "TreeFlashDrafter",
           "register_drafter"]
