"""Structured output: grammar constraints (a JSON object, a JSON schema, a regex, a Lark grammar) as allowed-token
masks, for the committed prefix and for every path of a draft tree, so that masked speculative decoding stays
lossless.

- ``Constraint`` (spec.py): what a request asks for (``constraint_from_fields``: from a request's fields);
  ``ConstraintError`` (backend.py) names the field at fault.
- ``ConstraintCompiler`` / ``compile_constraint`` (compiler.py): a constraint compiled for a tokenizer (llguidance,
  the optional dependency ``metasd[structured]``), cached per (tokenizer, end-of-sequence ids, constraint).
- ``ConstraintState`` (state.py): one request's grammar state - ``accept_tokens``, ``mask``, ``eos_allowed``,
  ``is_complete``, ``is_terminated``, ``tree_masks``.
- ``DraftGuide`` (guide.py): the grammar along a draft a model drafter grows, to mask its logits.
- ``AfterThinking`` (thinking.py): a compiled constraint held back until a reasoning model's ``</think>``;
  ``thinking_tokens`` finds a tokenizer's marker tokens.
- ``apply_mask``, ``unpack_bitmask``, ``reachable_nodes`` (masking.py): the masks as tensors.

Every module imports without llguidance: specs are then checked field by field only (their grammar when compiled),
and compiling raises ImportError with the install command.
"""
from .backend import INSTALL_HINT, ConstraintError
from .compiler import DEFAULT_COMPILER, CompiledConstraint, ConstraintCompiler, compile_constraint
from .guide import DraftGuide
from .masking import apply_mask, reachable_nodes, unpack_bitmask
from .spec import GUIDED_FIELDS, KINDS, Constraint, constraint_from_fields
from .state import ConstraintState, ConstraintViolation
from .thinking import AfterThinking, AfterThinkingState, thinking_tokens

__all__ = [
    "AfterThinking", "AfterThinkingState", "DEFAULT_COMPILER", "GUIDED_FIELDS", "INSTALL_HINT", "KINDS",
    "CompiledConstraint", "Constraint", "ConstraintCompiler", "ConstraintError", "ConstraintState", "DraftGuide",
    "ConstraintViolation", "apply_mask", "compile_constraint", "constraint_from_fields", "reachable_nodes",
    "thinking_tokens", "unpack_bitmask",
]
