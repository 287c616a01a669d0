"""The engine: speculative decoding with a pool of drafters, one shared verifier and a policy.

One step (docs/algorithms.md#steps-and-metrics): the policy picks a drafter, the drafter proposes a chain or tree,
the verifier scores it in one forward, an exact acceptance rule keeps a prefix (a root-to-node path)
plus one bonus token, and the verifier's cache keeps exactly what was committed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch

from .acceptance import accept_greedy, accept_match, accept_rejection
from .cost import CostModel, StepMeter, attach, decode_step_cost
from .drafter import Drafter, StepContext, StepFeedback
from .metrics import RequestStats
from .policy import Policy
from .rewards import BOUNDED_REWARDS, get_reward
from .sampling import SamplingParams, process_logits
from .tree import Draft
from .verifier import HiddenStore, Verifier

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int] | torch.Tensor


@dataclass
class GenerationResult:
    """Output of one request: the new text and tokens, and how they were produced."""

    text: str
    token_ids: list[int]  # new tokens only (EOS included when generation stopped on it)
    prompt_ids: list[int]
    stats: RequestStats
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """Lossless speculative decoding over a pool of drafters chosen by a bandit policy.

    drafters: the pool (a single drafter, a sequence, or a name -> drafter mapping). Empty: plain
        autoregressive decoding through the same code path (each step verifies the pending token only).
    policy: picks a drafter per ``granularity`` ("step" or "request") from ``reward`` ("throughput",
        "wall_throughput", "block_efficiency", "block_divergence"); ``persistent_policy`` keeps what it
        learnt across requests, else it is reset per request (MetaSD's episodes).
    cost_model: prices the work of a step for the (deterministic) throughput reward; default: the
        calibration for the verifier's device type (``metasd.cost``).
    """

    def __init__(
        self,
        verifier: Verifier,
        drafters: Drafter | Sequence[Drafter] | Mapping[str, Drafter] | None = None,
        policy: Policy | None = None,
        *,
        granularity: str = "step",
        reward: str = "throughput",
        persistent_policy: bool = False,
        categories: Sequence[str] = (),
        check_tokenizers: bool = True,
        cost_model: CostModel | None = None,
    ):
        self.verifier = verifier
        self.tokenizer = verifier.tokenizer
        self.drafters = _as_list(drafters)
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names in a pool must be unique, got {names}")
        if granularity not in ("step", "request"):
            raise ValueError(f"granularity must be 'step' or 'request', got {granularity!r}")
        self.granularity = granularity
        self.reward_name = reward
        self.reward_fn = get_reward(reward)
        self.persistent_policy = persistent_policy
        self.categories = tuple(categories)
        self.policy = self._check_policy(policy)
        if check_tokenizers:
            self._check_tokenizers()
        self.cost_model = cost_model or CostModel.for_device(verifier.device)
        attach([verifier.model, *(m for d in self.drafters for m in d.modules())])
        self.meter = StepMeter(self.cost_model, decode_step_cost(verifier.model, self.cost_model))
        self.hidden_layers = tuple(sorted({layer for d in self.drafters for layer in d.hidden_layers}))
        for layer in self.hidden_layers:
            if not 0 <= layer <= verifier.num_layers:
                raise ValueError(f"a drafter asks for verifier layer {layer}; {verifier.name} has hidden states 0..{verifier.num_layers}")

    # ---------------------------------------------------------------- public API
    @classmethod
    def from_config(cls, path=None, overrides: Mapping[str, Any] | None = None) -> "Engine":
        """Build the engine of a pool config file (default: the embedded default pool)."""
        from .config import load_pool

        return load_pool(path, dict(overrides or {}))

    def derive(self, drafters: Sequence[str] | None = None, policy: Policy | None = None, **settings) -> "Engine":
        """A new engine sharing this one's verifier and drafter objects (no model is reloaded).

        drafters: names of the arms to keep (default: all); policy: its policy (required for a pool of
        several); settings: granularity, reward, persistent_policy, categories, cost_model.
        """
        chosen = self.drafters if drafters is None else [self.drafter(n) for n in drafters]
        kwargs = dict(granularity=self.granularity, reward=self.reward_name, persistent_policy=self.persistent_policy,
                      categories=self.categories, check_tokenizers=False, cost_model=self.cost_model)
        kwargs.update(settings)
        return Engine(self.verifier, chosen, policy, **kwargs)

    def drafter(self, name: str) -> Drafter:
        for d in self.drafters:
            if d.name == name:
                return d
        raise KeyError(f"no drafter named {name!r} in the pool; drafters: {[d.name for d in self.drafters]}")

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, **kwargs) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens; returns text, token ids and per-request stats.

        Keyword arguments: temperature (0 = greedy), top_p, top_k, stop (strings; the text ends before
        the first one), seed (sampling reproducible), policy (overrides the engine's for this call),
        chat (apply the chat template to a string prompt; default: only for message lists),
        category (request feature for contextual policies).
        """
        run = self._run(prompt, max_new_tokens, **kwargs)
        for _ in run.steps():
            pass
        return run.result()

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, **kwargs) -> Iterator[str]:
        """Yield text as tokens commit; the full ``GenerationResult`` is the generator's return value."""
        run = self._run(prompt, max_new_tokens, **kwargs)
        emitted = ""
        for _ in run.steps():
            text = run.text()
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next step
                continue
            if len(text) > len(emitted):
                yield text[len(emitted):]
                emitted = text
        result = run.result()
        if len(result.text) > len(emitted):
            yield result.text[len(emitted):]
        return result

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Prompt -> token ids. Message lists always get the chat template; strings when ``chat``."""
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.reshape(-1).tolist()]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if chat:
                return self.encode([{"role": "user", "content": prompt}])
            return self._tokenizer_or_fail().encode(prompt, add_special_tokens=True)
        prompt = list(prompt)
        if not prompt:
            raise ValueError("prompt is empty")
        if all(isinstance(t, int) for t in prompt):
            return prompt
        if all(isinstance(m, Mapping) for m in prompt):
            tok = self._tokenizer_or_fail()
            if not getattr(tok, "chat_template", None):
                raise ValueError(f"{self.verifier.name}'s tokenizer has no chat template; pass a string prompt")
            text = tok.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True, tokenize=False)
            return tok.encode(text, add_special_tokens=False)
        raise TypeError("prompt must be a string, a list of chat messages, or a list of token ids")

    # ---------------------------------------------------------------- internals
    def _run(self, prompt: Prompt, max_new_tokens: int, **kwargs) -> "_Request":
        return _Request(self, prompt, max_new_tokens, **kwargs)

    def _tokenizer_or_fail(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.verifier.name} has no tokenizer: pass token ids")
        return self.tokenizer

    def _check_policy(self, policy: Policy | None) -> Policy:
        if policy is None:
            if len(self.drafters) > 1:
                raise ValueError(f"a pool of {len(self.drafters)} drafters needs a policy (see metasd.policies)")
            from metasd.policies import Fixed  # the engine composes policies; the core defines only their interface

            return Fixed(1)
        n = max(len(self.drafters), 1)
        if policy.n_arms != n:
            raise ValueError(f"policy {policy.name!r} has {policy.n_arms} arms but the pool has {n} drafters")
        if self.reward_name not in BOUNDED_REWARDS and getattr(policy, "requires_bounded_rewards", False):
            raise ValueError(f"policy {policy.name!r} needs rewards in [0, 1]; reward {self.reward_name!r} is unbounded")
        return policy

    def _check_tokenizers(self) -> None:
        from .models import check_tokenizers_compatible

        for d in self.drafters:
            if d.tokenizer is not None and self.tokenizer is not None:
                check_tokenizers_compatible(self.tokenizer, d.tokenizer, self.verifier.name, d.name)

    def eos_ids(self) -> set[int]:
        from .models import eos_token_ids

        return eos_token_ids(self.verifier.model, self.tokenizer)


def _as_list(drafters) -> list[Drafter]:
    if drafters is None:
        return []
    if isinstance(drafters, Drafter):
        return [drafters]
    if isinstance(drafters, Mapping):
        out = []
        for name, d in drafters.items():
            d.name = name
            out.append(d)
        return out
    return list(drafters)


class _Request:
    """One generate call: the step loop as a generator of committed token lists."""

    def __init__(self, engine: Engine, prompt: Prompt, max_new_tokens: int, *, temperature: float = 0.0,
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
        ctx_len = engine.verifier.context_length
        if ctx_len and len(self.prompt_ids) + max_new_tokens > ctx_len:
            raise ValueError(
                f"prompt of {len(self.prompt_ids)} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
                f"{engine.verifier.name} ({ctx_len} tokens)"
            )
        self.max_new_tokens = max_new_tokens
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.policy = engine._check_policy(policy) if policy is not None else engine.policy
        self.category = category
        self.generator = None
        if not self.sampling.greedy:
            self.generator = torch.Generator(device="cpu")
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
        from .request_features import request_features

        return request_features(self.prompt_ids, self.category, self.engine.categories)

    def steps(self) -> Iterator[list[int]]:
        eng, verifier, stats = self.engine, self.engine.verifier, self.stats
        drafters = eng.drafters
        layers = eng.hidden_layers
        eos = eng.eos_ids()
        greedy = self.sampling.greedy
        policy = self.policy
        if not eng.persistent_policy:
            policy.reset()
        context = self._context()
        t_start = time.perf_counter()
        with torch.inference_mode():
            store = HiddenStore(layers) if layers else None
            hidden = verifier.prefill(torch.tensor(self.prompt_ids[:-1], dtype=torch.long), layers)
            if store is not None:
                store.append(hidden)
            stats.prefill_s = time.perf_counter() - t_start
            tokens = list(self.prompt_ids)
            base_ctx = dict(prompt_len=len(self.prompt_ids), sampling=self.sampling, generator=self.generator,
                            hidden=store, request={"category": self.category})
            for d in drafters:
                d.begin(StepContext(tokens=torch.tensor(tokens), max_depth=0, **base_ctx))
            arm = policy.select(context) if eng.granularity == "request" else 0
            request_rewards: list[float] = []
            while True:
                budget = self.max_new_tokens - len(self.new_ids)
                if eng.granularity == "step":
                    arm = policy.select(context)
                drafter = drafters[arm] if drafters else None
                ctx = StepContext(tokens=torch.tensor(tokens), max_depth=budget - 1, step=stats.steps, **base_ctx)
                with eng.meter as meter:  # counts the modeled cost of drafting and verifying
                    t0 = time.perf_counter()
                    draft = drafter.propose(ctx) if drafter is not None else Draft.empty()
                    if draft.depth > ctx.max_depth:
                        draft = draft.truncated(ctx.max_depth)
                    t1 = time.perf_counter()
                    start = verifier.cached
                    out = verifier.verify(tokens[-1], draft, layers)
                    t2 = time.perf_counter()
                if greedy:
                    target_argmax, target_probs = out.logits.argmax(-1), None
                    acc = accept_greedy(draft, target_argmax)
                else:
                    target_argmax, target_probs = None, process_logits(out.logits, self.sampling)
                    acc = (accept_match if draft.probs is None else accept_rejection)(draft, target_probs, self.generator)
                verifier.commit(start, acc.path, out, store)
                committed = [int(draft.tokens[i]) for i in acc.path] + [acc.bonus]
                stats.draft_s += t1 - t0
                stats.verify_s += t2 - t1
                stats.catch_up_tokens += draft.catch_up
                stats.modeled_cost += meter.steps
                name = drafter.name if drafter is not None else "none"
                stats.record_step(name, draft.depth, len(draft), acc.n_accepted, len(committed))
                feedback = StepFeedback(draft, acc, committed, target_probs, target_argmax, seconds=t2 - t0,
                                        cost=meter.steps)
                reward = eng.reward_fn(feedback)
                stats.rewards.append(reward)
                if drafter is not None:
                    if eng.granularity == "step":
                        policy.update(arm, reward, context)
                    else:
                        request_rewards.append(reward)
                    drafter.observe(feedback)
                done = self._commit(committed, eos)
                tokens.extend(committed)
                yield committed
                if done:
                    break
            if drafters and eng.granularity == "request" and request_rewards:
                policy.update(arm, self._request_reward(request_rewards), context)
            for d in drafters:
                d.end()
        stats.new_tokens = len(self.new_ids)
        stats.wall_s = time.perf_counter() - t_start
        stats.policy_state = policy.state_dict() if drafters else None

    def _request_reward(self, rewards: list[float]) -> float:
        tokens = sum(self.stats.tokens_per_step)
        if self.engine.reward_name == "throughput":  # tokens per modeled cost of the whole request
            return tokens / self.stats.modeled_cost if self.stats.modeled_cost > 0 else 0.0
        if self.engine.reward_name == "wall_throughput":  # tokens per second of the whole request
            busy = self.stats.draft_s + self.stats.verify_s
            return tokens / busy if busy > 0 else 0.0
        return sum(rewards) / len(rewards)

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
