"""transformers' own decoding, timed the same way as metasd: the references every speedup is measured against.

All functions take prompt ids and return ``(new_token_ids, seconds)``; seconds is wall time including the
prefill. Greedy only, as are the reference figures (docs/models.md#reference-baselines).

They call transformers on the models they are given: the benchmarks apply metasd's LM-head stride fix
(``metasd.core.execution.hooks.contiguous_lm_head_input``) to the verifier and the assistant first, so that the
baselines every ratio is computed against are the strongest ones (as shipped, transformers' prefill and assistant
forwards copy the LM head's weight on every call: assisted generation 0.50x plain decoding as shipped, 1.01x with the
fix, benchmarks/history.md). ``plain_with_margins`` (``output_logits=True``) is for an untimed reference pass only.
"""
from __future__ import annotations

import time

import torch


def _generate(model, prompt_ids: list[int], max_new_tokens: int, **kwargs):
    ids = torch.tensor([prompt_ids], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, temperature=None, top_p=None, top_k=None, **kwargs)
    seconds = time.perf_counter() - t0
    seq = out.sequences if hasattr(out, "sequences") else out
    return seq[0, len(prompt_ids):].tolist(), seconds, out


def plain(model, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> tuple[list[int], float]:
    """Autoregressive greedy decoding (``model.generate``; ``generate_kwargs``: its other arguments, e.g.
    ``eos_token_id``)."""
    ids, s, _ = _generate(model, prompt_ids, max_new_tokens, **generate_kwargs)
    return ids, s


def plain_with_margins(model, prompt_ids: list[int], max_new_tokens: int,
                       **generate_kwargs) -> tuple[list[int], float, list[float]]:
    """Plain decoding that also returns, per generated position, the top-two logit margin."""
    ids, s, out = _generate(model, prompt_ids, max_new_tokens, return_dict_in_generate=True, output_logits=True,
                            **generate_kwargs)
    margins = []
    for logits in out.logits:
        top = logits[0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    return ids, s, margins


def assisted(model, assistant, prompt_ids: list[int], max_new_tokens: int, **assistant_kwargs) -> tuple[list[int], float]:
    """transformers assisted generation with ``assistant`` (its defaults unless overridden)."""
    ids, s, _ = _generate(model, prompt_ids, max_new_tokens, assistant_model=assistant, **assistant_kwargs)
    return ids, s


def prompt_lookup(model, prompt_ids: list[int], max_new_tokens: int, num_tokens: int = 10,
                  **generate_kwargs) -> tuple[list[int], float]:
    """transformers prompt lookup decoding."""
    ids, s, _ = _generate(model, prompt_ids, max_new_tokens, prompt_lookup_num_tokens=num_tokens, **generate_kwargs)
    return ids, s


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where two token lists differ (None if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None
