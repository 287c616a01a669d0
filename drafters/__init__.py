"""Drafters: one family per module. Each registers itself by ``kind`` for pool configs; every module of this
package is imported here, so a new drafter file needs no other edit to be available in pool files."""
import importlib
import pkgutil

from metasd.core.decoding.drafter import DRAFTERS, Drafter, StepContext, StepFeedback, register_drafter

from .block import BlockDrafter
from .fused import FusedDrafter
from .hidden_state import HiddenStateDrafter
from .ngram import NGramDrafter
from .pretrained import PretrainedDrafter
from .pretrained_tree import PretrainedTreeDrafter
from .replay import ReplayDrafter
from .static_tree import StaticTreeDrafter
from .suffix import SuffixDrafter
from .treeflash import TreeFlashDrafter
from .steered import SteeredDrafter, SteeredTreeDrafter

__all__ = ["BlockDrafter", "DRAFTERS", "Drafter", "FusedDrafter", "HiddenStateDrafter", "NGramDrafter", "PretrainedDrafter",
           "PretrainedTreeDrafter", "ReplayDrafter", "StaticTreeDrafter", "SteeredDrafter", "SteeredTreeDrafter",
           "StepContext", "StepFeedback",
           "SuffixDrafter", "TreeFlashDrafter", "register_drafter"]

for _module in pkgutil.iter_modules(__path__):  # the built-ins above, and any drafter file added beside them
    importlib.import_module(f"{__name__}.{_module.name}")
