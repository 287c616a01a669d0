"""One request: the step loop of speculative decoding (docs/architecture.md#a-step).

Each step: the policy picks a drafter (per step, or once per request), the drafter proposes a chain or a tree, the
verifier scores it in one forward, an exact acceptance rule keeps a root-to-node path plus one bonus token, the
verifier's cache keeps exactly what was committed, the reward scores the step, and policy and drafter learn from it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..constraints import AfterThinking, CompiledConstraint, Constraint, compile_constraint
from ..execution.clock import now
from ..execution.draft_batch import Drafting, drive
from ..execution.tree import Draft
from ..execution.verifier import VerifierOutput
from .commit import Commits
from .detokenize import StoppingText
from .drafter import StepContext, StepFeedback, drafting_loop, drafts_lookups
from ..execution.logprobs import TokenLogprob, check_logprobs
from .metrics import GenerationResult, RequestStats, StepRecord  # noqa: F401 - re-exported
from .penalties import Penalties
from .bad_words import bad_word_sequences
from .processing import PathProcessing, check_logit_bias, check_token_ids
from .policy import Policy
from .prompt import Prompt, check_context, encode_prompt  # noqa: F401 - re-exported
from .request_features import request_features, step_features
from .sampling import SamplingParams, check_request, request_draws


@dataclass
class _PendingStep:
    """A step between ``draft_step`` and ``finish_step``."""

    ctx: StepContext
    drafter: Any
    draft: Draft
    draft_cost: float  # modeled cost of the drafting, in verifier decode steps
    t0: float  # clock before drafting
    t1: float  # clock after drafting
    asked: bool = True  # whether the drafter was asked to draft (not when the allocator gave the request 0 nodes)
    cut: bool = False  # cut by the request's remaining tokens or its own draft_budget (``StepRecord.cut``)


class Request(Commits):
    """One generate call of an ``Engine``: its arguments checked, then the step loop as a generator of committed
    token lists (``steps``)."""

    def __init__(self, engine, prompt: Prompt, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, stop: str | Sequence[str] | None = None,
                 seed: int | None = None, policy: Policy | None = None, chat: bool | None = None,
                 category: str | None = None, logprobs: int | None = None, prompt_logprobs: int | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 constraint: Constraint | CompiledConstraint | AfterThinking | None = None,
                 logit_bias: Mapping[int, float] | None = None, ignore_eos: bool = False, min_tokens: int = 0,
                 stop_token_ids: Sequence[int] | None = None, allowed_token_ids: Sequence[int] | None = None,
                 include_stop_str_in_output: bool = False, bad_words: Sequence[str] | None = None,
                 skip_special_tokens: bool = True):
        self.engine = engine
        check_request(max_new_tokens=max_new_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos)
        if (min_tokens or 0) > max_new_tokens:  # None: not given, as check_request reads it
            raise ValueError(f"min_tokens ({min_tokens}) must be at most max_new_tokens ({max_new_tokens})")
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        self.penalties = Penalties(presence_penalty, frequency_penalty, repetition_penalty)
        self.logit_bias = check_logit_bias(logit_bias, engine.verifier)
        if isinstance(constraint, Constraint):  # structured output: compiled for the verifier's tokenizer (cached)
            constraint = compile_constraint(engine.tokenizer, constraint, sorted(engine.eos_ids()) or None)
        if constraint is not None and not constraint.new_state().mask(constraint.vocab_size).any():
            raise ValueError(f"constraint: {engine.verifier.name}'s tokenizer cannot write any text it allows")
        self.constraint = constraint
        self.prompt_ids = engine.encode(prompt, chat)
        if not self.prompt_ids:
            raise ValueError("prompt is empty after tokenisation")
        check_context(len(self.prompt_ids), max_new_tokens, engine.verifier.context_length, engine.verifier.name)
        self.max_new_tokens = max_new_tokens
        # the text so far, read incrementally; stop strings (cut before one, after it with include_stop_str_in_output)
        self._text = StoppingText(engine.tokenizer, stop, include_stop_str_in_output, skip_special_tokens)
        self.stop = self._text.stop
        self.policy = engine._check_policy(policy) if policy is not None else engine.policy
        # ignore_eos: past EOS to max_new_tokens; min_tokens: no EOS (stop token, stop string) before that many tokens
        self.category, self.ignore_eos, self.min_tokens = category, bool(ignore_eos), int(min_tokens or 0)
        self.stop_ids = check_token_ids(stop_token_ids, engine.verifier, "stop_token_ids")  # end as an EOS does
        self.allowed_ids = check_token_ids(allowed_token_ids, engine.verifier, "allowed_token_ids") or None
        self.bad_words = bad_word_sequences(bad_words, engine.tokenizer, engine.verifier.name)  # token sequences
        # the request's own draws: its stream, and keyed noise when seeded (none when greedy)
        self.generator, self.noise = request_draws(self.sampling, seed, engine.verifier.device, engine.seeded_sampling)
        self.logprobs = check_logprobs(logprobs)  # None, or the alternatives per token (0: the chosen token's only)
        self.prompt_logprobs = check_logprobs(prompt_logprobs, "prompt_logprobs")
        self.token_logprobs: list[TokenLogprob] | None = [] if self.logprobs is not None else None
        self.prompt_token_logprobs: list[TokenLogprob | None] | None = None  # filled by the prefill when asked
        self.new_ids: list[int] = []
        self.stats = RequestStats(prompt_tokens=len(self.prompt_ids))
        #: what the request runs on: the engine's verifier and pool, unless a ``Scheduler`` binds its own (a slot of
        #: the batched cache, per-request forks of the drafters) before ``start``
        self.verifier, self.drafters, self.all_drafters = engine.verifier, engine.drafters, engine.all_drafters
        self.draft_budget: int | None = None  # most draft nodes verified per step (None: the drafter's draft)
        self.max_draft_nodes: int | None = None  # a scheduler's cap on any draft (the KV rows it reserved hold it)
        self.last_step: StepRecord | None = None  # the last step, for a scheduler's step records
        self.read_at_start = 0  # prompt tokens its model drafters held before its first step (a stored prefix's)
        self._pending_step: _PendingStep | None = None  # between draft_step and finish_step
        self._selected: StepContext | None = None  # between select_arm and propose
        self._proposal: tuple | None = None  # between drafting and drafted: (ctx, drafter, asked, max_nodes)
        self.load: np.ndarray | None = None  # [2] load features a scheduler sets; appended last to a step context

    def text(self) -> str:
        """The new tokens' text, cut before the first stop string; decodes them all (``text_so_far``: incremental)."""
        return self._text.final(self.new_ids)

    def text_so_far(self) -> str:
        """The text so far, read incrementally: complete characters only, none a stop string may still cut away."""
        return self._text.so_far(self.new_ids)

    def result(self) -> GenerationResult:
        return GenerationResult(self.text(), list(self.new_ids), list(self.prompt_ids), self.stats,
                                logprobs=None if self.token_logprobs is None else list(self.token_logprobs),
                                prompt_logprobs=self.prompt_token_logprobs)

    def interrupted_result(self) -> GenerationResult:
        """The result of a request an interrupt cut short: the tokens committed so far, their text, the stats of the
        steps that ran (stop reason "interrupted", unless the request had already ended)."""
        self.stats.new_tokens = len(self.new_ids)
        if hasattr(self, "t_start"):
            self.stats.wall_s = now(self.engine.verifier.device) - self.t_start
        self.stats.stop_reason = self.stats.stop_reason or "interrupted"
        return self.result()

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
                    step = self._start()  # (tokens, done): the first token, where the prefill draws it
                while True:
                    if step is None:
                        with torch.inference_mode():
                            step = self._step()
                    yield step[0]
                    if step[1]:
                        break
                    step = None
                with torch.inference_mode():
                    self._finish()
            finally:
                for d in self.all_drafters:
                    d.end()

    def _start(self) -> tuple[list[int], bool] | None:
        """Prefill the verifier, lay out the context buffer, start the drafters and the policy's episode; where the
        verifier prefills the whole prompt, commit the first token from its logits (``first_token``: returned), else
        the prompt's last token stays pending for the first step (None)."""
        self.open()
        ids = self.prefill_ids(self.verifier)
        scored = self.verifier.prefill(torch.tensor(ids, dtype=torch.long), self.engine.hidden_layers,
                                       reserve=len(self.prompt_ids) + self.max_new_tokens, **self.prompt_scoring())
        self.prefilled(scored)
        return self.first_token(self.verifier.last_logits) if len(ids) == len(self.prompt_ids) else None

    def prefill_ids(self, verifier) -> list[int]:
        """The prompt tokens ``verifier``'s prefill takes: all of them where it draws the first token from its logits
        (``prefills_prompt``), else all but the last, which stays pending for the first step."""
        return self.prompt_ids[:len(self.prompt_ids) - (not getattr(verifier, "prefills_prompt", False))]

    def open(self) -> None:
        """Start the request's episode, before its prefill: the policy's reset, the request's features, the clock."""
        if self.policy is not None and not self.engine.persistent_policy:
            self.policy.reset()
        self.context = self._context()
        self.eos = (frozenset() if self.ignore_eos else frozenset(self.engine.eos_ids())) | self.stop_ids
        self.t_start = now(self.verifier.device)

    def prompt_scoring(self) -> dict[str, Any]:
        """What the prefill is asked to score (``Verifier.prefill``'s ``score`` and ``top``): the prompt's tokens 1..T
        when the request asked for its prompt's log-probabilities, else nothing."""
        return {} if self.prompt_logprobs is None else {"score": self.prompt_ids[1:], "top": self.prompt_logprobs}

    def prefilled(self, prompt_scores: list[TokenLogprob] | None = None) -> None:
        """After the prefill (``self.verifier`` holds the prompt but its last token): lay out the context buffer,
        start the drafters and pick the arm of a per-request policy. ``prompt_scores``: the prefill's log-probabilities
        of the prompt's tokens 1..T (``prompt_scoring``)."""
        if self.prompt_logprobs is not None:
            self.prompt_token_logprobs = [None, *(prompt_scores or [])]
        eng, verifier, stats = self.engine, self.verifier, self.stats
        self.processing = PathProcessing.for_request(self)
        stats.prefill_s = now(verifier.device) - self.t_start
        # every committed token, prompt included, in one host buffer that grows in place (a drafter's ctx.tokens is
        # a view of its first T entries); the last committed token is the pending one
        self.buffer = torch.empty(len(self.prompt_ids) + self.max_new_tokens + 1, dtype=torch.long)
        self.length = len(self.prompt_ids)
        self.buffer[: self.length] = torch.tensor(self.prompt_ids, dtype=torch.long)
        drafted = self.processing if eng.mask_drafts and self.processing and self.processing.for_drafters else None
        self.base_ctx = dict(prompt_len=len(self.prompt_ids), sampling=self.sampling, generator=self.generator,
                             noise=self.noise, hidden=verifier.hidden, processing=drafted,
                             request={"category": self.category, "max_new_tokens": self.max_new_tokens})
        for d in self.all_drafters:
            d.begin(StepContext(tokens=self.buffer[: self.length], max_depth=0, **self.base_ctx))
        self.recent = [0.5] * len(self.drafters)  # recent acceptance per arm (a step feature)
        self.context_used = self.context
        self.arm = self._select(self.context) if eng.granularity == "request" else 0
        self.step_rewards: list[float] = []

    @property
    def tokens_left(self) -> int:
        """Tokens it may still commit: ``max_new_tokens`` less those committed (a draft deeper than this less one is
        cut by its end)."""
        return self.max_new_tokens - len(self.new_ids)

    @property
    def pending(self) -> int:
        """The pending token: the last committed one, not in the verifier's cache yet."""
        return int(self.buffer[self.length - 1])

    def _step(self) -> tuple[list[int], bool]:
        """One step: select, draft, verify, accept, commit, reward, learn. Returns the committed tokens and whether the
        request is over. The verification between ``draft_step`` and ``finish_step`` is the sequential verifier's;
        a ``Scheduler`` verifies the drafts of all its running requests in one batched forward instead."""
        draft = self.draft_step()
        with self.engine.meter.resumed() as meter:  # the step's cost: drafting (counted so far) and verifying
            out = self.verifier.verify(self.pending, draft)
            if getattr(self.verifier, "backend", "torch") != "torch":  # a forward no torch hook saw: priced by shape
                meter.add(self.verifier.model, len(draft) + 1)
            t2 = now(self.engine.clock_device)
        return self.finish_step(out, cost=meter.steps, t2=t2)

    def draft_step(self) -> Draft:
        """First half of a step: ``select_arm`` then ``propose`` (an adaptive ``Scheduler`` sizes drafts in between)."""
        self.select_arm()
        return self.propose()

    def select_arm(self):
        """The step's arm: the policy selects it (per-step granularity) from the step's context, ``load`` appended
        when a scheduler set it. Returns the drafter that will draft (None: the request does not speculate)."""
        if self._pending_step is not None:
            raise RuntimeError("Request.draft_step called twice without finish_step")
        ctx = StepContext(tokens=self.buffer[: self.length], max_depth=self.tokens_left - 1, step=self.stats.steps,
                          **self.base_ctx)
        if self.engine.granularity == "step":
            self.arm = self._select(self._step_context(ctx))
        self._selected = ctx
        return self.drafters[self.arm] if self.drafters else None

    @property
    def can_switch_arm(self) -> bool:
        """Whether a scheduler may swap the selected arm before the request drafts (``switch_arm``): per-step arms,
        ``feedback: full``, no ``draft_budget`` of its own (its drafts are cut: they say nothing of an arm's), and a
        policy whose estimates do not depend on the probability it gave the played arm
        (``Policy.forced_arms_unbiased``: UCB, Thompson, LinUCB, epsilon-greedy - not EXP3 or Hedge, which weigh a
        played arm's reward by that probability)."""
        eng, policy = self.engine, self.policy
        return (eng.granularity == "step" and eng.feedback == "full" and self.draft_budget is None
                and (policy is None or bool(getattr(policy, "forced_arms_unbiased", False))))

    def switch_arm(self, drafter: Any) -> None:
        """Draft this step with ``drafter`` (one of ``drafters``) instead of the arm the policy selected - between
        ``select_arm`` and ``propose``, where ``can_switch_arm``; the policy is then told that arm drafted."""
        if self._selected is None or not self.can_switch_arm:
            raise RuntimeError("Request.switch_arm needs a selected arm, per-step arms and full feedback")
        index = [i for i, d in enumerate(self.drafters) if d is drafter]
        if not index:
            raise ValueError(f"Request.switch_arm: {getattr(drafter, 'name', drafter)!r} is not one of its drafters")
        self.arm = index[0]

    def propose(self, max_nodes: int | None = None, lookup_only: bool = False) -> Draft:
        """Draft with the selected arm (the engine's meter counts the work), cut to the token budget, ``draft_budget``
        and ``max_nodes`` (the allocator's node budget, passed to the drafter as ``StepContext.max_nodes``, as
        ``lookup_only`` is: an arm with no lookup in it, ``drafts_lookups``, is then not asked)."""
        loop = self.drafting(max_nodes, lookup_only)
        with self.engine.meter as meter:  # counts the modeled cost of drafting (and, sequentially, of verifying)
            t0 = now(self.engine.clock_device)
            draft = drive(loop) if loop is not None else Draft.empty()
            t1 = now(self.engine.clock_device)
        return self.drafted(draft, meter.steps, t0, t1)

    def drafting(self, max_nodes: int | None = None, lookup_only: bool = False) -> Drafting | None:
        """``propose``'s first half: the selected arm's drafting loop (``Drafter.drafting``; None: the arm is not
        asked - no drafter, 0 nodes, or lookups only and the arm has none). A scheduler runs the loops of all its
        requests together (one drafter forward per level for all); ``drafted`` takes the draft."""
        ctx, self._selected = self._selected, None
        if ctx is None or self._pending_step is not None:
            raise RuntimeError("Request.propose called without select_arm")
        if max_nodes is not None and max_nodes > 0:
            ctx = replace(ctx, max_nodes=max_nodes)
        ctx = replace(ctx, lookup_only=True) if lookup_only else ctx
        drafter = self.drafters[self.arm] if self.drafters else None
        # at 0 nodes: a plain step (the drafter catches up later)
        asked = drafter is not None and max_nodes != 0 and (not lookup_only or drafts_lookups(drafter))
        self._proposal = (ctx, drafter, asked, max_nodes)
        return drafting_loop(drafter, ctx) if asked else None

    def drafted(self, draft: Draft, cost: float, t0: float, t1: float) -> Draft:
        """``propose``'s second half: the draft (its modeled cost, the clock before and after drafting it), cut to
        the budgets; the step waits for its verification (``finish_step``)."""
        (ctx, drafter, asked, max_nodes), self._proposal = self._proposal, None
        bounds = [b for b in (self.draft_budget, self.max_draft_nodes, max_nodes) if b is not None]
        limit = min(bounds) if bounds else None
        # cut: the draft is not what the allocator's budget buys - the request's own budget, or its last tokens'
        # depth bound reached (a draft that stopped shallower than the bound was not shaped by it)
        cut = asked and (self.draft_budget is not None or draft.depth > ctx.max_depth
                         or (limit is not None and ctx.max_depth < limit and draft.depth >= ctx.max_depth))
        if draft.depth > ctx.max_depth:
            draft = draft.truncated(ctx.max_depth)
        if limit is not None and len(draft) > limit:
            draft = draft.first(limit)
        self._pending_step = _PendingStep(ctx, drafter, draft, cost, t0, t1, asked, cut)
        return draft

    @property
    def pending_drafting(self) -> tuple[float, float, int]:
        """The drafting of the step between ``propose`` and ``finish_step``: its modeled cost (verifier decode steps),
        its measured seconds (0 where the drafter was not asked) and the committed tokens its drafter caught up
        (``Draft.catch_up``: a request's first draft feeds its prompt); zeros outside a step."""
        p = self._pending_step
        return (0.0, 0.0, 0) if p is None else (p.draft_cost, p.t1 - p.t0 if p.asked else 0.0, p.draft.catch_up)

    def finish_step(self, out: VerifierOutput, *, cost: float | None = None, t2: float | None = None,
                    verify_s: float | None = None, verify_pricer: Callable[[int], float] | None = None,
                    modeled_scale: float = 1.0) -> tuple[list[int], bool]:
        """Second half of a step, given the verifier's scores of [pending] + the draft (``out``): accept, commit in
        the verifier's cache, feedback to the drafter, rewards, policy, stats. Returns the committed tokens and
        whether the request is over.

        cost: the step's modeled cost (default: the drafting counted by ``draft_step`` plus a verifier forward over
            the draft's rows, priced from shapes - a batched forward is shared by many requests); t2: the clock after
            the verification (sequential); verify_s: else, how long the verification took; verify_pricer: a
            scheduler's price of verifying a counterfactual draft of n nodes (default: priced from shapes);
            modeled_scale: what one unit of modeled cost is in ``cost``'s units (a scheduler that prices drafting by
            measured seconds), so that the other arms' counterfactual drafting is priced as the played arm's is."""
        if self._pending_step is None:
            raise RuntimeError("Request.finish_step called without draft_step")
        p, self._pending_step = self._pending_step, None
        ctx, drafter, draft, draft_cost, t0, t1, asked = p.ctx, p.drafter, p.draft, p.draft_cost, p.t0, p.t1, p.asked
        eng, verifier, stats, policy = self.engine, self.verifier, self.stats, self.policy
        if cost is None:
            cost = draft_cost + eng.meter.price(verifier.model, len(draft) + 1)
        if t2 is not None:
            seconds, verify_s = t2 - t0, t2 - t1
        else:
            verify_s = verify_s or 0.0
            seconds = (t1 - t0) + verify_s
        acc, target_argmax, target_probs = self._accept(out, draft)
        verifier.commit(acc.path, out)
        committed = [int(draft.tokens[i]) for i in acc.path] + [acc.bonus]
        feedback = StepFeedback(draft, acc, committed, target_probs, target_argmax, seconds=seconds, cost=cost)
        if asked:
            drafter.observe(feedback)  # first: the drafters it drafted with (a fused arm's) settle their caches
        rewards: dict[int, float] = {}
        if asked and eng.feedback == "full":
            with eng.meter as tracking:  # model drafters kept in step feed the committed tokens: real work
                counterfactuals = {j: d.counterfactual(ctx, feedback) for j, d in enumerate(self.drafters) if j != self.arm}
            overhead = tracking.steps * modeled_scale  # the pool's overhead, whichever arm drafted
            feedback.cost = cost = cost + overhead
            # a counterfactual draft of n nodes: verified at the scheduler's price, else a forward over [pending] + n
            verify = verify_pricer or (lambda n: eng.meter.price(verifier.model, n + 1))
            for j, c in counterfactuals.items():
                if c is not None:
                    own = c.drafting_cost + sum(eng.meter.price(module, rows) for module, rows in c.forwards)
                    rewards[j] = eng.reward.counterfactual(c, own * modeled_scale + verify(c.drafted) + overhead)
                    self._track_acceptance(j, c.n_accepted, c.depth)
        stats.draft_s += t1 - t0
        stats.verify_s += verify_s
        stats.catch_up_tokens += draft.catch_up
        stats.modeled_cost += cost
        name = drafter.name if drafter is not None else "none"
        stats.record_step(name, draft.depth, len(draft), acc.n_accepted, len(committed), draft.meta)
        self.last_step = StepRecord(name, len(draft), draft.depth, acc.n_accepted, len(committed),
                                    tuple(int(i) for i in acc.path), p.cut)
        value = eng.reward.step(feedback)
        stats.rewards.append(value)
        self.step_rewards.append(value)
        if drafter is not None:
            self._track_acceptance(self.arm, acc.n_accepted, draft.depth)
            if policy is not None and eng.granularity == "step":
                rewards[self.arm] = value
                policy.observe(self.arm, rewards, self.context_used)
        return self._keep(committed, out.logits, acc.path)

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
        drafters = self.drafters
        matches = [m for d in drafters if (m := d.longest_match(ctx.tokens)) is not None]
        confidences = [c for d in drafters if (c := d.confidence()) is not None]
        parts = [self.context, step_features(max(matches, default=0), max(confidences, default=0.0), self.recent)]
        self.context_used = np.concatenate(parts + ([self.load] if self.load is not None else []))  # load: last
        return self.context_used

    def _finish(self) -> None:
        eng, stats, policy = self.engine, self.stats, self.policy
        if policy is not None and self.drafters and eng.granularity == "request" and self.step_rewards:
            policy.update(self.arm, eng.reward.request(stats, self.step_rewards), self.context)
        stats.new_tokens = len(self.new_ids)
        stats.wall_s = now(self.verifier.device) - self.t_start
        stats.policy_state = policy.state_dict() if policy is not None else None
