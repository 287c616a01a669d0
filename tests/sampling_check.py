"""The chi-square check of sampling exactness shared by the tests: sample the first ``length`` new tokens of n
independent seeded requests through an engine and compare their joint distribution with the verifier's own,
computed by enumeration from the verifier alone.

- ``exact_joint``: p(x1 .. xL | prompt) = the product of the verifier's processed next-token probabilities along the
  sequence, for every sequence likely enough to be a cell of its own (the rest is one pooled cell). A sequence ends
  early at an EOS token (its tuple is shorter).
- ``sample_joint``: n requests ``engine.generate(prompt, max_new_tokens, seed=i)``, i = seed .. seed + n - 1, each an
  independent request; counts of their first ``length`` tokens, and what the steps did at each draft depth, summed
  over the requests, so a test can assert that drafts really reached the depth it means to check: ``tried[d - 1]``
  steps verified a node of depth d (the accepted path reached its parent, which had children: the rule had to
  decide there), ``taken[d - 1]`` accepted one (so ``tried - taken`` rejected every node offered at depth d), read
  from what each step's drafter is told (``observe``); and the request statistics' ``position_drafted`` /
  ``position_accepted``.
- ``joint_check``: both, and the chi-square test. Sequences expected at least ``MIN_EXPECTED`` times are each a cell;
  the others are pooled into one cell (never dropped), itself merged into the smallest cell when it is expected less
  than ``MIN_EXPECTED`` times.

With ``length = 2`` and ``max_new_tokens = 2`` this is the two-token check (drafts of depth 1 only); with
``max_new_tokens = length = 3`` the first step drafts to depth 2, whose acceptance and residual decide the second
token, and with ``max_new_tokens = 4`` depth 3 decides the third.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from scipy.stats import chisquare

from metasd.core.decoding.sampling import SamplingParams, process_logits
from metasd.core.execution.tree import children_lists
from tiny import tiny_words

MIN_EXPECTED = 5.0  # a cell expected fewer times than this goes into the pooled cell


@torch.no_grad()
def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], presence_penalty: float = 0.0,
              frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
              logit_bias: dict[int, float] | None = None, allowed_token_ids: list[int] | None = None,
              bad_words: list[str] | None = None) -> torch.Tensor:
    """One position's logits [vocab] with allowed tokens, bad words, a logit bias and vLLM's penalties, token by token
    (an independent reference for ``metasd.core.decoding.processing``, ``bad_words`` and ``penalties``): every token
    not allowed set to -inf, and every token that would complete a bad word after the output (words of the tiny
    word-level tokenizer, each token the word at its id in ``tiny_words``), the bias added, then repetition over the
    prompt and the output, then frequency and presence over the output."""
    row = logits.float().clone()
    if allowed_token_ids:
        for t in range(len(row)):
            if t not in allowed_token_ids:
                row[t] = float("-inf")
    for word in bad_words or []:
        *prefix, last = [tiny_words().index(w) for w in word.split()]
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            row[last] = float("-inf")
    for t, amount in (logit_bias or {}).items():
        row[t] += amount
    for t in set(prompt) | set(output):
        if repetition_penalty != 1:
            row[t] = row[t] / repetition_penalty if row[t] > 0 else row[t] * repetition_penalty
    for t in set(output):
        row[t] -= frequency_penalty * output.count(t) + presence_penalty
    return row


def exact_joint(model, prompt: list[int], length: int, eos=frozenset(), floor: float = 0.0,
                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, constraint=None,
                min_tokens: int = 0, **penalties) -> dict[tuple[int, ...], float]:
    """{sequence: p(sequence | prompt)} for every continuation of ``length`` tokens (shorter when it ends at an EOS)
    with probability >= ``floor``, by enumeration: one batched forward of the verifier per position over the prefixes
    that are still >= ``floor`` (a sequence is never more likely than its prefix, so nothing >= floor is missed).
    Probabilities are the verifier's processed ones (a compiled ``constraint``'s mask after each prefix, from a fresh
    grammar state; EOS masked in the first ``min_tokens`` positions; ``penalties`` - presence_penalty,
    frequency_penalty, repetition_penalty; then temperature, top-k, top-p, min-p, as the engine applies them)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    eos = set(eos)
    done: dict[tuple[int, ...], float] = {}
    live: dict[tuple[int, ...], float] = {(): 1.0}
    device = next(model.parameters()).device
    for position in range(length):
        prefixes = list(live)
        batch = torch.tensor([prompt + list(s) for s in prefixes], device=device)
        with torch.no_grad():  # exact probabilities, not a graph to train through
            logits = model(batch).logits[:, -1]  # [prefixes, vocab]
        if constraint is not None:
            masks = []
            for seq in prefixes:
                state = constraint.new_state()
                state.accept_tokens(list(seq))
                masks.append(state.mask(logits.shape[-1]))
            logits = logits.masked_fill(~torch.stack(masks), float("-inf"))
        if position < min_tokens and eos:
            logits = logits.clone()
            logits[:, sorted(eos)] = float("-inf")
        if penalties:
            logits = torch.stack([penalised(row, prompt, list(s), **penalties) for row, s in zip(logits, prefixes)])
        probs = process_logits(logits, params).double().cpu()  # [prefixes, vocab]
        mass = torch.tensor([live[s] for s in prefixes], dtype=torch.float64)[:, None] * probs
        live = {}
        for row, col in (mass >= floor).logical_and(mass > 0).nonzero().tolist():
            seq = prefixes[row] + (col,)
            (done if col in eos else live)[seq] = float(mass[row, col])
    done.update(live)
    return done


@dataclass
class JointCheck:
    """Outcome of ``joint_check``."""

    pvalue: float
    n: int
    cells: int  # cells of the test, the pooled one included
    pooled_expected: float  # expected count of the pooled cell (before any merge)
    tried: list[int] = field(default_factory=list)  # [depth - 1] steps that verified a node of that depth
    taken: list[int] = field(default_factory=list)  # [depth - 1] steps that accepted a node of that depth
    position_drafted: list[int] = field(default_factory=list)  # [depth - 1] steps whose draft reached that depth
    position_accepted: list[int] = field(default_factory=list)  # [depth - 1] steps that accepted it
    accepted: int = 0  # accepted draft tokens, all requests
    drafted: int = 0  # drafted tokens (tree nodes), all requests
    seconds: float = 0.0  # sampling time, wall clock
    cpu_seconds: float = 0.0  # sampling time, this process's CPU (what a shared machine does not inflate)

    def tried_at(self, depth: int) -> int:
        """Steps whose acceptance rule decided on a node of ``depth`` (1 = the root's children)."""
        return self.tried[depth - 1] if len(self.tried) >= depth else 0

    def taken_at(self, depth: int) -> int:
        """Steps that accepted a node of ``depth``."""
        return self.taken[depth - 1] if len(self.taken) >= depth else 0

    def __str__(self) -> str:
        return (f"p = {self.pvalue:.3g} ({self.n} samples, {self.cells} cells, pooled expected "
                f"{self.pooled_expected:.1f}; steps that verified / accepted a node per depth {self.tried} / "
                f"{self.taken}; {self.seconds:.1f} s, {self.cpu_seconds:.1f} s CPU)")


def _add(into: list[int], values) -> None:
    """into += values, elementwise, ``into`` grown as needed."""
    into.extend([0] * (len(values) - len(into)))
    for i, v in enumerate(values):
        into[i] += v


def _bump(counts: list[int], depth: int) -> None:
    counts.extend([0] * (depth - len(counts)))
    counts[depth - 1] += 1


def _count_depths(draft, path: list[int], tried: list[int], taken: list[int]) -> None:
    """Add one step to ``tried`` / ``taken`` (see the module docstring)."""
    kids = children_lists(draft.parents)
    row = 0  # the root, then each accepted node
    for depth in range(1, len(path) + 2):
        if not kids[row]:
            return
        _bump(tried, depth)
        if depth > len(path):
            return
        _bump(taken, depth)
        row = path[depth - 1] + 1


def sample_joint(engine, prompt: list[int], n: int, length: int, max_new_tokens: int | None = None, seed: int = 0,
                 generate=None, seeded: str = "stream", **sampling) -> tuple[Counter, dict]:
    """(Counter of the first ``length`` new tokens of n seeded requests, their summed draft statistics). Each request
    generates ``max_new_tokens`` (default ``length`` + 1: the first token is drawn with the prefill, so the step after
    it drafts tokens 2..length, to depth ``length`` - 1).
    ``generate(prompt, seeds)``: the results of sampling ``length`` tokens with each seed, instead of
    ``engine.generate`` one by one (then the per-depth decisions are not counted: ``tried``/``taken`` stay empty).
    ``seeded``: the engine's ``seeded_sampling`` while sampling - "stream" (the default here: each seed a generator,
    so the rules that read the drafter's probabilities are the ones tested) or "keyed" (sample-and-match against
    keyed noise)."""
    sampling = {"temperature": 1.0, **sampling}
    counts: Counter = Counter()
    stats = {"tried": [], "taken": [], "position_drafted": [], "position_accepted": [], "accepted": 0, "drafted": 0}
    spied = []
    # told every step's draft and acceptance: count what was decided at each depth (not through a scheduler's forks)
    for drafter in engine.drafters if generate is None else ():
        own = drafter.__dict__.get("observe")

        def observe(feedback, drafter=drafter, own=own):
            _count_depths(feedback.draft, feedback.acceptance.path, stats["tried"], stats["taken"])
            return (own or type(drafter).observe.__get__(drafter))(feedback)

        spied.append((drafter, own))
        drafter.observe = observe
    mode, engine.seeded_sampling = engine.seeded_sampling, seeded
    try:
        seeds = list(range(seed, seed + n))
        results = (generate(prompt, seeds) if generate is not None else
                   (engine.generate(prompt, max_new_tokens=max_new_tokens or length + 1, seed=s, **sampling)
                    for s in seeds))
        for r in results:
            counts[tuple(r.token_ids[:length])] += 1
            _add(stats["position_drafted"], r.stats.position_drafted)
            _add(stats["position_accepted"], r.stats.position_accepted)
            stats["accepted"] += r.stats.accepted
            stats["drafted"] += r.stats.drafted
    finally:
        engine.seeded_sampling = mode
        for drafter, own in spied:
            if own is None:
                del drafter.observe
            else:
                drafter.observe = own
    return counts, stats


def chi_square(counts: Counter, exact: dict[tuple[int, ...], float], n: int) -> tuple[float, int, float]:
    """(p-value, cells, pooled expected count) of ``counts`` (n samples) against ``exact`` (every sequence expected
    >= MIN_EXPECTED times, and maybe rarer ones: those are pooled too)."""
    cells = sorted(s for s, p in exact.items() if p * n >= MIN_EXPECTED)
    obs = [float(counts.get(s, 0)) for s in cells]
    exp = [exact[s] * n for s in cells]
    pooled_exp = max(n - sum(exp), 0.0)
    pooled_obs = n - sum(obs)
    if pooled_exp >= MIN_EXPECTED or not cells:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    else:  # too rare to be a cell of its own: merged into the smallest cell
        i = min(range(len(exp)), key=exp.__getitem__)
        obs[i] += pooled_obs
        exp[i] += pooled_exp
    if len(obs) < 2:
        raise ValueError("one cell holds all the mass: the check would test nothing")
    total = sum(exp)
    exp = [e * n / total for e in exp]  # float rounding only
    return float(chisquare(obs, exp).pvalue), len(obs), pooled_exp


def joint_check(engine, prompt: list[int], n: int, length: int = 3, max_new_tokens: int | None = None,
                seed: int = 0, generate=None, reference=None, **sampling) -> JointCheck:
    """Chi-square test of the first ``length`` tokens of n seeded requests (``max_new_tokens``: default ``length`` + 1)
    against the verifier's exact joint distribution; see the module docstring. ``reference``: the torch model that
    distribution is enumerated from (default: the verifier's; a verifier on another backend names its weights')."""
    start, cpu = time.perf_counter(), time.process_time()
    counts, stats = sample_joint(engine, prompt, n, length, max_new_tokens, seed, generate, **sampling)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    processing = {k: v for k, v in sampling.items()
                  if k in ("temperature", "top_k", "top_p", "min_p", "logit_bias", "min_tokens", "allowed_token_ids",
                           "bad_words")
                  or "penalty" in k}
    if sampling.get("constraint") is not None:
        from metasd.core.constraints import compile_constraint

        processing["constraint"] = compile_constraint(engine.tokenizer, sampling["constraint"], sorted(engine.eos_ids()))
    exact = exact_joint(reference if reference is not None else engine.verifier.model, prompt, length, engine.eos_ids(), MIN_EXPECTED / n, **processing)
    pvalue, cells, pooled = chi_square(counts, exact, n)
    return JointCheck(pvalue, n, cells, pooled, seconds=seconds, cpu_seconds=cpu, **stats)


def sampled_pairs_pvalue(engine, prompt: list[int], n: int, generate=None) -> tuple[float, int, int]:
    """(chi-square p-value of n sampled two-token continuations against the verifier's distribution, accepted draft
    tokens, drafted tokens): ``joint_check`` of the first two of three tokens (the first is drawn with the prefill, the
    step after it drafts the second: depth 1 at most). ``generate(prompt, seeds)``: the results of sampling with
    each seed (default: ``engine.generate`` one by one; e.g. a scheduler's batch)."""
    check = joint_check(engine, prompt, n, length=2, max_new_tokens=3, generate=generate)
    return check.pvalue, check.accepted, check.drafted
