"""``metasd serve --speculative-config JSON``: vLLM's speculative-decoding settings, read as pool drafter entries.

The keys that map (vLLM's ``SpeculativeConfig``): ``method`` - ``ngram`` (prompt lookup), ``suffix`` (suffix
decoding) or ``draft_model`` (a small LM drafting chains; the method vLLM infers when only ``model`` is given) -,
``model``, ``num_speculative_tokens``, ``prompt_lookup_max`` / ``prompt_lookup_min`` (ngram) and
``suffix_decoding_max_tree_depth`` / ``_max_spec_factor`` / ``_min_token_prob`` (suffix). Anything else (another
method, an unknown key, a wrong type) is a ``ValueError`` naming it, raised before any model loads; the entries'
values are then checked like a pool file's (docs/serving.md#one-model-from-the-command-line).
"""
from __future__ import annotations

import json

METHODS = ("ngram", "suffix", "draft_model")
#: each method's keys, and the drafter parameter each maps to (None: handled apart)
_KEYS = {
    "ngram": {"num_speculative_tokens": "k", "prompt_lookup_max": "n_max", "prompt_lookup_min": "n_min"},
    "suffix": {"num_speculative_tokens": None, "suffix_decoding_max_tree_depth": "max_depth",
               "suffix_decoding_max_spec_factor": "spec_factor", "suffix_decoding_min_token_prob": "min_prob"},
    "draft_model": {"num_speculative_tokens": "k", "model": None},
}
_NUMBERS = {"suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}
OPTION = "--speculative-config"


def speculative_drafters(text: str) -> list[dict]:
    """The pool drafter entries (one arm) that ``text``, vLLM's JSON object, asks for."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{OPTION}: not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{OPTION}: expected a JSON object such as '{{\"method\": \"ngram\", "
                         f"\"num_speculative_tokens\": 5}}', got {text!r}")
    method = spec.get("method")
    if method is None:  # vLLM's inference: a model means a draft model
        if "model" not in spec:
            raise ValueError(f"{OPTION}: give 'method' (one of {', '.join(METHODS)}) or a draft 'model'")
        method = "draft_model"
    if method not in _KEYS:
        raise ValueError(f"{OPTION}: method {method!r} is not supported; supported: {', '.join(METHODS)} "
                         f"(docs/serving.md#one-model-from-the-command-line)")
    keys = _KEYS[method]
    for key, value in spec.items():
        if key == "method":
            continue
        if key not in keys:
            raise ValueError(f"{OPTION}: unknown key {key!r} for method {method!r}; accepted: "
                             f"{', '.join(['method', *keys])}")
        numeric = isinstance(value, (int, float)) if key in _NUMBERS else isinstance(value, int)
        if key == "model" and not isinstance(value, str) or key != "model" and (isinstance(value, bool) or not numeric):
            want = "a string" if key == "model" else "a number" if key in _NUMBERS else "an integer"
            raise ValueError(f"{OPTION}: {key} must be {want}, got {value!r}")
    params = {keys[k]: v for k, v in spec.items() if keys.get(k)}
    tokens = spec.get("num_speculative_tokens")
    if method == "ngram":
        return [{"name": "ngram", "type": "ngram", "params": params}]
    if method == "suffix":
        if tokens is not None:  # at most this many draft tokens a step: the tree's nodes, and so its depth
            params = {**params, "max_depth": min(tokens, params.get("max_depth", tokens)), "max_nodes": tokens}
        return [{"name": "suffix", "type": "suffix", "params": params}]
    if "model" not in spec:
        raise ValueError(f"{OPTION}: method 'draft_model' needs 'model' (a bundled:<name>, a local HF directory or "
                         f".gguf file, or a hub id)")
    if tokens is not None and tokens > 16:
        params["k_max"] = tokens  # the pretrained drafter's k may not exceed k_max (16 unless set)
    return [{"name": "draft", "type": "pretrained", "model": spec["model"], "params": params}]
