"""SpS: a small pretrained causal LM drafts a chain autoregressively - in the verifier's tokens when it shares the
verifier's tokenizer, or in its own tokens translated into the verifier's through text (cross-tokenizer drafting,
``verifier_tokenizer``; ``metasd.drafters.token_bridge``)."""
from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from metasd.core.decoding.drafter import (Counterfactual, Drafter, StepContext, StepFeedback, check_params,
                                          register_drafter)
from metasd.core.decoding.processing import DraftProcessing
from metasd.core.execution.hooks import contiguous_lm_head_input
from metasd.core.execution.kv_cache import crop_to
from metasd.core.execution.prefix_cache import KVPrefix
from metasd.core.execution.draft_rows import DraftRows, give_back_row
from metasd.core.execution.static_cache import StaticKVCache, new_cache
from metasd.models import ModelLoadError, config_eos_ids
from metasd.core.decoding.sampling import process_logits, sample
from metasd.core.execution.draft_batch import Drafting, Feed, drive, forward_logits
from metasd.core.execution.draft_loop import DraftLoops
from metasd.core.execution.graph_runner import resolve_graphs
from metasd.core.execution.staging import to_device
from metasd.core.execution.tree import DeviceTokens, Draft

from .draft_head import DraftHead
from .pretrained_params import GRAPHS_HELP, HEAD_VOCAB_HELP, TRACK_HELP, PretrainedParams  # noqa: F401 (re-exported)
from .shared_vocab import SharedVocab
from .token_bridge import TokenBridge
from .tracking import chain_acceptance


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))  # usually a drafter's cache is a prefix of the text: compared at C speed first
    return n if a[:n] == b[:n] else next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


@register_drafter
class PretrainedDrafter(Drafter):
    """A small LM with its own KV cache drafting ``k`` tokens per step (docs/algorithms.md#pretrained-drafters).

    Catch-up: before drafting, the drafter crops its cache to the longest prefix it shares with the
    committed tokens and feeds the rest in one forward (the bonus token of the last step, plus any tokens
    committed while another drafter was chosen). Under sampling each draft token is drawn from the
    processed drafter distribution q, which the draft carries for rejection sampling.

    confidence_threshold: stop drafting after a token whose drafter probability (temperature 1) is below
        it (transformers' ``assistant_confidence_threshold``).
    adaptive_k: transformers' heuristic schedule: k += 2 after a fully accepted draft, else k -= 1.
    graphs: alone (``Engine``), the greedy chain after the catch-up drafted as one fixed-shape loop (``DraftLoops``);
        a scheduler's forks draft level by level over one set of rows, each level one fixed-shape forward for the
        batch (``DraftRows``) - CUDA graphs where the model is on CUDA ("auto"); ``fixed_shapes`` runs those shapes
        eagerly (the CPU check). A sampled chain, a confidence stop and a grammar draft eagerly alone.
    """

    kind = "pretrained"
    draft_loops = True  # its greedy chain runs as a fixed-shape drafting loop where ``graphs`` says (the class doc)
    draft_rows = True  # a scheduler's forks draft each level for the batch at a fixed shape where ``graphs`` says
    model_field, checkpoint_field = "required", "never"
    Params = PretrainedParams
    cross_tokenizer = True

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer=None,
        k: int = 5,
        confidence_threshold: float | None = None,
        adaptive_k: bool = False,
        k_min: int = 1,
        k_max: int = 16,
        head_vocab: int | None = None,
        track: bool = False,
        name: str | None = None,
        model_ref: str | None = None,
        verifier_tokenizer=None,
        verifier_name: str = "verifier",
        graphs: str = "auto",
        fixed_shapes: bool | None = None,
    ):
        super().__init__(name)
        check_params(PretrainedParams, dict(k=k, confidence_threshold=confidence_threshold, adaptive_k=adaptive_k,
                                            k_min=k_min, k_max=k_max, head_vocab=head_vocab, track=track), self.name)
        if track and verifier_tokenizer is not None:
            raise ValueError(f"{self.name}: track is not available with tokenizer: own (its logits are over other ids)")
        self.track = track
        self.bridge: TokenBridge | None = None
        self.shared: SharedVocab | None | bool = False  # the ids shared with the verifier: False until first needed
        if verifier_tokenizer is not None:  # cross-tokenizer drafting: draft in the model's own tokens, translate
            if not type(self).cross_tokenizer:
                raise ValueError(f"{self.name}: drafter type {self.kind!r} cannot draft with a tokenizer of its own "
                                 f"(verifier_tokenizer given)")
            self.bridge = TokenBridge(
                verifier_tokenizer, tokenizer, drafter=self.name, verifier_model=verifier_name,
                drafter_model=model_ref or getattr(model.config, "_name_or_path", "") or type(model).__name__,
                stop_ids=set(getattr(tokenizer, "all_special_ids", None) or ()) | config_eos_ids(model))
            self.target_tokenizer = verifier_tokenizer
        self.model = contiguous_lm_head_input(model.eval())
        self.head_vocab = head_vocab
        try:
            self.draft_head = None if head_vocab is None else DraftHead(model.get_output_embeddings(), head_vocab,
                                                                         extra=config_eos_ids(model))
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        self.tokenizer = tokenizer
        self.model_ref = model_ref
        self.k_initial = self.k = k
        self.confidence_threshold = confidence_threshold
        self.adaptive_k = adaptive_k
        self.k_min, self.k_max = k_min, k_max
        self.cache: StaticKVCache | None = None
        self._fed_draft: DeviceTokens | None = None  # draft tokens fed from the device, read with the draft
        self.cached_ids: list[int] = []  # tokens whose keys/values are in self.cache (and in _fed_draft)
        self._unread = 0  # draft tokens fed from the device and not read yet (they follow cached_ids in the cache)
        self.last_catch_up = 0  # committed tokens fed in the last propose beyond the pending one
        self.steering = None  # a composed ``metasd.drafters.steered.Steering`` (the steered types set it)
        self._root: tuple[int, torch.Tensor] | None = None  # (cached tokens, logits after them) from tracking
        self._resumed = False  # the cache was started from a stored prefix (``resume``) for the next request
        self.graphs = graphs
        capture = resolve_graphs(graphs, self.model.device, self.name)
        if graphs == "on" and not (type(self).draft_loops or type(self).draft_rows):
            raise ValueError(f"{self.name}: drafter type {self.kind!r} drafts eagerly; graphs 'on' is for the "
                             "pretrained, pretrained_tree and static_tree types")
        fixed = capture or bool(fixed_shapes) or graphs == "fixed"
        self.loops = DraftLoops(self.model, self.draft_head, capture=capture, name=self.name) \
            if fixed and type(self).draft_loops else None
        #: the forks' caches: rows of one set of buffers, a drafting level of the batch one fixed-shape forward
        self.rows = DraftRows(self.model, self.draft_head, capture=capture, name=self.name) \
            if fixed and type(self).draft_rows else None

    @property
    def cached_ids(self) -> list[int]:
        """The tokens whose keys/values are in ``cache``. Draft tokens fed from the device join them when the host
        reads the draft (the step's acceptance reads it with the verifier's choices: no read of their own)."""
        if self._fed_draft is not None:
            fed, self._fed_draft = self._fed_draft, None
            self._ids.extend(fed.host())
        return self._ids

    @cached_ids.setter
    def cached_ids(self, ids: list[int]) -> None:
        self._ids, self._fed_draft = ids, None

    @classmethod
    def from_config(cls, name, params, build):
        if not build.model:
            raise ValueError(f"drafter {name!r} of type {cls.kind!r} needs a model reference (field 'model')")
        own = build.own_tokenizer(name, cls)
        try:
            model, tokenizer = build.load_model(build.model)
        except ModelLoadError as e:
            if not own:
                raise
            raise ModelLoadError(f"drafter {name!r} (model {build.model!r}, tokenizer: own) for verifier "
                                 f"{build.verifier.name!r}: {e}") from e
        if own:
            params = {**params, "verifier_tokenizer": build.verifier.tokenizer, "verifier_name": build.verifier.name}
        return cls(model, tokenizer, name=name, model_ref=build.model, **params)

    def begin(self, ctx: StepContext) -> None:
        if not self._resumed:  # a cache started from a stored prefix (``resume``) is kept
            self._fresh_cache()
        self._resumed = False
        self._root = None
        self.k = self.k_initial
        if self.bridge is not None:
            self.bridge.begin()

    def _fresh_cache(self) -> None:
        give_back_row(self.cache)
        if self.loops is not None:
            self.cache = self.loops.fresh_cache()
        else:  # a row of the shared buffers where shapes are fixed (a scheduler's fork), else a cache of its own
            self.cache = self.rows.take() if self.rows is not None else new_cache(self.model, name=self.name)
        self.cached_ids = []

    def end(self) -> None:
        give_back_row(self.cache)
        self.cache, self.cached_ids, self._resumed = None, [], False

    def kv_prefix(self, tokens) -> KVPrefix | None:
        """The cache's positions that hold a prefix of ``tokens`` (``Drafter.kv_prefix``); none for a drafter in its own
        tokens (a prefix of the verifier's ids is not one of its own) or a steered one (its positions carry the
        verifier's states)."""
        if self.cache is None or self.bridge is not None or self.steering is not None:
            return None
        n = common_prefix_len(self.cached_ids, list(tokens))
        if not n:
            return None
        keys, values = self.cache.copy_prefix(n)
        return KVPrefix(torch.tensor(self.cached_ids[:n], dtype=torch.long), keys, values)

    def resume(self, prefix: KVPrefix, length: int) -> None:
        """``Drafter.resume``: a fresh cache holding ``prefix``'s first ``length`` positions, kept by ``begin``."""
        self._fresh_cache()
        self.cache.load_prefix(prefix.keys, prefix.values, length)
        self.cached_ids = prefix.ids[:length].tolist()
        self._resumed = True

    def _forked(self, cross_request: bool) -> None:
        """Own request state: the cache, the ids fed, the translation state and the steering's step state (the
        steering hooks on the shared model stay shared: they act only while a drafter's forward runs)."""
        self.cache, self.cached_ids, self._unread, self._root, self._resumed = None, [], 0, None, False
        self.loops = None  # a scheduler's requests draft level by level, batched (a graph per fork would not pay)
        if self.bridge is not None:
            self.bridge = copy.copy(self.bridge)
            self.bridge.begin()
        if self.steering is not None:
            self.steering = copy.copy(self.steering)

    def _logits(self, last_only: bool, **inputs) -> torch.Tensor:
        """One forward of the drafter model through its cache; next-token logits [rows, vocab] (the last row
        only when ``last_only``), from the draft head when there is one."""
        return forward_logits(self.model, self.draft_head, self.cache, last_only, **inputs)

    def _forward_steps(self, ids: list[int] | torch.Tensor) -> Drafting:
        """Feed ``ids`` after the cached tokens (a ``Feed`` the drafting loop yields); return the next-token logits
        [vocab]. ``ids``: host ints, or a device tensor [n] of draft tokens not read yet (their ids join
        ``cached_ids`` once the draft is read)."""
        start = len(self.cached_ids) + self._unread
        steer = self.steering.steer(start, ids) if self.steering is not None else None
        fixed = self.loops.catch_up(ids) if self.loops is not None and not isinstance(ids, torch.Tensor) else None
        logits = yield fixed or Feed(self.model, self.draft_head, self.cache, ids, last_only=True, steer=steer)
        if isinstance(ids, torch.Tensor):
            self._unread += ids.numel()
        else:
            self.cached_ids.extend(ids)
        return logits[-1]

    def _forward(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """``_forward_steps`` run alone."""
        return drive(self._forward_steps(ids))

    @torch.inference_mode()
    def sync(self, tokens: list[int]) -> torch.Tensor:
        """Bring the cache up to ``tokens`` (all committed); return the logits after the last one [vocab]."""
        return drive(self._sync_steps(tokens))

    def _sync_steps(self, tokens: list[int]) -> Drafting:
        """``sync`` as a drafting loop (its catch-up forward yielded)."""
        if self.cache is None:
            self.begin(None)  # type: ignore[arg-type]
        root, self._root = self._root, None
        if root is not None and root[0] == len(tokens) == len(self.cached_ids) and self.cached_ids == tokens:
            self.last_catch_up = 0  # tracking fed them all already (counted in the steps where it ran)
            return root[1]
        keep = self._crop_to_common_prefix(tokens, len(tokens) - 1)
        self.last_catch_up = len(tokens) - keep - 1
        return (yield from self._forward_steps(tokens[keep:]))

    def _crop_to_common_prefix(self, tokens: list[int], keep_at_most: int) -> int:
        """Crop the cache to its common prefix with ``tokens`` (at most ``keep_at_most`` positions); the positions
        kept (a sliding-window layer keeps every position too, so any crop can be made)."""
        keep = min(common_prefix_len(self.cached_ids, tokens), keep_at_most)
        crop_to(self.cache, keep)
        del self.cached_ids[keep:]
        return keep

    @torch.inference_mode()
    def counterfactual(self, ctx: StepContext, feedback: StepFeedback) -> Counterfactual | None:
        """With ``track``: feed the pending token and the step's committed tokens (the catch-up this drafter would run
        when it drafts next, so nothing is computed twice) and read from their logits what it would have had accepted
        (``metasd.drafters.tracking``). Without: None (bandit feedback)."""
        if not self.track:
            return None
        tokens = ctx.tokens.tolist()
        committed = feedback.committed
        rows = self._feed_all(tokens + committed, len(tokens) - 1)[-(len(committed) + 1):]  # [m + 1, vocab]
        self._root = (len(self.cached_ids), rows[-1])  # after c_m: the next step's root, already computed
        c = to_device(committed, rows.device, torch.long)
        p = None if feedback.target_probs is None else feedback.target_probs[[0] + [i + 1 for i in feedback.acceptance.path]]
        return self._counterfactual_of(rows[:-1], c, ctx, p)

    def _counterfactual_of(self, rows: torch.Tensor, committed: torch.Tensor, ctx: StepContext, p) -> Counterfactual:
        """The chain's counterfactual (the tree drafter overrides it)."""
        depth = min(self.k, ctx.max_depth)
        n, censored = chain_acceptance(rows, committed, depth, ctx.sampling, p)
        return Counterfactual(n, depth, depth, self._draft_forwards([1] * max(depth - 1, 0)), censored)

    def _draft_forwards(self, rows: list[int]) -> list[tuple[nn.Module, int]]:
        """The networks a drafting step runs for forwards of ``rows`` each, for pricing from shapes."""
        if self.draft_head is None:
            return [(self.model, r) for r in rows]
        return [(m, r) for r in rows for m in (self.model.base_model, self.draft_head)]

    def _feed_all(self, tokens: list[int], keep_at_most: int) -> torch.Tensor:
        """Bring the cache up to ``tokens``, refeeding from ``keep_at_most`` at the latest; logits [fed, vocab]."""
        if self.cache is None:
            self.begin(None)  # type: ignore[arg-type]
        self._root = None
        ids = tokens[self._crop_to_common_prefix(tokens, keep_at_most):]
        logits = self._logits(False, input_ids=to_device([ids], self.model.device, torch.long))
        self.cached_ids.extend(ids)
        return logits

    def confidence(self) -> float | None:
        """With ``track``: the probability of its own top token after the last committed token (one host read)."""
        return None if not self.track or self._root is None else float(self._root[1].float().softmax(-1).max())

    def steered_step(self, ctx: StepContext):
        """Context of one drafting step: the steering component's guide for every forward in it, if any."""
        return self.steering.step(ctx) if self.steering is not None else nullcontext()

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> Draft:
        return drive(self.drafting(ctx))

    def drafting(self, ctx: StepContext) -> Drafting:
        """``propose`` as a loop that yields its forwards (``Feed``): a scheduler runs those of many requests in one
        forward (core/execution/draft_batch.py); ``propose`` runs them one by one."""
        with torch.inference_mode(), self.steered_step(ctx):
            return (yield from self.make_draft(ctx))

    def make_draft(self, ctx: StepContext) -> Drafting:
        """The draft of one step (a chain here; the tree drafter overrides it), inside ``steered_step``: a drafting
        loop (it yields its forwards)."""
        if self.bridge is not None:
            return (yield from self.make_translated_draft(ctx))
        depth = min(self.k, ctx.max_depth)
        if depth <= 0:
            return Draft.empty()
        logits = yield from self._sync_steps(ctx.tokens.tolist())  # [vocab]
        whole = None  # argmax k times = the top-1 tree of k levels, one shape: one loop (for the batch over rows)
        if ctx.sampling.greedy and ctx.processing is None and self.confidence_threshold is None:
            whole = self.loops.feed([1] * self.k, logits) if self.loops is not None else \
                None if self.rows is None else self.rows.loop_feed([1] * self.k, self.cache, logits)
        if whole is not None:
            tokens = DeviceTokens((yield whole)[:depth])  # [depth] on the device
            self._fed_draft = tokens.prefix(depth - 1) if depth > 1 else None  # joins cached_ids when read
            return Draft.chain(tokens, None, catch_up=self.last_catch_up)
        tokens, probs = yield from self._draft_chain(logits, depth, ctx)
        return Draft.chain(tokens, torch.stack(probs) if probs else None, catch_up=self.last_catch_up)

    def _draft_chain(self, logits: torch.Tensor, depth: int, ctx: StepContext, stop_ids: frozenset[int] = frozenset(),
                     keep_probs: bool = True, shared: SharedVocab | None = None) -> Drafting:
        """Up to ``depth`` tokens drawn one by one from the logits after the synced tokens (greedy: argmax; else
        sampled from the processed q, whose rows are returned when ``keep_probs``). A token in ``stop_ids`` ends
        the chain. With ``shared`` (sampling only), q is restricted to the ids shared with the verifier and its rows
        are returned over the verifier's ids; the chain ends where q has no mass on them.

        The chain stays on the model's device (``DeviceTokens``), each token fed to the next forward as a device
        tensor; the host reads it once, with the verifier's choices - only a stop rule (the confidence stop,
        ``stop_ids``) or the request's processing (``ctx.processing``, along the chain by ``DraftProcessing``) reads
        each token as it goes. A drafting loop: returns (tokens: DeviceTokens, or [] when none; q rows)."""
        drafted: list[torch.Tensor] = []  # [1] int64 each, on the device
        probs: list[torch.Tensor] = []  # [vocab] each: q, the processed distribution each token was drawn from
        guide = DraftProcessing(ctx.processing) if ctx.processing is not None and shared is None and \
            self.bridge is None else None
        for i in range(depth):
            if guide is not None:
                logits = guide.mask([i - 1], logits.reshape(1, -1))[0]  # [vocab]: after node i-1 (-1: the root)
                if guide.grammar is not None and not bool(torch.isfinite(logits).any()):
                    break  # nothing the grammar allows: the chain ends here
            if ctx.sampling.greedy:
                x = logits.argmax(-1, keepdim=True)
            else:
                q = process_logits(logits, ctx.sampling)  # [vocab]
                if shared is not None and (q := shared.restrict(q)) is None:
                    break
                # a seeded request's keyed noise at the token's position couples the draft to the verifier's draw
                x = (ctx.noise.choose(q, len(ctx.tokens) + i) if ctx.noise else sample(q, ctx.generator)).view(1)
                if keep_probs:
                    probs.append(q if shared is None else shared.to_verifier(q))
            drafted.append(x)
            if guide is not None:
                guide.add(i, i - 1, int(x))
            if i == depth - 1 or (stop_ids and int(x) in stop_ids) or self._unsure(logits, x):
                break
            logits = yield from self._forward_steps(x)
        tokens = DeviceTokens(torch.cat(drafted)) if drafted else []  # read once, with the verifier's choices
        if self._unread:  # the draft tokens fed above join cached_ids when the draft is read
            self._fed_draft = tokens.prefix(self._unread)  # (any earlier ones joined when _forward_steps read them)
        self._unread = 0
        return tokens, probs

    def make_translated_draft(self, ctx: StepContext) -> Drafting:
        """Cross-tokenizer drafting (docs/algorithms.md#cross-tokenizer-drafting): bring the drafter's own ids of the
        committed text up to date (a tail window re-encoded), catch the cache up on them, draft ``k`` tokens of its
        own, and translate their text into the verifier's ids (the last one kept). That draft carries
        no probabilities: it is verified by sample-and-match (greedy: argmax matching), exact for any draft. Under
        sampling, where the vocabularies share tokens (``SharedVocab``), the drafter samples among those only and the
        draft is their verifier ids with q over them, verified by the ratio rule instead."""
        if ctx.max_depth <= 0:
            return Draft.empty()
        committed = ctx.tokens.tolist()
        view = self.bridge.view(committed)
        if view is None:  # the committed ids end inside a character: draft again next step
            return Draft.empty()
        logits = yield from self._sync_steps(view)
        if not ctx.sampling.greedy and self._shared_vocab() is not None:  # exact ratio rule on shared tokens
            drafted, probs = yield from self._draft_chain(logits, min(self.k, ctx.max_depth), ctx, self.bridge.stop_ids,
                                                          shared=self.shared)
            if not drafted:
                return Draft.empty()
            drafted = drafted.host()  # translated on the host
            return Draft.chain(self.shared.verifier_ids(drafted), torch.stack(probs), catch_up=self.last_catch_up,
                               drafter_tokens=len(drafted), reencoded=self.bridge.reencoded)
        drafted, _ = yield from self._draft_chain(logits, self.k, ctx, self.bridge.stop_ids, keep_probs=False)
        drafted = drafted.host() if drafted else []  # translated on the host
        text, _ = self.bridge.draft_text(view, drafted)
        # the last verifier token is kept even where more text could still grow it (a partial token): it ends at a
        # drafter token boundary, mostly a word's end, and a wrong one costs one verified row (docs/algorithms.md)
        tokens = self.bridge.to_verifier(committed, text, complete=True)[: ctx.max_depth]
        return Draft.chain(tokens, None, catch_up=self.last_catch_up, drafter_tokens=len(drafted),
                           reencoded=self.bridge.reencoded)

    def _shared_vocab(self) -> SharedVocab | None:
        """The ids this drafter shares with the verifier (built at the first sampled step: decoding both
        vocabularies takes seconds), or None where none can be found (then sample-and-match)."""
        if self.shared is False:
            self.shared = SharedVocab.build(self.bridge.verifier_tokenizer, self.tokenizer,
                                            self.model.get_output_embeddings().out_features, self.model.device,
                                            keep=self.bridge.shared_stops)
        return self.shared

    def _unsure(self, logits: torch.Tensor, token: torch.Tensor) -> bool:
        """Whether the drafted ``token`` ([1]) had a drafter probability below ``confidence_threshold`` (a host read)."""
        return self.confidence_threshold is not None and \
            float(logits.float().softmax(-1)[token]) < self.confidence_threshold

    def observe(self, feedback: StepFeedback) -> None:
        if not self.adaptive_k or not len(feedback.draft):
            return
        all_accepted = feedback.acceptance.n_accepted == len(feedback.draft)
        self.k = min(self.k + 2, self.k_max) if all_accepted else max(self.k - 1, self.k_min)

    def close(self) -> None:
        if self.steering is not None:
            self.steering.close()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "model": self.model_ref or getattr(self.model.config, "_name_or_path", ""),
            "k": self.k_initial, "confidence_threshold": self.confidence_threshold, "adaptive_k": self.adaptive_k,
            "head_vocab": self.head_vocab, "track": self.track,
            **({"graphs": self.graphs} if type(self).draft_loops or type(self).draft_rows else {}),
            **({"tokenizer": "own"} if self.bridge is not None else {}),
            **(self.steering.describe() if self.steering is not None else {}),
        }
