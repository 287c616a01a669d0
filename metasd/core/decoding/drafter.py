"""The drafter interface: what the engine and the policies need from anything that proposes tokens.

Two calls per step, as in transformers' candidate generators: ``propose`` a draft from the committed
tokens, then ``observe`` what the verifier accepted. Concrete drafters live in ``metasd.drafters``.

A drafter holds its own per-request state (a KV cache, an index) and must bring it up to date with
``ctx.tokens`` inside ``propose``: tokens committed since it last drafted, including steps where another
drafter of the pool was chosen (catch-up), are fed there, and their cost is charged to this drafter.
"""
from __future__ import annotations

import abc
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import torch
from torch import nn

from ..constraints import ConstraintState
from ..execution.draft_batch import Drafting
from ..execution.hidden import HiddenStore
from ..execution.prefix_cache import KVPrefix
from ..execution.tree import Draft
from .acceptance import Acceptance, follow
from .params import Bool, Float, Int, PluginParams, check_params  # noqa: F401  (drafters import them here)
from .processing import PathProcessing
from .registry import registrar
from .sampling import KeyedNoise, SamplingParams


@dataclass
class StepContext:
    """Everything a drafter may read when it drafts."""

    tokens: torch.Tensor  # [T] int64, every committed token (prompt included); the last is the pending one
    prompt_len: int
    max_depth: int  # drafts deeper than this are cut (token budget and context length)
    sampling: SamplingParams
    generator: torch.Generator | None = None
    #: a seeded request's keyed noise (``KeyedNoise``): a drafter that samples the token at position t draws it as
    #: ``noise.choose(q, t)``, coupled to the verifier's own draw there (None: draw from ``generator``)
    noise: KeyedNoise | None = None
    hidden: HiddenStore | None = None  # verifier states at positions 0..T-2 for the layers drafters asked for
    step: int = 0
    request: dict[str, Any] = field(default_factory=dict)  # {"category": ..., "max_new_tokens": ...}
    #: most draft nodes that will be verified (a budget arm's budget: its draft is cut to ``draft.first(max_nodes)``);
    #: None: no bound. A drafter may honour it to draft less, but only so that its draft is still exactly the one it
    #: would have drafted without the bound, cut to its first ``max_nodes`` nodes (budget counterfactuals rely on it)
    max_nodes: int | None = None
    #: the request's processing of the verifier's rows - its grammar, allowed ids, bad words, min_tokens, bias and
    #: penalties - as committed (never change it): model drafters process their own rows along each draft path with
    #: it, all but the penalties (``DraftProcessing``), so that their drafts go where the processed verifier goes;
    #: None: nothing for them to process (no processing, or penalties alone)
    processing: PathProcessing | None = None
    #: draft with lookups alone (``Drafter.lookup``): a drafter that runs a model drafts nothing this step and reads
    #: the committed text when it next drafts (an allocator's choice while a model has a long prompt still to read)
    lookup_only: bool = False

    @property
    def grammar(self) -> ConstraintState | None:
        """A constrained request's committed grammar state (never change it); None: no grammar."""
        return None if self.processing is None else self.processing.grammar


@dataclass
class StepFeedback:
    """One step as the verifier decided it: the record a drafter learns from (``Drafter.observe``) and a
    reward scores (``metasd.core.decoding.rewards``)."""

    draft: Draft
    acceptance: Acceptance
    committed: list[int]  # tokens committed this step: the accepted draft tokens, then the bonus
    target_probs: torch.Tensor | None = None  # [n+1, vocab] processed verifier probabilities (sampling only)
    target_argmax: torch.Tensor | None = None  # [n+1] verifier argmax (greedy only)
    seconds: float = 0.0  # drafting (catch-up included) + verification wall time of the step
    cost: float = 0.0  # modeled cost of the same work, in verifier decode steps (metasd.core.pricing.cost)

    @property
    def n_accepted(self) -> int:
        return self.acceptance.n_accepted


@dataclass
class Counterfactual:
    """What a drafter that was not chosen would have earned in a step, computed from the verified text with no extra
    verifier forward (full-information feedback, docs/algorithms.md#full-information-feedback).

    n_accepted: draft tokens the verifier would have accepted (an expectation under sampling for a drafter with
        probabilities; a lower bound when ``censored``: the verified text ran out before its draft did).
    drafted / depth: nodes and depth of the draft it would have proposed.
    forwards: the forwards its drafting would have run, as (network, rows), priced from shapes by the engine;
        forwards it ran anyway to stay in step (``track``) are counted in the step's own cost instead.
    drafting_cost: drafting already priced, in verifier decode steps, added to ``forwards``' price (a budget arm
        scored from a sibling's draft of the same drafter: what that drafting cost, metered as it ran).
    """

    n_accepted: float
    drafted: int
    depth: int
    forwards: list[tuple[Any, int]] = field(default_factory=list)
    censored: bool = False
    drafting_cost: float = 0.0


def counterfactual_of(draft: Draft, feedback: "StepFeedback", forwards: list[tuple[Any, int]] | None = None
                      ) -> Counterfactual:
    """The counterfactual of a ``draft`` a drafter would have proposed: the nodes the committed tokens accept
    (``follow``: exact under greedy, a common-random-numbers sample under sampling)."""
    path, censored = follow(draft, feedback.committed)
    return Counterfactual(len(path), len(draft), draft.depth, list(forwards or []), censored)


def cross_tokenizer_types() -> list[str]:
    """The registered drafter types that can draft with a tokenizer of their own (``cross_tokenizer``), sorted."""
    return sorted(k for k, c in DRAFTERS.items() if c.cross_tokenizer)


class DrafterParams(PluginParams):
    """Base of a drafter type's ``Params``: the ``params`` mapping of a pool-config entry, checked (names, types,
    ranges, modes) when the pool file is read, before any model loads - and by the drafter's constructor with the
    same model (``check_params``), so Python callers get the same checks. Unknown names are refused.

    Declare each keyword of the drafter's ``__init__`` that a pool config may set, with the constructor's
    default and its allowed values (``Field(ge=1)``, ``Literal[...]``). Only the keys the user gave reach
    ``from_config`` (``model_dump(exclude_unset=True)``), so the constructor (or a checkpoint's defaults)
    still supplies every other value; constraints that need the loaded model (e.g. ``k`` <= the trained
    heads) stay in the constructor.
    """


class Drafter(abc.ABC):
    """Anything that proposes draft tokens for the verifier to check.

    Subclasses set ``kind`` (the type name used in pool configs) and implement ``propose``; ``Params`` (a
    ``DrafterParams`` subclass) lets pool files be checked before loading (without it only the parameter
    names are checked, against ``__init__``). ``name``
    identifies an instance inside a pool (two instances of one kind with different settings are two
    arms). ``hidden_layers`` lists the verifier layers (index into transformers' ``hidden_states``:
    0 = embeddings, i = output of layer i, num_layers = after the final norm) the drafter reads from
    ``ctx.hidden``; the verifier returns them from the verification forward it runs anyway.
    """

    kind: ClassVar[str] = ""
    #: whether a pool entry of this type gives ``model`` / ``checkpoint``: "required", "optional" or "never",
    #: checked when the pool file is read, before any model loads (None: not declared, not checked)
    model_field: ClassVar[str | None] = None
    checkpoint_field: ClassVar[str | None] = None
    #: the pool-config ``params`` model (see ``DrafterParams``); None: names checked against ``__init__``
    Params: ClassVar[type[DrafterParams] | None] = None
    #: a ``params`` key naming other entries of the pool this type drafts with (a fused drafter's ``arms``): each
    #: must be an earlier entry, checked when the pool file is read; ``BuildContext.pool`` hands them over
    refers_to: ClassVar[str | None] = None
    #: whether the type can draft in its model's own tokenizer and translate each draft into the verifier's ids
    #: (cross-tokenizer drafting; a pool entry's ``tokenizer: own``), checked when the pool file is read
    cross_tokenizer: ClassVar[bool] = False
    #: whether it drafts by looking up the committed text (suffix trees, n-grams): no model forward, nothing of note
    #: to catch up on - it drafts in ``StepContext.lookup_only`` steps
    lookup: ClassVar[bool] = False
    #: whether it reads the verifier's torch weights (its LM head, or runs the verifier itself): refused with a
    #: verifier on another backend (llama.cpp), which has none
    verifier_weights: ClassVar[bool] = False
    hidden_layers: tuple[int, ...] = ()
    tokenizer = None  # set by drafters with their own tokenizer, checked against the verifier's
    #: set by a drafter that drafts in ``tokenizer``'s ids and translates its drafts (cross-tokenizer drafting): the
    #: tokenizer whose ids its drafts are in, checked against the verifier's instead of ``tokenizer``
    target_tokenizer = None

    def __init__(self, name: str | None = None):
        self.name = name or self.kind or type(self).__name__

    def begin(self, ctx: StepContext) -> None:
        """A new request starts; drop per-request state. The prompt is fed lazily in ``propose``."""

    @abc.abstractmethod
    def propose(self, ctx: StepContext) -> Draft:
        """Draft continuations of ``ctx.tokens`` (depth <= ctx.max_depth). May return an empty draft."""

    def drafting(self, ctx: StepContext) -> Drafting:
        """``propose`` as a loop that yields the model forwards it needs (``Feed``) and gets their logits back, so
        that a scheduler runs the forwards of many requests' drafters in one (batched drafting,
        core/execution/draft_batch.py). Returns the draft. The default drafts at once, yielding nothing: a drafter
        whose forwards are worth sharing (the pretrained chain and tree drafters; the fused and budget arms around
        them) writes its propose as this loop and runs it with ``draft_batch.drive``. Callers take a drafter's loop
        through ``drafting_loop``, which honours a ``propose`` replaced after the loop was written."""
        return self.propose(ctx)
        yield  # noqa: unreachable - makes this a generator

    def observe(self, feedback: StepFeedback) -> None:
        """The verifier accepted ``feedback.acceptance.path``; adapt (draft length, caches) if useful."""

    def counterfactual(self, ctx: StepContext, feedback: StepFeedback) -> Counterfactual | None:
        """When another drafter drafted this step (``ctx``, verified as ``feedback``): what this one would have had
        accepted, if it can say so cheaply (a lookup drafter proposes again; a model drafter kept in step reads its own
        catch-up forward). None (the default): it learns only from the steps it drafts (bandit feedback)."""
        return None

    def end(self) -> None:
        """The request is over: free per-request memory."""

    def kv_prefix(self, tokens: Sequence[int]) -> KVPrefix | None:
        """At the end of a request: the positions of its cache that hold a prefix of ``tokens`` (the request's committed
        text), copied out for a later request that continues it - the scheduler's prefix cache keeps them beside the
        verifier's (docs/serving.md#prefix-caching). None (the default): nothing worth keeping (a lookup rebuilds its
        index in microseconds; a drafter whose cache cannot be reused so)."""
        return None

    def resume(self, prefix: KVPrefix, length: int) -> None:
        """Before ``begin``: start the next request with the first ``length`` positions of ``prefix`` (a ``kv_prefix``
        of an earlier request; its first ``length`` ids are the new request's) in the cache, instead of reading them
        again at its first catch-up. Only drafters whose ``kv_prefix`` returns one are asked."""
        raise NotImplementedError(f"{self.name}: drafter type {self.kind!r} keeps no KV prefix to resume from")

    def fork(self, cross_request: bool = False, memo: dict[int, "Drafter"] | None = None) -> "Drafter":
        """A drafter for another request running at the same time (a ``Scheduler`` gives each running request its own
        forks): the same settings, sharing this one's networks, tokenizers and read-only tensors, with per-request
        state of its own (fresh after ``begin``). The drafters it drafts with (``components``: a fused drafter's
        arms) are forked too, each once per ``memo`` - a pool forked with one memo keeps its sharing.

        cross_request: share the state meant to outlive a request (the suffix drafter's cross-request cache) with this
        drafter, so that every fork learns from and drafts from every request; False leaves it out of the fork.

        The default: a shallow copy whose attributes holding drafters are their forks, then ``_forked``. A drafter
        that keeps per-request state in a helper object it changes in place (rather than re-creates in ``begin``)
        copies that helper in ``_forked``."""
        memo = {} if memo is None else memo
        if id(self) in memo:
            return memo[id(self)]
        twin = copy.copy(self)
        memo[id(self)] = twin
        twin.__dict__.pop("_metasd_in_use", None)  # the lock of the original's requests (Engine.exclusive_use)
        for key, value in vars(self).items():
            if isinstance(value, Drafter):
                setattr(twin, key, value.fork(cross_request, memo))
            elif isinstance(value, (list, tuple)) and any(isinstance(v, Drafter) for v in value):
                setattr(twin, key, type(value)(v.fork(cross_request, memo) if isinstance(v, Drafter) else v
                                               for v in value))
            elif isinstance(value, dict) and any(isinstance(v, Drafter) for v in value.values()):
                setattr(twin, key, {k: v.fork(cross_request, memo) if isinstance(v, Drafter) else v
                                    for k, v in value.items()})
        twin._forked(cross_request)
        return twin

    def _forked(self, cross_request: bool) -> None:
        """Called on a fresh ``fork``: make the per-request helpers it shares with the original its own."""

    def components(self) -> list["Drafter"]:
        """Drafters this one drafts with (a fused drafter's arms): the engine starts, ends and locks each once, with
        the pool's own, and reads the verifier layers they ask for."""
        return []

    def longest_match(self, tokens: torch.Tensor) -> int | None:
        """A lookup drafter: the length of the longest suffix of ``tokens`` ([T] int64, host) it could continue from
        now, without drafting - a cheap per-step feature for contextual policies. None: not a lookup drafter."""
        return None

    def confidence(self) -> float | None:
        """A model drafter kept in step (``track``): its probability of its own next token at the pending position,
        from the forward it ran to stay in step - a per-step feature. None: nothing known without drafting."""
        return None

    def describe(self) -> dict[str, Any]:
        """Settings, for logging."""
        return {"kind": self.kind, "name": self.name}

    def modules(self) -> Iterable["torch.nn.Module"]:
        """The networks this drafter runs; the engine's cost model counts their linear forwards.

        Default: the ``nn.Module`` values among the drafter's attributes (through lists, dicts, inner
        drafters and helper objects that hold modules). Override when a network is reached another way.
        """
        return list(module_attributes(self))

    @classmethod
    def from_config(cls, name: str, params: dict[str, Any], build: "BuildContext") -> "Drafter":
        """Build from a pool-config entry. Drafters that load models or checkpoints override this and use
        ``build`` (the shared verifier, a model loader that shares weights between arms, the config's folder)."""
        if build.model is not None:
            raise ValueError(f"drafter type {cls.kind!r} takes no model")
        if build.checkpoint is not None:
            raise ValueError(f"drafter type {cls.kind!r} takes no checkpoint")
        build.refuse_quantize(name, cls.kind)
        build.own_tokenizer(name, cls)
        return cls(name=name, **params)


@dataclass
class BuildContext:
    """What a drafter may use to build itself from a pool config."""

    verifier: Any  # metasd.core.execution.verifier.Verifier
    model: str | None  # the entry's model reference
    checkpoint: str | None  # the entry's checkpoint path (resolved against the config's folder)
    #: callable(ref, quantize=None) -> (model, tokenizer), cached per (ref, dtype, quantize) so arms with the
    #: same settings share weights; quantize None means the entry's ``quantize``
    load_model: Any
    quantize: str = "none"  # the entry's weight-only quantization: "none", "int8" or "int4"
    tokenizer: str = "shared"  # the entry's tokenizer: "shared" (the verifier's) or "own" (cross-tokenizer drafting)
    #: the drafters built from the pool's earlier entries, by name (for a type with ``refers_to``)
    pool: dict[str, Any] = field(default_factory=dict)
    base_dir: Path | None = None  # the pool file's folder (None: a config built in code): relative paths in params

    def own_tokenizer(self, name: str, cls: type[Drafter]) -> bool:
        """Whether the entry drafts with its model's own tokenizer; an error for a type that cannot."""
        if self.tokenizer not in ("shared", "own"):
            raise ValueError(f"drafter {name!r}: tokenizer must be 'shared' or 'own', got {self.tokenizer!r}")
        if self.tokenizer == "own" and not cls.cross_tokenizer:
            raise ValueError(f"drafter {name!r}: drafter type {cls.kind!r} cannot draft with a tokenizer of its own "
                             f"(tokenizer: own); types that can: {cross_tokenizer_types()}")
        return self.tokenizer == "own"

    def refuse_quantize(self, name: str, kind: str) -> None:
        """For drafters with no weights of their own: a ``quantize`` other than "none" is an error."""
        if self.quantize != "none":
            raise ValueError(f"drafter {name!r} of type {kind!r} has no model weights to quantize "
                             f"(field 'quantize' is {self.quantize!r}; remove it)")


def _defined_at(cls: type, name: str) -> int:
    """Where in ``cls``'s method resolution order ``name`` is defined (0: by ``cls`` itself)."""
    return next((i for i, c in enumerate(cls.__mro__) if name in vars(c)), len(cls.__mro__))


def drafting_loop(drafter: Drafter, ctx: StepContext) -> Drafting:
    """The drafter's drafting loop (``Drafter.drafting``) - unless its ``propose`` was replaced over that loop (on the
    instance, or by a class or mixin that overrides ``propose`` and comes before ``drafting``'s in the method
    resolution order): then a loop that calls that ``propose`` at once, so that what ``propose`` does always runs."""
    cls = type(drafter)
    if "propose" in vars(drafter) or _defined_at(cls, "propose") < _defined_at(cls, "drafting"):
        return Drafter.drafting(drafter, ctx)
    return drafter.drafting(ctx)


def drafts_lookups(drafter: Drafter) -> bool:
    """Whether ``drafter`` or one of its components (recursively) is a lookup (``Drafter.lookup``): whether it can
    draft in a ``StepContext.lookup_only`` step."""
    return any(d.lookup for d in with_components([drafter]))


def with_components(drafters: Sequence[Drafter]) -> list[Drafter]:
    """``drafters`` and, recursively, their components, each once (by identity), in first-seen order."""
    seen: dict[int, Drafter] = {}

    def add(d: Drafter) -> None:
        if id(d) not in seen:
            seen[id(d)] = d
            for c in d.components():
                add(c)

    for d in drafters:
        add(d)
    return list(seen.values())


DRAFTERS: dict[str, type[Drafter]] = {}
register_drafter = registrar(DRAFTERS, "kind", "Class decorator: make a drafter available by its ``kind`` in pool configs.")


def module_attributes(obj: Any, depth: int = 3) -> Iterator[nn.Module]:
    """``nn.Module`` values reachable from ``obj``'s attributes through modules' owners, lists, tuples and
    dicts (``depth`` levels), without walking into any other object (tokenizers, configs)."""
    def walk(value: Any, level: int) -> Iterator[nn.Module]:
        if isinstance(value, nn.Module):
            yield value
        elif level <= 0:
            return
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from walk(v, level - 1)
        elif isinstance(value, dict):
            for v in value.values():
                yield from walk(v, level - 1)
        elif isinstance(value, Drafter) or _owns_modules(value):
            for v in vars(value).values():
                yield from walk(v, level - 1)

    for v in vars(obj).values():
        yield from walk(v, depth)


def _owns_modules(value: Any) -> bool:
    """A plain helper object of a drafter holding modules directly (e.g. a steering component)."""
    d = getattr(value, "__dict__", None)
    return isinstance(d, dict) and any(isinstance(v, nn.Module) for v in d.values())
