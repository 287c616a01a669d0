"""The engine: speculative decoding with a pool of drafters, one shared verifier and a policy.

One step (docs/algorithms.md#steps-and-metrics): the policy picks a drafter, the drafter proposes a chain or tree,
the verifier scores it in one forward, an exact acceptance rule keeps a prefix (a root-to-node path)
plus one bonus token, and the verifier's cache keeps exactly what was committed.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

from .batching.scheduler import Scheduler
from .decoding.drafter import Drafter
from .decoding.drafter import with_components as _with_components
from .decoding.policy import Policy
from .decoding.prompt import InfillPrompt, encode_infill
from .decoding.request import GenerationResult, Prompt, Request, encode_prompt
from .decoding.rewards import get_reward
from .decoding.sampling import SEEDED_SAMPLING
from .decoding.tokens import check_tokenizers_compatible, eos_token_ids
from .execution.verifier import Verifier
from .pricing.cost import CostModel, StepMeter, attach, decode_step_cost

#: ``Engine.from_config`` reads pool files through the config layer (``metasd.config``), which registers its loader
#: here when imported (``import metasd`` does): the core itself imports no YAML and no layer above it.
_POOL_LOADER: Callable[..., "Engine"] | None = None


class EngineBusyError(RuntimeError):
    """A request was started on a verifier or drafter that another request is still using (their KV caches hold one
    request at a time)."""


class GenerationInterrupted(KeyboardInterrupt):
    """A KeyboardInterrupt that cut a request short (``Engine.generate``, ``Engine.stream``); ``result`` holds what it
    had generated: its tokens and text so far and the stats of its steps (stop reason "interrupted")."""

    def __init__(self, result: GenerationResult):
        super().__init__("generation interrupted")
        self.result = result

    @staticmethod
    def result_of(exc: KeyboardInterrupt, stream: Iterator[str] | None = None) -> GenerationResult | None:
        """What a request an interrupt cut short had generated: the result it carries when it arrived in a step; one
        that landed in the caller between two pieces of ``stream`` is thrown into the stream, which ends its request
        the same way. None when no request had begun."""
        if isinstance(exc, GenerationInterrupted):
            return exc.result
        if stream is not None:
            try:
                stream.throw(exc)
            except GenerationInterrupted as e:
                return e.result
            except (KeyboardInterrupt, StopIteration):  # not started yet, or already over
                pass
        return None


_IN_USE = "_metasd_in_use"  # the attribute that marks a verifier or drafter as held, by the request's _Claim
_TAKEOVER = threading.Lock()  # serialises taking over a stale mark with dropping one


class _Claim:
    """One request's mark on the verifier and drafters it holds (``Engine.exclusive_use``). ``ended`` once the
    request's cleanup has begun: a mark still left then (an interrupt cut the cleanup short) is stale, and the next
    request takes it over instead of being refused."""

    __slots__ = ("ended",)

    def __init__(self):
        self.ended = False

    def __deepcopy__(self, memo):  # a copy of a held drafter is a new object, held by nobody
        copy = _Claim()
        copy.ended = True
        return copy


def _claim(owner: Any, claim: _Claim) -> bool:
    """Mark ``owner`` as held by ``claim``, or say it is held by another request. The mark is made and recorded by
    one dict operation (``setdefault``): no bytecode runs between the two, so an interrupt (KeyboardInterrupt, raised
    between bytecodes) cannot leave ``owner`` held with no record of who holds it; ``exclusive_use`` drops the marks
    by identity, whichever of them were made."""
    mark = owner.__dict__.setdefault(_IN_USE, claim)
    if mark is claim:
        return True
    if not mark.ended:
        return False
    with _TAKEOVER:  # a stale mark (an interrupted cleanup): take it over, unless it is being dropped right now
        if owner.__dict__.get(_IN_USE) is mark:
            owner.__dict__[_IN_USE] = claim
    return owner.__dict__.setdefault(_IN_USE, claim) is claim


def _release(owner: Any, claim: _Claim) -> None:
    """Drop ``claim``'s mark on ``owner``, if it has one (never another request's)."""
    with _TAKEOVER:
        if owner.__dict__.get(_IN_USE) is claim:
            del owner.__dict__[_IN_USE]


def set_pool_loader(loader: Callable[..., "Engine"]) -> None:
    """Register the function ``Engine.from_config`` builds engines with (``metasd.config.load_pool``)."""
    global _POOL_LOADER
    _POOL_LOADER = loader


class Engine:
    """Lossless speculative decoding over a pool of drafters chosen by a bandit policy.

    drafters: the pool (a single drafter, a sequence, or a name -> drafter mapping). Empty: plain
        autoregressive decoding through the same code path (each step verifies the pending token only).
    policy: picks a drafter per ``granularity`` ("step" or "request") from ``reward`` ("throughput",
        "wall_throughput", "block_efficiency", "block_divergence"); ``persistent_policy`` keeps what it
        learnt across requests, else it is reset per request (MetaSD's episodes). Needed for a pool of two or
        more drafters; with one drafter (or none) there is nothing to choose and it may be left out.
    cost_model: prices the work of a step for the (deterministic) throughput reward; default: the
        calibration for the verifier's device type (``metasd.core.pricing.cost``).
    feedback: "bandit" (the policy learns from the chosen arm's reward) or "full": after each step every other arm
        that can say what it would have had accepted (``Drafter.counterfactual``: lookup drafters, model drafters
        kept in step with ``track``) is scored too, without another verifier forward, and the policy learns from all
        of them (``Policy.observe``; docs/algorithms.md#full-information-feedback). Needs a reward with
        counterfactual values (``throughput``, ``block_efficiency``).
    profile: read the step clock after synchronising the device (three host-device synchronisations a step on CUDA),
        so that ``RequestStats.draft_s`` / ``verify_s`` time the device's work; otherwise a step synchronises only
        where it reads device data (docs/architecture.md#where-tensors-live). A reward that reads seconds
        (``wall_throughput``) turns it on.
    seeded_sampling: how a request sampled with a ``seed`` draws: "keyed" (default) - every token from Gumbel noise
        keyed by (seed, position), verified by sample-and-match, so its text is plain seeded decoding's whatever was
        drafted or ran beside it; "stream" - from its own seeded generator with the exact rules that read the
        drafter's probabilities (rejection sampling: more accepted tokens; the same text for the same seed when the
        request runs alone or its drafts do not depend on other requests). Unseeded requests always draw from a
        fresh stream. docs/architecture.md#random-streams.
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
        feedback: str = "bandit",
        profile: bool = False,
        seeded_sampling: str = "keyed",
    ):
        self.verifier = verifier
        self.tokenizer = verifier.tokenizer
        self.drafters = _as_list(drafters)
        self.all_drafters = _with_components(self.drafters)  # the pool's arms and what they draft with, each once
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names in a pool must be unique, got {names}")
        if granularity not in ("step", "request"):
            raise ValueError(f"granularity must be 'step' or 'request', got {granularity!r}")
        self.granularity = granularity
        self.reward_name = reward
        self.reward = get_reward(reward)
        self.persistent_policy = persistent_policy
        self.categories = tuple(categories)
        if feedback not in ("bandit", "full"):
            raise ValueError(f"feedback must be 'bandit' or 'full', got {feedback!r}")
        if feedback == "full" and not self.reward.counterfactual_values:
            raise ValueError(f"feedback 'full' needs a reward other arms can be scored by without running them "
                             f"(throughput or block_efficiency); reward {reward!r} has no counterfactual values")
        self.feedback = feedback
        if seeded_sampling not in SEEDED_SAMPLING:
            raise ValueError(f"seeded_sampling must be one of {list(SEEDED_SAMPLING)}, got {seeded_sampling!r}")
        self.seeded_sampling = seeded_sampling
        self.profile_asked = bool(profile)
        self.profile = self.profile_asked or bool(getattr(self.reward, "reads_clock", False))
        self.policy = self._check_policy(policy)
        if check_tokenizers:
            self._check_tokenizers()
        self.cost_model = cost_model or CostModel.for_device(verifier.device)
        attach([verifier.model, *(m for d in self.all_drafters for m in d.modules())])
        self.meter = StepMeter(self.cost_model, decode_step_cost(verifier.model, self.cost_model))
        self.hidden_layers = tuple(sorted({layer for d in self.all_drafters for layer in d.hidden_layers}))
        #: model drafters draft under a request's processing - grammar, allowed ids, bad words, min_tokens, bias
        #: (``StepContext.processing``); False only to measure what that buys: outputs are the same
        self.mask_drafts = True
        backend = getattr(verifier, "backend", "torch")
        if self.hidden_layers and backend != "torch":
            readers = [d.name for d in self.all_drafters if d.hidden_layers]
            raise ValueError(f"drafters {readers} read the verifier's hidden states, which the {backend} backend does "
                             "not hand out (verifier: {backend: torch})")
        for layer in self.hidden_layers:
            if not 0 <= layer <= verifier.num_layers:
                raise ValueError(f"a drafter asks for verifier layer {layer}; {verifier.name} has hidden states 0..{verifier.num_layers}")

    @property
    def clock_device(self):
        """The device a step's clock reads wait for (``metasd.core.execution.clock.now``): the verifier's when
        profiling, else None (no synchronisation)."""
        return self.verifier.device if self.profile else None

    # ---------------------------------------------------------------- public API
    @classmethod
    def from_config(cls, path=None, overrides: Mapping[str, Any] | None = None) -> "Engine":
        """Build the engine of a pool config file (default: the embedded default pool); the same as
        ``metasd.load_pool(path, overrides)``."""
        if _POOL_LOADER is None:
            raise RuntimeError("Engine.from_config needs metasd.config: import metasd (or metasd.config) first")
        return _POOL_LOADER(path, dict(overrides or {}))

    def derive(self, drafters: Sequence[str] | None = None, policy: Policy | None = None, **settings) -> "Engine":
        """A new engine sharing this one's verifier and drafter objects (no model is reloaded).

        drafters: names of the arms to keep (default: all); policy: its policy (required for a pool of
        several); settings: granularity, reward, persistent_policy, categories, cost_model, feedback, profile,
        seeded_sampling.
        """
        chosen = self.drafters if drafters is None else [self.drafter(n) for n in drafters]
        kwargs = dict(granularity=self.granularity, reward=self.reward_name, persistent_policy=self.persistent_policy,
                      categories=self.categories, check_tokenizers=False, cost_model=self.cost_model,
                      feedback=self.feedback, profile=self.profile_asked, seeded_sampling=self.seeded_sampling)
        kwargs.update(settings)
        return Engine(self.verifier, chosen, policy, **kwargs)

    def drafter(self, name: str) -> Drafter:
        for d in self.drafters:
            if d.name == name:
                return d
        raise KeyError(f"no drafter named {name!r} in the pool; drafters: {[d.name for d in self.drafters]}")

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, **kwargs) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens; returns text, token ids and per-request stats (a KeyboardInterrupt
        meanwhile raises ``GenerationInterrupted``, whose ``result`` is what was generated so far).

        Keyword arguments: temperature (0 = greedy), top_p, top_k, min_p (in [0, 1]: a token less likely than
        min_p times the most likely one is never sampled; applied after top_k and top_p), stop (strings; the text
        ends before the first one), seed (sampling reproducible), policy (overrides the engine's for this call),
        chat (apply the chat template to a string prompt; default: only for message lists),
        category (request feature for contextual policies), logprobs (None, or k in 0..20: each new token's raw
        log-probability under the verifier and its k most likely alternatives, in ``result.logprobs``),
        prompt_logprobs (the same for the prompt's tokens, ``result.prompt_logprobs``; one more prefill cost),
        presence_penalty, frequency_penalty (in [-2, 2]) and repetition_penalty (> 0; 1 = off), applied along each
        draft node's own path so the output stays plain penalised decoding's (``metasd.core.decoding.penalties``),
        logit_bias ({token id: amount in [-100, 100]} added to its logit at every position, before the penalties;
        -100 in effect bans a token), constraint (structured output, ``metasd.core.constraints``), ignore_eos (generate
        past end-of-sequence tokens up to ``max_new_tokens``, as vLLM's benchmarks ask for fixed-length answers),
        min_tokens (vLLM's: no end-of-sequence token, and no stop string ending, before this many new tokens),
        stop_token_ids (vLLM's: token ids that end the request as an end-of-sequence token does, even with
        ignore_eos; kept in ``token_ids``, left out of the text as an ending end-of-sequence token is),
        allowed_token_ids (vLLM's: only these tokens may be generated; empty: no restriction),
        include_stop_str_in_output (vLLM's: the text ends after the stop string, or the stop or end-of-sequence token's
        text, that ended it rather than before), bad_words (vLLM's: words never generated, each banned as the token
        sequences it encodes to, as written and after a space; ``metasd.core.decoding.bad_words``),
        skip_special_tokens (vLLM's; default true: special tokens' text left out of the text).
        """
        run = self._run(prompt, max_new_tokens, **kwargs)
        try:
            for _ in run.steps():
                pass
        except KeyboardInterrupt as e:
            raise GenerationInterrupted(run.interrupted_result()) from e
        return run.result()

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, **kwargs) -> Iterator[str]:
        """Yield text as tokens commit; the full ``GenerationResult`` is the generator's return value. A
        KeyboardInterrupt during a step, or thrown into the generator between pieces (``gen.throw``), ends the request
        with ``GenerationInterrupted`` (its ``result``: what was generated so far)."""
        run = self._run(prompt, max_new_tokens, **kwargs)
        emitted = 0  # characters yielded
        try:
            for _ in run.steps():
                text = run.text_so_far()  # incremental: complete characters, nothing a stop string may still cut
                if len(text) > emitted:
                    yield text[emitted:]
                    emitted = len(text)
        except KeyboardInterrupt as e:
            raise GenerationInterrupted(run.interrupted_result()) from e
        result = run.result()
        if len(result.text) > emitted:
            yield result.text[emitted:]
        return result

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int = 128, *, max_batch: int = 8,
                       **kwargs) -> list[GenerationResult]:
        """Generate for every prompt, up to ``max_batch`` at once through a ``Scheduler`` (continuous batching: one
        verifier forward per step for all running requests); the results in the prompts' order. Keyword arguments,
        the same for every prompt: ``Scheduler.submit``'s (temperature, top_p, top_k, stop, seed, chat, options).
        A request that fails raises its error after the others have finished."""
        with Scheduler(self, max_batch=max_batch, max_queue=max(len(prompts), 1)) as scheduler:
            handles = [scheduler.submit(p, max_new_tokens, **kwargs) for p in prompts]
            outcomes = []
            for h in handles:
                try:
                    outcomes.append(h.result())
                except Exception as e:  # noqa: BLE001 - raised after every request is over
                    outcomes.append(e)
        for o in outcomes:
            if isinstance(o, BaseException):
                raise o
        return outcomes

    def encode(self, prompt: Prompt, chat: bool | None = None, tools: Sequence[Mapping] | None = None,
               **template: Any) -> list[int]:
        """Prompt -> token ids. Message lists always get the chat template (with ``tools``, OpenAI's tool objects,
        where given; ``template``: ``add_generation_prompt``, ``continue_final_message``, ``documents``,
        ``chat_template`` and ``variables`` - more names the template reads, e.g. ``{"enable_thinking": False}`` -
        as ``render_chat`` takes them); strings when ``chat``."""
        return encode_prompt(self.tokenizer, prompt, chat, self.verifier.name, tools, **template)

    def encode_infill(self, prefix: str, suffix: str) -> InfillPrompt:
        """The prompt asking for the text between ``prefix`` and ``suffix`` in the verifier's fill-in-the-middle
        format, and the tokens that end it: ``engine.generate(p.ids, n, stop_token_ids=p.stop_token_ids)``."""
        return encode_infill(self.tokenizer, prefix, suffix, self.verifier.name)

    # ---------------------------------------------------------------- internals
    def _run(self, prompt: Prompt, max_new_tokens: int, **kwargs) -> Request:
        return Request(self, prompt, max_new_tokens, **kwargs)

    def _check_policy(self, policy: Policy | None) -> Policy | None:
        """The policy checked against the pool; None (one drafter or none: nothing to choose)."""
        if policy is None:
            if len(self.drafters) > 1:
                raise ValueError(f"a pool of {len(self.drafters)} drafters needs a policy (see metasd.policies)")
            return None
        n = max(len(self.drafters), 1)
        if policy.n_arms != n:
            raise ValueError(f"policy {policy.name!r} has {policy.n_arms} arms but the pool has {n} drafters")
        if not self.reward.bounded and getattr(policy, "requires_bounded_rewards", False):
            raise ValueError(f"policy {policy.name!r} needs rewards in [0, 1]; reward {self.reward_name!r} is unbounded")
        return policy

    def _check_tokenizers(self) -> None:
        """Every drafter's ids mean what the verifier's mean: its own tokenizer's, or - for a drafter that translates
        its drafts (cross-tokenizer drafting) - the tokenizer it translates into."""
        for d in self.all_drafters:
            theirs = d.target_tokenizer if d.target_tokenizer is not None else d.tokenizer
            if theirs is None or self.tokenizer is None or theirs is self.tokenizer:
                continue
            model = d.describe().get("model")
            label = f"{d.name} (model {model})" if model and model != d.name else d.name
            advice = ""
            if d.target_tokenizer is None and type(d).cross_tokenizer:
                advice = ("; a drafter of another model family can draft with its own tokenizer: `tokenizer: own` "
                          "in its pool entry (in Python: verifier_tokenizer=...)")
            check_tokenizers_compatible(self.tokenizer, theirs, self.verifier.name, label, advice=advice)

    @contextmanager
    def exclusive_use(self):
        """Hold the verifier and every drafter for one request. Their KV caches and per-request state hold one request
        at a time, and engines made by ``derive`` share them: a second request on any of them while the first runs (from
        another thread, or a second ``stream`` opened before the first ended) is refused with ``EngineBusyError`` rather
        than corrupting a cache. Run concurrent requests on separate engines (separate model copies)."""
        claim = _Claim()
        owners = (self.verifier, *self.all_drafters)
        try:
            for owner in owners:
                if not _claim(owner, claim):
                    what = "verifier" if owner is self.verifier else f"drafter {owner.name!r}"
                    raise EngineBusyError(f"the {what} is in use by another request: metasd runs one request at a time "
                                          f"per verifier and per drafter; wait for it to finish, or use another engine")
            yield
        finally:
            claim.ended = True  # first (an attribute store: no interrupt lands before it): marks left now are stale
            for owner in owners:
                _release(owner, claim)

    def eos_ids(self) -> set[int]:
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
