"""One request: the step loop of speculative decoding (docs/architecture.md#a-step).

Each step: the policy picks a drafter (per step, or once per request), the drafter proposes a chain or a tree, the
verifier scores it in one forward, an exact acceptance rule keeps a root-to-node path plus one bonus token, the
verifier's cache keeps exactly what was committed, the reward scores the step and the policy and the drafter learn
from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from .acceptance import accept_greedy, accept_match, accept_rejection
from .clock import now
from .drafter import StepContext, StepFeedback
from .metrics import RequestStats
from .policy import Policy
from .request_features import request_features, step_features
from .sampling import SamplingParams, process_logits
from .tree import Draft

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int] | torch.Tensor


@dataclass
class GenerationResult:
    """Output of one request: the new text and tokens, and how they were produced."""

    text: str
    token_ids: list[int]  # new tokens only (EOS included when generation stopped on it)
    prompt_ids: list[int]
    stats: RequestStats
    extra: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        """The request's record (``RequestStats.to_record``) with its text and token ids."""
        return {**self.stats.to_record(), "text": self.text, "token_ids": list(self.token_ids)}


def encode_prompt(tokenizer, prompt: Prompt, chat: bool | None = None, model_name: str = "the verifier") -> list[int]:
    """Prompt -> token ids, as ``Engine.encode`` does: token ids as given, message lists through the chat template,
    strings through it when ``chat`` (else encoded as they are). Needs no model, only its tokenizer, so a command can
    check a prompt's length before any model loads."""
    def tokenizer_or_fail():
        if tokenizer is None:
            raise ValueError(f"{model_name} has no tokenizer: pass token ids")
        return tokenizer

    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if chat:
            return encode_prompt(tokenizer, [{"role": "user", "content": prompt}], True, model_name)
        return tokenizer_or_fail().encode(prompt, add_special_tokens=True)
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty")
    if all(isinstance(t, int) for t in prompt):
        return prompt
    if all(isinstance(m, Mapping) for m in prompt):
        tok = tokenizer_or_fail()
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{model_name}'s tokenizer has no chat template; pass a string prompt")
        text = tok.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    raise TypeError("prompt must be a string, a list of chat messages, or a list of token ids")


def check_context(prompt_tokens: int, max_new_tokens: int, context_length: int | None, model_name: str) -> None:
    """``ValueError`` when the prompt and the new tokens do not fit the verifier's context."""
    if context_length and prompt_tokens + max_new_tokens > context_length:
        raise ValueError(f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
                         f"{model_name} ({context_length} tokens)")


class Request:
    """One generate call of an ``Engine``: its arguments checked, then the step loop as a generator of committed
    token lists (``steps``)."""

    def __init__(self, engine, prompt: Prompt, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, stop: str | Sequence[str] | None = None,
                 seed: int | None = None, policy: Policy | None = None, chat: bool | None = None,
                 category: str | None = None):
        self.engine = engine
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        self.prompt_ids = engine.encode(prompt, chat)
        if not self.prompt_ids:
            raise ValueError("prompt is empty after tokenisation")
        check_context(len(self.prompt_ids), max_new_tokens, engine.verifier.context_length, engine.verifier.name)
        self.max_new_tokens = max_new_tokens
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.policy = engine._check_policy(policy) if policy is not None else engine.policy
        self.category = category
        self.generator = None  # sampling draws on the verifier's device, from this request's own stream
        if not self.sampling.greedy:
            self.generator = torch.Generator(device=engine.verifier.device)
            self.generator.manual_seed(seed if seed is not None else int(torch.seed() % (2**63)))
        self.new_ids: list[int] = []
        self.stats = RequestStats(prompt_tokens=len(self.prompt_ids))
        self._text_cut: int | None = None

    # text of the new tokens, cut before a stop string
    def text(self) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            return ""
        text = tok.decode(self.new_ids, skip_special_tokens=True)
        return text if self._text_cut is None else text[: self._text_cut]

    def result(self) -> GenerationResult:
        return GenerationResult(self.text(), list(self.new_ids), list(self.prompt_ids), self.stats)

    def _context(self) -> Any:
        if not getattr(self.policy, "contextual", False):
            return None
        return request_features(self.prompt_ids, self.category, self.engine.categories)

    def _select(self, context: Any) -> int:
        return self.policy.select(context) if self.policy is not None else 0

    def steps(self) -> Iterator[list[int]]:
        """Run the request: yield the tokens each step commits. Holds the engine's verifier and drafters for the whole
        request (a second request on them meanwhile is refused: ``EngineBusyError``); gradients are off inside each
        step, never around the caller's code between steps."""
        with self.engine.exclusive_use():
            try:
                with torch.inference_mode():
                    self._start()
                while True:
                    with torch.inference_mode():
                        committed, done = self._step()
                    yield committed
                    if done:
                        break
                with torch.inference_mode():
                    self._finish()
            finally:
                for d in self.engine.all_drafters:
                    d.end()

    def _start(self) -> None:
        """Prefill the verifier, lay out the context buffer, start the drafters and the policy's episode."""
        eng, verifier, stats = self.engine, self.engine.verifier, self.stats
        if self.policy is not None and not eng.persistent_policy:
            self.policy.reset()
        self.context = self._context()
        self.eos = eng.eos_ids()
        self.t_start = now(verifier.device)
        verifier.prefill(torch.tensor(self.prompt_ids[:-1], dtype=torch.long), eng.hidden_layers)
        stats.prefill_s = now(verifier.device) - self.t_start
        # every committed token, prompt included, in one host buffer that grows in place (a drafter's ctx.tokens is
        # a view of its first T entries); the last committed token is the pending one
        self.buffer = torch.empty(len(self.prompt_ids) + self.max_new_tokens + 1, dtype=torch.long)
        self.length = len(self.prompt_ids)
        self.buffer[: self.length] = torch.tensor(self.prompt_ids, dtype=torch.long)
        self.base_ctx = dict(prompt_len=len(self.prompt_ids), sampling=self.sampling, generator=self.generator,
                             hidden=verifier.hidden,
                             request={"category": self.category, "max_new_tokens": self.max_new_tokens})
        for d in eng.all_drafters:
            d.begin(StepContext(tokens=self.buffer[: self.length], max_depth=0, **self.base_ctx))
        self.recent = [0.5] * len(eng.drafters)  # recent acceptance per arm (a step feature)
        self.context_used = self.context
        self.arm = self._select(self.context) if eng.granularity == "request" else 0
        self.step_rewards: list[float] = []

    def _step(self) -> tuple[list[int], bool]:
        """One step: select, draft, verify, accept, commit, reward, learn. Returns the committed tokens and whether the
        request is over."""
        eng, verifier, stats, policy = self.engine, self.engine.verifier, self.stats, self.policy
        device = eng.clock_device  # None: the step's clock reads do not synchronise (Engine.profile)
        budget = self.max_new_tokens - len(self.new_ids)
        ctx = StepContext(tokens=self.buffer[: self.length], max_depth=budget - 1, step=stats.steps, **self.base_ctx)
        if eng.granularity == "step":
            self.arm = self._select(self._step_context(ctx))
        drafter = eng.drafters[self.arm] if eng.drafters else None
        with eng.meter as meter:  # counts the modeled cost of drafting and verifying
            t0 = now(device)
            draft = drafter.propose(ctx) if drafter is not None else Draft.empty()
            if draft.depth > ctx.max_depth:
                draft = draft.truncated(ctx.max_depth)
            t1 = now(device)
            out = verifier.verify(int(self.buffer[self.length - 1]), draft)
            t2 = now(device)
        cost = meter.steps
        if self.sampling.greedy:
            target_argmax, target_probs = out.logits.argmax(-1), None  # [n+1] on the verifier's device
            acc = accept_greedy(draft, target_argmax)
        else:
            target_argmax, target_probs = None, process_logits(out.logits, self.sampling)  # [n+1, vocab]
            acc = (accept_match if draft.probs is None else accept_rejection)(draft, target_probs, self.generator)
        verifier.commit(acc.path, out)
        committed = [int(draft.tokens[i]) for i in acc.path] + [acc.bonus]
        feedback = StepFeedback(draft, acc, committed, target_probs, target_argmax, seconds=t2 - t0, cost=cost)
        if drafter is not None:
            drafter.observe(feedback)  # first: the drafters it drafted with (a fused arm's) settle their caches
        rewards: dict[int, float] = {}
        if drafter is not None and eng.feedback == "full":
            with eng.meter as tracking:  # model drafters kept in step feed the committed tokens: real work
                counterfactuals = {j: d.counterfactual(ctx, feedback) for j, d in enumerate(eng.drafters) if j != self.arm}
            feedback.cost = cost = cost + tracking.steps  # the pool's overhead, whichever arm drafted
            for j, c in counterfactuals.items():
                if c is not None:
                    own = sum(eng.meter.price(module, rows) for module, rows in c.forwards)
                    rewards[j] = eng.reward.counterfactual(c, own + eng.meter.price(verifier.model, c.drafted + 1)
                                                           + tracking.steps)
                    self._track_acceptance(j, c.n_accepted, c.depth)
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.catch_up_tokens += draft.catch_up
        stats.modeled_cost += cost
        name = drafter.name if drafter is not None else "none"
        stats.record_step(name, draft.depth, len(draft), acc.n_accepted, len(committed), draft.meta)
        value = eng.reward.step(feedback)
        stats.rewards.append(value)
        self.step_rewards.append(value)
        if drafter is not None:
            self._track_acceptance(self.arm, acc.n_accepted, draft.depth)
            if policy is not None and eng.granularity == "step":
                rewards[self.arm] = value
                policy.observe(self.arm, rewards, self.context_used)
        done = self._commit(committed, self.eos)
        self.buffer[self.length: self.length + len(committed)] = torch.tensor(committed, dtype=torch.long)
        self.length += len(committed)
        return committed, done

    def _track_acceptance(self, arm: int, n_accepted: float, depth: int) -> None:
        """Recent acceptance of each arm (exponential average of n_acc / depth), a per-step context feature."""
        if depth:
            self.recent[arm] = 0.7 * self.recent[arm] + 0.3 * min(n_accepted / depth, 1.0)

    def _step_context(self, ctx: StepContext) -> Any:
        """What a contextual policy reads before this step: the request's features, then the step's
        (``step_features``: the longest lookup match now, a tracked model drafter's confidence, recent acceptance)."""
        self.context_used = self.context
        if self.context is None:
            return None
        drafters = self.engine.drafters
        matches = [m for d in drafters if (m := d.longest_match(ctx.tokens)) is not None]
        confidences = [c for d in drafters if (c := d.confidence()) is not None]
        self.context_used = np.concatenate([self.context, step_features(max(matches, default=0),
                                                                         max(confidences, default=0.0), self.recent)])
        return self.context_used

    def _finish(self) -> None:
        eng, stats, policy = self.engine, self.stats, self.policy
        if policy is not None and eng.drafters and eng.granularity == "request" and self.step_rewards:
            policy.update(self.arm, eng.reward.request(stats, self.step_rewards), self.context)
        stats.new_tokens = len(self.new_ids)
        stats.wall_s = now(eng.verifier.device) - self.t_start
        stats.policy_state = policy.state_dict() if policy is not None else None

    def _commit(self, committed: list[int], eos: set[int]) -> bool:
        """Append committed tokens; return True when generation is over (EOS, budget or stop string)."""
        for i, t in enumerate(committed):
            if t in eos:
                self.new_ids.extend(committed[: i + 1])
                self.stats.stop_reason = "eos"
                return True
        self.new_ids.extend(committed)
        if self.stop and self._hit_stop():
            self.stats.stop_reason = "stop"
            return True
        if len(self.new_ids) >= self.max_new_tokens:
            self.stats.stop_reason = "length"
            return True
        return False

    def _hit_stop(self) -> bool:
        text = self.engine.tokenizer.decode(self.new_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        if not cuts:
            return False
        self._text_cut = min(cuts)
        return True
