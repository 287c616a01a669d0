"""The two-token chi-square check of sampling exactness, shared by the conformance and cross-tokenizer tests: sample
two tokens n times through an engine and compare the pairs with the verifier's own two-token distribution."""
from __future__ import annotations

import torch
from scipy.stats import chisquare



def two_token_distribution(model, prompt: list[int], eos: set[int]) -> torch.Tensor:
    """p(a, b | prompt) over the whole vocabulary, by enumeration: [vocab * vocab]. Generation ends at an EOS
    first token ``a``: its mass sits in the cell (a, 0)."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = model(torch.tensor([prompt], device=model.device)).logits[0, -1].softmax(-1).cpu()  # [V]
        seconds = model(torch.tensor([prompt + [a] for a in range(vocab)], device=model.device)).logits[:, -1]
        seconds = seconds.softmax(-1).cpu()  # [V, V]
    for a in eos:
        seconds[a] = 0.0
        seconds[a, 0] = 1.0
    return (first[:, None] * seconds).flatten()


def sampled_pairs_pvalue(engine, prompt: list[int], n: int, generate=None) -> tuple[float, int, int]:
    """(chi-square p-value of n sampled two-token continuations against the verifier's distribution, accepted draft
    tokens, drafted tokens). Pairs expected more than 5 times are each a cell; the rest are pooled into one.
    ``generate(prompt, seeds)``: the results of sampling with each seed (default: ``engine.generate`` one by one)."""
    vocab = engine.verifier.model.config.vocab_size
    counts = torch.zeros(vocab * vocab)
    accepted = drafted = 0
    if generate is None:
        results = [engine.generate(prompt, max_new_tokens=2, temperature=1.0, seed=seed) for seed in range(n)]
    else:
        results = generate(prompt, list(range(n)))
    for r in results:
        first, second = (r.token_ids + [0])[:2]  # one token: the first was EOS
        counts[first * vocab + second] += 1
        accepted += r.stats.accepted
        drafted += r.stats.drafted
    p = two_token_distribution(engine.verifier.model, prompt, engine.eos_ids()).double()  # [V * V]
    keep = p * n > 5
    obs = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
    exp = torch.cat([p[keep], p[~keep].sum()[None]]) * n
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue), accepted, drafted
