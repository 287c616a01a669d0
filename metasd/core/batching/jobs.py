"""A request inside the scheduler: how a submitted one is checked and set up (``new_request``), what the scheduler
keeps of it (``Job``: its ``Request``, handle, text stream and where it is), the forks of the pool's drafters it
drafts with (``Forks``) and what those cost in KV memory (``drafter_kv_bytes``)."""
from __future__ import annotations

import copy
import logging
import time

import torch

from ..decoding.drafter import with_components
from ..execution.batch_cache import BatchCache
from ..execution.kv_memory import KVBudgetError, KVGeometry, default_budget_bytes, draft_headroom
from ..decoding.request import Prompt, Request
from ..execution.batch_verifier import BatchVerifier, Prefill, SlotVerifier
from ..execution.draft_rows import draft_rows_of
from ..execution.llama_cpp_batch import LlamaCppBatchVerifier  # needs no llama-cpp-python until one is made
from ..execution.prefix_cache import PrefixCache, PrefixEntry
from .request_handle import RequestFinished, RequestHandle, RequestOptions, RequestStepRecord, TokenEvent

log = logging.getLogger("metasd.core.batching.scheduler")


class TextDeltas:
    """The text of a request's events, piece by piece: what ``Request.text_so_far`` has added since the last piece -
    complete characters, holding back a tail that could still grow into a stop string, and never what follows the
    stop string that ended the request (nor the stop string, unless the request includes it)."""

    def __init__(self, request: Request):
        self.request = request
        self.sent = ""  # the text sent so far

    def add(self) -> str:
        text = self.request.text_so_far()
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (``GenerationResult.text``) not sent yet."""
        return final_text[len(self.sent):] if final_text.startswith(self.sent) else ""  # never send text twice


class Job:
    """A request inside the scheduler: the engine's ``Request``, its handle and where it is (queued, prefilling with
    ``prefill``, running in row ``slot.row``)."""

    def __init__(self, handle: RequestHandle, request: Request, options: RequestOptions):
        self.handle = handle
        self.request = request
        self.options = options
        self.text = TextDeltas(request)
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.sent = 0  # new tokens sent in events
        self.prefill: Prefill | None = None
        self.slot: SlotVerifier | None = None  # its view of the batched verifier, from the start of its prefill
        self.forks: Forks | None = None
        self.kv_tokens = 0  # KV positions its admission reserves (prompt, max_new_tokens, the widest draft)
        self.begun = False  # the request's drafters started (Request.prefilled)
        self.resumed: list = []  # its drafters started from a stored prefix at admission (``resume_drafters``)

    @property
    def id(self) -> str:
        return self.handle.id

    def token_event(self) -> TokenEvent:
        """The event of the tokens the request committed since its last event (none after an EOS)."""
        new = self.request.new_ids[self.sent:]
        scores = self.request.token_logprobs
        scores = scores[self.sent: self.sent + len(new)] if scores is not None else None
        prompt = self.request.prompt_token_logprobs if self.sent == 0 and new else None
        self.sent += len(new)
        if self.first_token_at is None and new:
            self.first_token_at = time.perf_counter()
        return TokenEvent(list(new), self.text.add(), logprobs=scores, prompt_logprobs=prompt)

    def first_token(self, logits: torch.Tensor, choice: torch.Tensor | None = None,
                    read: list[int] | None = None) -> bool:
        """Its first token, drawn from the prefill's logits after the prompt (``Request.first_token``; ``choice`` /
        ``read``: their greedy choice on the device and as read), sent at once; whether the request ended with it."""
        _, done = self.request.first_token(logits, choice, read)
        self.handle._push(self.token_event())
        return done

    def step_record(self) -> RequestStepRecord:
        """Its part of the last scheduler step."""
        s = self.request.last_step
        return RequestStepRecord(self.id, s.drafter, s.drafted, s.accepted, s.accepted_per_position, s.committed)

    def end(self, reason: str, error: BaseException | None) -> tuple[str, BaseException | None]:
        """The request ends (its row already freed): its episode closes (unless it failed) and its drafters end.
        Returns (reason, error), an error at its end turning it into a failure."""
        if self.begun and error is None:
            try:
                self.request._finish()
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed at its end", self.id)
                reason, error = "error", e
        if self.begun or self.resumed:  # (a request that left in its prefill: the drafters that hold a stored prefix)
            for d in self.request.all_drafters if self.begun else self.resumed:
                try:
                    d.end()
                except Exception:  # noqa: BLE001
                    log.exception("drafter %s failed at the end of request %s", d.name, self.id)
        return reason, error

    def last_event(self, reason: str, error: BaseException | None) -> tuple[TokenEvent, RequestFinished]:
        """Its last event (the rest of its text, its result or error) and the record listeners get."""
        request, result = self.request, None
        if error is None:
            if reason == "cancelled":
                request.stats.stop_reason = "cancelled"
                request.stats.new_tokens = len(request.new_ids)
            result = request.result()
        final_text = self.text.finish(result.text) if result is not None else ""
        now = time.perf_counter()
        sub = self.handle.submitted_at
        record = RequestFinished(
            self.id, reason, len(request.prompt_ids), len(request.new_ids),
            None if self.first_token_at is None else self.first_token_at - sub, now - sub,
            (self.started_at or now) - sub, request.stats.to_record() if self.started_at is not None else {}, error)
        return TokenEvent([], final_text, True, reason, result, error), record


class Forks:
    """A set of forks of the engine's pool (``Drafter.fork``) that one running request drafts with."""

    def __init__(self, arms, cross_request: bool):
        memo: dict = {}
        self.arms = [a.fork(cross_request, memo) for a in arms]
        self.all = with_components(self.arms)

    def bind(self, request: Request, options: RequestOptions, names: list[str]) -> None:
        if not options.speculate:
            request.drafters, request.all_drafters = [], []
        elif options.drafter is not None:
            arm = self.arms[names.index(options.drafter)]
            request.drafters, request.all_drafters = [arm], with_components([arm])
        else:
            request.drafters, request.all_drafters = self.arms, self.all


def prefix_cache_for(engine, verifier) -> PrefixCache:
    """A prefix cache over the scheduler's batched verifier (on llama.cpp, entries in its context's sequences:
    ``keep_prefixes``); ``ValueError`` for a pool whose drafters read the verifier's hidden states (the entries keep
    keys and values only)."""
    if engine.hidden_layers:
        raise ValueError(f"prefix_caching: the pool's drafters read the verifier's hidden states (layers "
                         f"{list(engine.hidden_layers)}), which the prefix cache does not keep")
    if hasattr(verifier, "keep_prefixes"):
        return verifier.keep_prefixes()
    return PrefixCache(verifier.cache)


def batch_verifier_for(engine, max_batch: int, kv_budget: int | None):
    """The scheduler's batched verifier over ``engine.verifier``: a ``BatchVerifier`` whose KV budget is ``kv_budget``
    positions of the verifier's cache (None: a share of the free memory), the drafters' caches charged to it; on the
    llama.cpp backend a ``LlamaCppBatchVerifier`` over its context's cells."""
    verifier = engine.verifier
    if getattr(verifier, "backend", "torch") == "llama.cpp":
        return LlamaCppBatchVerifier(verifier, max_batch, engine.hidden_layers, kv_budget=kv_budget)
    per_token = KVGeometry.of(verifier.model).bytes_per_token
    budget = kv_budget * per_token if kv_budget is not None else default_budget_bytes(verifier.device)
    # model drafters at fixed shapes keep their requests' caches as rows shaped like the verifier's (draft_rows.py):
    # charged as densely; the others per reserved position
    rows = draft_rows_of(engine.all_drafters)
    batch = BatchVerifier(verifier, max_batch, engine.hidden_layers, budget_bytes=budget,
                          extra_bytes_per_token=drafter_kv_bytes(engine.all_drafters),
                          dense_extra_bytes_per_token=sum(r.geometry.bytes_per_token for r in rows))
    batch.cache.followers = rows
    for r in rows:  # the rows' buffers from now on as the budget counts them (none until a request is admitted)
        r.follow(batch.cache.rows, batch.cache.capacity)
    return batch


def send_first_tokens(joined: list[tuple[Job, torch.Tensor]]) -> list[tuple[Job, BaseException | None]]:
    """The first token of each request whose prefill ended in this step, from its prefill's logits ([1, vocab]), sent
    at once; their greedy choices are read from the device together (one host read for all of them, as a step's).
    Returns the requests that ended there, each with the error it failed with (None: its first token ended it)."""
    if not joined:
        return []
    choices = torch.cat([logits.argmax(-1) for _, logits in joined])  # [J] on the device
    ended = []
    for (job, logits), choice, token in zip(joined, choices, choices.tolist()):
        try:
            if job.first_token(logits, choice[None], [token]):
                ended.append((job, None))
        except Exception as e:  # noqa: BLE001 - it alone fails
            log.exception("request %s failed at its first token", job.id)
            ended.append((job, e))
    return ended


def start_prefill(job: Job, engine, verifier, prefix_cache: PrefixCache | None) -> None:
    """The request's prefill (made by ``verifier``, the scheduler's batched verifier), starting after the longest
    prefix of its prompt the prefix cache holds (not for a request that asked for its prompt's log-probabilities: the
    prefill computes them), and its model drafters from their own positions of that prefix (``resume_drafters``); its
    stats count the prompt tokens reused (``cached_prompt_tokens``)."""
    ids, scoring = job.request.prefill_ids(verifier), job.request.prompt_scoring()
    prefix = None
    if prefix_cache is not None and not scoring:
        entry, n = prefix_cache.lookup(job.request.prompt_ids)
        prefix = (entry, n) if entry is not None else None
        job.request.stats.cached_prompt_tokens = n
    job.prefill = verifier.start_prefill(ids, engine.hidden_layers, prefix=prefix, **scoring)
    if prefix is not None and prefix[0].drafters:
        resume_drafters(job, prefix[0], prefix_cache)


def resume_drafters(job: Job, entry: PrefixEntry, prefix_cache: PrefixCache) -> None:
    """The request's model drafters start from the positions of theirs the entry keeps (``Drafter.resume``), so their
    first catch-up reads only what follows; where every one of them did, the request says so (``read_at_start``: an
    ``AdaptiveSpeculation`` prices only that catch-up). A drafter that fails to is logged and reads its prompt."""
    lengths, readers = [], [d for d in job.request.all_drafters if not d.lookup and not d.components()]
    for d in readers:
        start = prefix_cache.drafter_start(entry, d.name, job.request.prompt_ids)
        if start is None:
            continue
        try:
            d.resume(*start)
        except Exception:  # noqa: BLE001 - it loses its head start, not its request
            log.exception("request %s: drafter %s could not start from the stored prefix", job.id, d.name)
            d.end()
            continue
        job.resumed.append(d)
        lengths.append(start[1])
    if lengths and len(lengths) == len(readers):
        job.request.read_at_start = min(lengths)


def free_row(job: Job, verifier: BatchVerifier, prefix_cache: PrefixCache | None) -> int | None:
    """A started request's row leaves the batched cache; returns the row moved into its place (``BatchCache.remove``).
    With a prefix cache, its committed positions are stored first (``store_prefix``), beside the row still allocated:
    the entry can take the cache past its budget until the row is gone, so the memory is fitted right after (rows
    shrink, or stored entries give way) - every record and step the scheduler reports sees it within its budget."""
    if prefix_cache is not None:
        store_prefix(job, verifier.cache, prefix_cache)
    moved = verifier.remove(job.slot.row)
    if prefix_cache is not None:
        fit_prefixes(prefix_cache)
    return moved


def store_prefix(job: Job, cache: BatchCache, prefix_cache: PrefixCache) -> None:
    """Before a request's row is freed: its committed positions (prompt and answer, its pending token excepted) into
    the prefix cache, for a later request that continues them (the next turn of a chat)."""
    request, row = job.request, job.slot.row
    cache.release(job)  # its reservation first: the entry is held in its place
    sequence = request.prompt_ids + request.new_ids
    try:  # a failure here costs the entry (logged), never the request or the scheduler
        ids = sequence[: min(cache.lengths[row], len(sequence) - 1)]
        drafters = {d.name: kv for d in request.all_drafters if prefix_cache.drafters
                    and (kv := d.kv_prefix(ids)) is not None}
        prefix_cache.store(ids, row, drafters)
    except Exception:  # noqa: BLE001
        log.exception("request %s: storing its prefix failed", job.id)


def tidy_memory(cache: BatchCache, prefix_cache: PrefixCache | None) -> None:
    """After a scheduler pass: idle KV buffers shrink, stored prefixes fit what is left. A failure here is logged and
    costs the stored prefixes (dropped), never the scheduler: nothing a request needs is touched."""
    try:
        cache.shrink()
    except Exception:  # noqa: BLE001
        log.exception("shrinking the KV buffers failed; they keep their size until the next pass")
    if prefix_cache is not None:
        fit_prefixes(prefix_cache)


def fit_prefixes(prefix_cache: PrefixCache) -> None:
    """``PrefixCache.fit``; a failure is logged and drops the stored prefixes, never a request or the scheduler."""
    try:
        prefix_cache.fit()
    except Exception:  # noqa: BLE001
        log.exception("fitting the prefix cache failed; every stored prefix is dropped")
        prefix_cache.clear()


def drafter_kv_bytes(drafters) -> int:
    """What one request's forks of ``drafters`` cost in KV memory per cached position: each drafter with a model of
    its own keeps a cache of it per request (``KVGeometry.bytes_per_token``); lookups keep none."""
    total = 0
    for d in drafters:
        if getattr(d, "rows", None) is not None:  # its forks' caches are rows of a DraftRows: charged densely
            continue
        model = getattr(d, "model", None)
        if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
            total += KVGeometry.of(model).bytes_per_token
    return total


def check_options(options: RequestOptions, arm_names: list[str]) -> None:
    if not isinstance(options, RequestOptions):
        raise ValueError(f"options must be a RequestOptions, got {type(options).__name__}")
    if options.drafter is not None and options.drafter not in arm_names:
        raise ValueError(f"drafter: no drafter named {options.drafter!r} in the pool; drafters: {arm_names}")
    b = options.draft_budget
    if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
        raise ValueError(f"draft_budget must be an integer >= 0 or None, got {b!r}")


def policy_for(engine, options: RequestOptions):
    """The request's policy: none when it drafts with one named arm (or none); the engine's own when persistent;
    else a copy (reset when the request starts, as ``Engine.generate`` resets its policy)."""
    policy = engine.policy
    if policy is None or not options.speculate or options.drafter is not None:
        return None
    return policy if engine.persistent_policy else copy.deepcopy(policy)


#: the sampling keyword arguments ``Scheduler.submit`` passes on to ``Request`` (``chat``: the text is a chat turn)
SAMPLING = {"temperature", "top_p", "top_k", "min_p", "stop", "chat"}
#: what ``Scheduler.submit`` passes on to ``Request`` beside sampling (``Engine.generate``'s keyword arguments)
PROCESSING = {"logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "constraint", "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids", "allowed_token_ids",
              "include_stop_str_in_output", "bad_words", "skip_special_tokens"}


def new_request(engine, prompt: Prompt, max_new_tokens: int, options: RequestOptions, arm_names: list[str],
                cache: BatchCache, max_draft_nodes: int, *, seed: int | None, **sampling) -> tuple[Request, int]:
    """A submitted request checked and set up: its ``Request`` (policy, draft budget and cap set) and the KV positions
    its admission reserves. ``ValueError`` naming the field for a bad one, ``KVBudgetError`` (one) for a request the
    KV budget could never hold."""
    check_options(options, arm_names)
    unknown = sorted(set(sampling) - PROCESSING - SAMPLING)
    if unknown:
        raise TypeError(f"submit() got unexpected keyword arguments {unknown}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    try:
        request = Request(engine, prompt, max_new_tokens, seed=seed, policy=policy_for(engine, options), **sampling)
    except TypeError as e:  # a prompt of the wrong type
        raise ValueError(f"prompt: {e}") from None
    request.policy = policy_for(engine, options)  # None where the request drafts with one named arm (Request itself
    request.draft_budget = options.draft_budget  # falls back to the engine's policy when given None)
    request.max_draft_nodes = max_draft_nodes
    kv_tokens = len(request.prompt_ids) + max_new_tokens + draft_headroom(max_draft_nodes)
    try:
        cache.check_admissible(kv_tokens)
    except KVBudgetError as e:
        raise KVBudgetError(f"max_new_tokens: the prompt ({len(request.prompt_ids)} tokens), max_new_tokens="
                            f"{max_new_tokens} and up to {max_draft_nodes} draft tokens {e}; ask for fewer "
                            f"tokens") from None
    return request, kv_tokens
