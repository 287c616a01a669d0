"""Answering one ``metasd bench`` request: a pool's engine and the request functions of baselines and methods.

``PoolEngine`` loads a pool's engine on the first request that needs it (a run that is already complete
loads nothing), warms it up and encodes a chat; its ``baseline_fn`` and ``MethodRequests`` answer one
request and return its record (the fields of ``requests.jsonl``, less those the runner adds);
``answer_request`` encodes a chat, answers it and adds those fields. Both executors call it: the in-process
runner (``metasd.bench.runner``) and the Ray workers (``metasd.bench.ray_executor``). The order of requests, resume and
logging are the runner's.
"""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

from metasd.core.decoding.metrics import RequestStats
from metasd.core.decoding.sampling import GREEDY_BELOW
from metasd.models.machine import load_per_core

if TYPE_CHECKING:
    from metasd.core.engine import Engine
    from .experiment import Experiment, Method, ResolvedDataset, ResolvedPool


@contextmanager
def count_forwards(model):
    """Count the forward calls of ``model`` inside the block (``box[0]``)."""
    box = [0]

    def hook(*_):
        box[0] += 1

    handle = model.register_forward_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


class PoolEngine:
    """One pool's engine for an experiment: built on first use (``log`` the loading line, then ``on_load(engine)``)."""

    def __init__(self, exp: Experiment, pool: ResolvedPool, log: Callable[[str], None],
                 on_load: Callable[[Engine], None]):
        self.exp, self.cfg, self.pool = exp, exp.config, pool
        self.log, self.on_load = log, on_load
        self.engine = None

    def get(self) -> Engine:
        if self.engine is None:
            from metasd.config import ModelCache, build_engine

            pool = self.pool
            self.log(f"[metasd bench] loading pool {pool.name!r} ({pool.config.verifier.model})")
            self.engine = build_engine(pool.config, pool.base_dir, ModelCache(pool.config.verifier.device))
            self.on_load(self.engine)
            if self.cfg.warmup:
                self._warmup()
        return self.engine

    def _warmup(self) -> None:
        from . import baselines

        ds = self.exp.datasets[0]
        ids = self.encode([{"role": "user", "content": ds.questions[0].turns[0]}])
        n = min(4, self.cfg.max_new_tokens)
        for d in self.engine.drafters:
            self.engine.derive(drafters=[d.name], policy=None).generate(ids, max_new_tokens=n)
        baselines.plain(self.engine.verifier.model, ids, n)

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat as prompt ids: the chat template if the tokenizer has one, else the turns joined."""
        eng = self.engine
        if eng.tokenizer is not None and getattr(eng.tokenizer, "chat_template", None):
            return eng.encode(messages)
        return eng.encode("\n\n".join(m["content"] for m in messages))

    def derive(self, m: Method, ds: ResolvedDataset, seed: int) -> Engine:
        """The method's engine: its drafters, a fresh policy seeded with ``seed``, its reward and granularity."""
        from metasd.config import PolicyConfig, make_policy_from_config

        eng = self.get()
        categories = self.pool.config.categories or sorted({q.category for q in ds.questions})
        policy = None
        if m.kind == "policy" and len(m.drafters) > 1:
            policy = make_policy_from_config(PolicyConfig(name=m.policy.name, params=m.policy.params, seed=seed), len(m.drafters))
        return eng.derive(drafters=m.drafters, policy=policy, granularity=m.granularity, reward=m.reward, feedback=m.feedback,
                          persistent_policy=m.persistent, categories=categories)

    def baseline_fn(self, b) -> Callable:
        """Answer a request with a transformers baseline (plain, assisted, prompt lookup); a step is one forward.

        Every baseline runs with metasd's LM-head stride fix (``metasd.core.execution.hooks.contiguous_lm_head_input``)
        on the verifier and the assistant, applied explicitly before each call: transformers as shipped takes a slow
        path that copies the LM head's weight on its prefill and assistant forwards, and the speedups are measured
        against the strongest baselines."""
        from metasd.core.execution.hooks import contiguous_lm_head_input

        from . import baselines

        def run(prompt_ids: list[int], question, index: int) -> dict:
            eng = self.get()
            model = contiguous_lm_head_input(eng.verifier.model)
            n = self.cfg.max_new_tokens
            with count_forwards(model) as forwards:
                if b.type == "plain":
                    ids, secs = baselines.plain(model, prompt_ids, n)
                elif b.type == "assisted":
                    assistant = contiguous_lm_head_input(eng.drafter(b.drafter).model)
                    ids, secs = baselines.assisted(model, assistant, prompt_ids, n, **b.params)
                else:
                    ids, secs = baselines.prompt_lookup(model, prompt_ids, n, **b.params)
            steps = max(forwards[0], 1)  # a step of a transformers baseline: one verifier forward
            stats = RequestStats(prompt_tokens=len(prompt_ids), new_tokens=len(ids), steps=steps, wall_s=secs)
            text = eng.tokenizer.decode(ids, skip_special_tokens=True) if eng.tokenizer else ""
            # committed tokens: all it generated (tokens per step = tokens / forwards), no per-step lists
            return {**stats.to_record(), "committed": len(ids), "mean_tokens_per_step": len(ids) / steps,
                    "text": text, "token_ids": ids}

        return run


class MethodRequests:
    """Answer a method run's requests (called as ``run(prompt_ids, question, index)``) with its own engine,
    derived on the first request; a persistent policy resumes from the last ``policy_state`` in ``records``
    (the run's records so far, the list the runner appends to)."""

    def __init__(self, engines: PoolEngine, m: Method, ds: ResolvedDataset, seed: int, records: list[dict]):
        self.engines, self.m, self.ds, self.seed, self.records = engines, m, ds, seed, records
        self.engine: Engine | None = None

    def __call__(self, prompt_ids: list[int], question, index: int) -> dict:
        m, seed = self.m, self.seed
        if self.engine is None:
            self.engine = self.engines.derive(m, self.ds, seed)
            states = [r["policy_state"] for r in self.records if r.get("policy_state")]
            if m.persistent and states and len(m.drafters) > 1:
                self.engine.policy.load_state_dict(states[-1])  # resume a persistent policy where it was
        c = self.engines.cfg
        res = self.engine.generate(prompt_ids, max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
                                   top_k=c.top_k, min_p=c.min_p, seed=seed * 1_000_003 + index,
                                   category=question.category)
        rec = res.to_record()  # the same record as `metasd generate --json`'s
        if not m.persistent:
            rec.pop("policy_state")  # a per-request policy's state is not needed to resume anything
        return rec


def prompt_sha(ids: list[int]) -> str:
    """A short hash of prompt ids: two records answer the same prompt when theirs are equal."""
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


def answer_request(engines: PoolEngine, fn: Callable, messages: list[dict[str, str]], question, turn: int, index: int,
                   seed: int | None, method: str, kind: str, plain: dict[str, Any] | None) -> dict[str, Any]:
    """One request of one run, answered by ``fn(prompt_ids, question, index)``: its full ``requests.jsonl`` record.

    ``plain``: the plain baseline's record of the same request (None for the plain run itself, or when plain has not
    answered it yet: then the executor calls ``compare_with_plain`` later); under greedy decoding, when both prompts
    are the same, the record says whether the tokens match plain decoding's.
    """
    engines.get()
    prompt_ids = engines.encode(messages)
    rec = fn(prompt_ids, question, index)
    rec = dict(index=index, question_id=question.question_id, category=question.category, group=question.group,
               turn=turn, seed=seed, method=method, prompt_sha=prompt_sha(prompt_ids), **rec)
    load = load_per_core()  # sampled on the machine that answered (a Ray worker's, under --executor ray)
    if load is not None:
        rec["machine_load"] = round(load, 2)
    if plain is not None:
        compare_with_plain(rec, plain, engines.cfg.temperature, kind)
    return rec


def compare_with_plain(rec: dict[str, Any], plain: dict[str, Any], temperature: float, kind: str) -> dict[str, Any]:
    """Set ``rec["matches_plain"]`` (whether its tokens are plain decoding's) where that is defined: greedy decoding
    (a baseline always is) and the same prompt as plain's record of the request. Executors that time plain after a
    method (rotated order) call it once plain's record exists."""
    greedy = temperature < GREEDY_BELOW or kind == "baseline"  # transformers baselines always decode greedily
    if greedy and plain["prompt_sha"] == rec["prompt_sha"]:
        rec["matches_plain"] = rec["token_ids"] == plain["token_ids"]
    return rec
