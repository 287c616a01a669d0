"""Trace-replayed acceptance: a pool's real acceptance, recorded on one machine, replayed at real forward shapes on
another (a GPU that the real weights cannot reach). Recording (``record_arm``, greedy only): for every position ``p``
of the verifier's greedy continuation R of a prompt, the arm (any drafter: a chain, a tree, a lookup, a cascade)
drafts from ``prompt + R[:p]`` as it would in a step, unbounded (``max_nodes`` None, ``max_depth`` to R's end). Kept
per position, and nothing else (no token id):

- the draft's shape (``parents``) and which nodes lie on R (``on_path``: the node's path is R's next tokens);
- the model forwards it ran (``feeds``): the catch-up forward, then for each drafting forward its rows, each row the
  draft node it fed (-1: a node fed and not kept in the draft) and its parent row (-1: a child of the root).

Replay (``TraceDrafter``) runs on a verifier with other (random) weights whose own greedy continuation G of the
replayed prompt is known: a node on R's path becomes G's token at its depth, every other node a token that is not
(siblings distinct), so the verifier accepts exactly what the real verifier accepted from the real draft, commits G,
and every step commits as many tokens as the recorded pool's would at that position. The drafter's forwards run
through a real drafter model (random weights, the real shape) at the recorded shapes: the catch-up forward over the
committed tokens the drafter's cache lacks (counted live, as the real drafter counts them), then each drafting
forward's rows with the tree's ancestor mask; after the step the accepted nodes that were fed stay in the cache
(the real chain and tree drafters keep them too). So whatever arm, budget or load a live policy chooses, acceptance
is the recorded pool's and the cost is the device's.

What it leaves out, and says where it appears: a budget (``ctx.max_nodes``) or a depth cut near a request's end cuts
the recorded draft (``Draft.first``, ``Draft.truncated``) and feeds only the rows of the nodes kept - the real tree
drafter may expand a few nodes more or fewer there; the drafting Python is this module's, not the real drafter's
(its host time differs); drafters whose draft depends on more than the text (``adaptive_k``, verifier hidden
states) are recorded as they draft from their first state, and those that read hidden states are refused."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from torch import nn

from metasd.core.decoding.drafter import BuildContext, Drafter, DrafterParams, StepContext, StepFeedback
from metasd.core.execution.draft_batch import Drafting, Feed, drive
from metasd.core.execution.kv_cache import cache_length, crop_to, keep_positions
from metasd.core.execution.draft_rows import DraftRows, give_back_row
from metasd.core.execution.graph_runner import resolve_graphs
from metasd.core.execution.static_cache import new_cache
from metasd.core.execution.tree import Draft, depths_of

FORMAT = 1


class TraceMiss(RuntimeError):
    """A replay asked for what the trace does not hold: another prompt, a position past its end, or a continuation
    shorter than a draft's depth."""


@dataclass
class TraceStep:
    """One position of one arm: its unbounded draft's shape, which nodes are on the verifier's path, and its
    forwards. feeds: ``{"catch_up": True}`` or ``{"model": i, "masked": bool, "rows": [[node, parent_row], ...]}``
    (rows numbered in feeding order over the step; node -1: fed, not kept in the draft)."""

    parents: list[int]
    on_path: list[bool]
    feeds: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"parents": self.parents, "on_path": "".join("1" if b else "0" for b in self.on_path),
                "feeds": self.feeds}

    @classmethod
    def from_json(cls, d: dict) -> "TraceStep":
        return cls(list(d["parents"]), [c == "1" for c in d["on_path"]], list(d["feeds"]))

    def accepted(self) -> int:
        """The depth the verifier accepts of this draft (its deepest node on the path)."""
        return max((d for d, on in zip(depths_of(self.parents), self.on_path) if on), default=0)


@dataclass
class PromptTrace:
    """One prompt: its length, the length of the continuation it was recorded over, each arm's steps (index =
    tokens generated before the step) and, for a replay, the replaying verifier's prompt ids and greedy continuation
    (``replay_on``)."""

    name: str
    prompt_len: int
    recorded_len: int
    arms: dict[str, list[TraceStep]]
    prompt_ids: list[int] | None = None
    continuation: list[int] | None = None

    def replay_on(self, prompt_ids: Sequence[int], continuation: Sequence[int]) -> None:
        if len(prompt_ids) != self.prompt_len:
            raise ValueError(f"trace {self.name!r}: replay prompt has {len(prompt_ids)} tokens, the recorded one "
                             f"{self.prompt_len}")
        self.prompt_ids, self.continuation = list(prompt_ids), list(continuation)


class Trace:
    """Prompt traces, saved as one JSON file (no token ids of the recorded text: shapes and acceptance only)."""

    def __init__(self, prompts: list[PromptTrace], meta: dict[str, Any] | None = None):
        self.prompts, self.meta = prompts, dict(meta or {})

    def save(self, path: str | Path) -> None:
        body = {"format": FORMAT, "meta": self.meta, "prompts": [
            {"name": p.name, "prompt_len": p.prompt_len, "recorded_len": p.recorded_len,
             "arms": {a: [s.to_json() for s in steps] for a, steps in p.arms.items()}} for p in self.prompts]}
        Path(path).write_text(json.dumps(body, separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        body = json.loads(Path(path).read_text())
        if body.get("format") != FORMAT:
            raise ValueError(f"{path}: trace format {body.get('format')!r}, this metasd reads {FORMAT}")
        return cls([PromptTrace(p["name"], p["prompt_len"], p["recorded_len"],
                                {a: [TraceStep.from_json(s) for s in steps] for a, steps in p["arms"].items()})
                    for p in body["prompts"]], body.get("meta"))

    def arms(self) -> set[str]:  # the arms recorded, over every prompt
        return {a for p in self.prompts for a in p.arms}

    def models_of(self, arm: str) -> set[int]:
        """The models ``arm``'s recorded forwards ran (indices; none for a lookup arm)."""
        return {f["model"] for p in self.prompts for s in p.arms.get(arm, []) for f in s.feeds}

    def save_replay(self, path: str | Path) -> None:
        """The prompts replayed on and their continuations (``replay_on``), for a pool entry's ``replay``."""
        body = {"format": FORMAT, "prompts": [{"name": p.name, "prompt_ids": p.prompt_ids,
                                               "continuation": p.continuation} for p in self.prompts
                                              if p.prompt_ids is not None]}
        Path(path).write_text(json.dumps(body, separators=(",", ":")))

    def load_replay(self, path: str | Path) -> None:
        """``replay_on`` every prompt a ``save_replay`` file names; a name the trace lacks is an error."""
        body, by_name = json.loads(Path(path).read_text()), {p.name: p for p in self.prompts}
        if body.get("format") != FORMAT:
            raise ValueError(f"{path}: replay format {body.get('format')!r}, this metasd reads {FORMAT}")
        for r in body["prompts"]:
            if r["name"] not in by_name:
                raise ValueError(f"{path}: prompt {r['name']!r} is not in the trace (it has {sorted(by_name)})")
            by_name[r["name"]].replay_on(r["prompt_ids"], r["continuation"])

    def for_prompt(self, prompt_ids: Sequence[int]) -> PromptTrace:
        """The trace replayed on ``prompt_ids`` (``PromptTrace.replay_on``)."""
        ids = list(prompt_ids)
        if (found := next((p for p in self.prompts if p.prompt_ids == ids), None)) is not None:
            return found
        raise TraceMiss(f"no trace is replayed on this prompt ({len(ids)} tokens): call replay_on first")


# ---------------------------------------------------------------- recording
# ---------------------------------------------------------------- replay
class TraceParams(DrafterParams):
    """A pool entry of ``type: metasd.drafters.trace:TraceDrafter`` (paths relative to the pool file's folder)."""

    trace: str  # the recorded trace (``Trace.save``)
    replay: str  # the prompts it is replayed on and the replaying verifier's continuations (``Trace.save_replay``)
    arm: str | None = None  # the recorded arm; default: the entry's name
    #: the forks' drafting levels at fixed shapes, as the real drafter's (core/execution/draft_rows.py): captured
    #: where the model is on CUDA (auto), eager at those shapes (fixed)
    graphs: Literal["auto", "on", "off", "fixed"] = "auto"


class TraceDrafter(Drafter):
    """Replays one arm of a ``Trace``: its recorded drafts relabelled onto the replaying verifier's continuation, its
    recorded forwards run through ``models`` (one per model the arm drafted with; none for a lookup arm) at their real
    shapes. Greedy requests only. Built in code (``benchmarks/trace_replay.py``) or from a pool entry
    (``from_config``: ``model`` the drafter model, random weights of the real shape; ``params`` ``TraceParams``), e.g.
    to serve trace-replayed acceptance through ``metasd serve``: a request whose prompt ids the replay file does not
    hold is refused (``TraceMiss``), never drafted for otherwise."""

    kind = "trace"
    model_field, checkpoint_field, Params = "optional", "never", TraceParams

    def __init__(self, trace: Trace, arm: str, models: Sequence[nn.Module] = (), vocab: int | None = None,
                 name: str | None = None, lookup: bool | None = None, graphs: str = "auto", fixed_shapes: bool = False):
        super().__init__(name or arm)
        self.trace, self.arm, self.models = trace, arm, list(models)
        capture = any([resolve_graphs(graphs, m.device, self.name) for m in self.models])
        #: each model's rows for the forks' caches where shapes are fixed (``graphs``), as the real drafter's forks
        self.rows = [DraftRows(m, capture=capture, name=self.name) for m in self.models] \
            if capture or fixed_shapes or graphs == "fixed" else None
        self.vocab = vocab or (int(self.models[0].config.vocab_size) if self.models else None)
        if self.vocab is None:
            raise ValueError(f"{self.name}: give the verifier's vocab size (a lookup arm has no model to read it from)")
        self.lookup = (not self.models) if lookup is None else lookup
        #: per request (``begin`` .. ``end``): its ``PromptTrace``, each model's cache and the committed tokens in it,
        #: the last draft, its base (committed length) and node -> (model, slot - base) of the nodes fed
        self.end()

    @classmethod
    def from_config(cls, name: str, params: dict[str, Any], build: BuildContext) -> "TraceDrafter":
        def path(key: str) -> Path:
            p = Path(build.base_dir or "", params[key])  # relative to the pool file's folder; absolute as given
            if not p.is_file():
                raise ValueError(f"params.{key}: no file {str(p)!r}")
            return p
        trace, arm = Trace.load(path("trace")), params.get("arm") or name
        trace.load_replay(path("replay"))
        if arm not in trace.arms():
            raise ValueError(f"params.arm: the trace has no arm {arm!r} (it has {sorted(trace.arms())})")
        if len(used := trace.models_of(arm)) != (build.model is not None):
            raise ValueError(f"model: arm {arm!r} drafted with {len(used)} model(s), the entry gives "
                             f"{int(build.model is not None)} (a model arm: one, the drafter's shape; a lookup: none)")
        if build.model is None:
            build.refuse_quantize(name, cls.kind)
        models = [build.load_model(build.model)[0]] if build.model is not None else []
        vocab = int(build.verifier.model.get_input_embeddings().weight.shape[0])
        return cls(trace, arm, models, vocab=vocab, name=name, lookup=not used, graphs=params.get("graphs", "auto"))

    def begin(self, ctx: StepContext) -> None:
        self.end()  # a row still held goes back
        self._prompt = self.trace.for_prompt(ctx.tokens[: ctx.prompt_len].tolist())
        if self.arm not in self._prompt.arms:
            raise TraceMiss(f"{self.name}: trace {self._prompt.name!r} has no arm {self.arm!r} "
                            f"(it has {sorted(self._prompt.arms)})")
        self._caches = self._fresh_caches()
        self._cached = [0] * len(self.models)
        self._pending = None

    def _fresh_caches(self) -> list:
        """Each model's cache for a new request: a row of its ``DraftRows`` where shapes are fixed."""
        if self.rows is not None:
            return [rows.take() for rows in self.rows]
        return [new_cache(m, name=self.name) for m in self.models]

    def end(self) -> None:
        for cache in getattr(self, "_caches", []):
            give_back_row(cache)
        self._caches, self._cached, self._pending, self._prompt = [], [], None, None

    def _forked(self, cross_request: bool) -> None:  # a fork holds no request until its begin
        self.end()

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> Draft:
        return drive(self.drafting(ctx))

    def drafting(self, ctx: StepContext) -> Drafting:
        if not ctx.sampling.greedy:
            raise ValueError(f"{self.name}: a trace replays greedy requests only")
        with torch.inference_mode():
            return (yield from self._replay(ctx))

    def _replay(self, ctx: StepContext) -> Drafting:
        if (prompt := self._prompt) is None:
            raise TraceMiss(f"{self.name}: propose before begin")
        p, steps = len(ctx.tokens) - ctx.prompt_len, prompt.arms[self.arm]
        if p >= len(steps):
            raise TraceMiss(f"{self.name}: trace {prompt.name!r} holds {len(steps)} positions, the request is at {p}")
        step = steps[p]
        if ctx.max_depth <= 0 or ctx.max_nodes == 0:
            return Draft.empty()
        depths = depths_of(step.parents)
        keep = [i for i, d in enumerate(depths) if d <= ctx.max_depth][: ctx.max_nodes]
        cut = len(keep) < len(depths)
        index = {old: new for new, old in enumerate(keep)}  # recorded node -> node of the draft
        draft = self._relabelled(step, p, keep, index, depths)

        def fed_as(node: int) -> int | None:
            """The draft node a recorded row feeds (-1: a node the draft did not keep); None: the cut drops the row
            (a cut step feeds only kept nodes with children to draft within the depth left)."""
            if not cut:
                return node
            return index[node] if node in index and depths[node] < ctx.max_depth else None

        base, slots = len(ctx.tokens), {}
        catch_up = yield from self._run_feeds(step, ctx.tokens.tolist(), fed_as, draft, base, slots)
        self._pending = (draft, base, slots)
        draft.catch_up = catch_up
        return draft

    def _run_feeds(self, step: TraceStep, tokens: list[int], fed_as, draft: Draft, base: int,
                   slots: dict[int, tuple[int, int]]) -> Drafting:
        """The step's recorded forwards, run at their shapes (the kept draft's rows only); ``slots`` gets each fed
        draft node's (model, cache slot - base). Returns the catch-up's tokens beyond the pending one."""
        catch_up = 0
        seen = [0] * len(self.models)  # recorded rows met per model (numbered as recorded, cut rows included)
        fed = [0] * len(self.models)  # rows fed per model this step (the cache slots after base)
        parent_of: dict[tuple[int, int], int] = {}
        slot_of: dict[tuple[int, int], int] = {}  # (model, recorded row) -> slot - base, for the rows fed
        for f in step.feeds:
            m = f["model"]
            if f.get("catch_up"):
                catch_up = max(catch_up, (yield from self._catch_up(m, tokens)))
                continue
            rows = []
            for node, parent in f["rows"]:
                row, seen[m] = seen[m], seen[m] + 1
                parent_of[(m, row)] = parent
                node = fed_as(node)
                if node is not None and (parent < 0 or (m, parent) in slot_of):
                    slot_of[(m, row)] = fed[m] + len(rows)
                    rows.append((row, node))
            if not rows:
                continue
            fed[m] += len(rows)
            yield self._feed(m, f["masked"], rows, parent_of, slot_of, draft, base, slots)
        return catch_up

    def _catch_up(self, m: int, tokens: list[int]) -> Drafting:
        """The committed tokens model ``m``'s cache lacks (the pending one at least), fed as the real drafters do;
        returns how many beyond the pending one."""
        cache = self._caches[m]
        keep = min(self._cached[m], len(tokens) - 1, cache_length(cache))
        crop_to(cache, keep)
        ids = tokens[keep:]
        yield Feed(self.models[m], None, cache, ids, last_only=True)
        self._cached[m] = len(tokens)
        return len(ids) - 1

    def _feed(self, m: int, masked: bool, rows: list[tuple[int, int]], parent_of: dict, slot_of: dict,
              draft: Draft, base: int, slots: dict[int, tuple[int, int]]) -> Feed:
        """One drafting forward of model ``m`` over ``rows`` ([(recorded row, node)]): the ancestor mask over the
        committed positions and the fed ancestors' slots, positions committed length - 1 + depth."""
        cache = self._caches[m]
        ids = [int(draft.tokens[node]) if node >= 0 else 0 for _, node in rows]
        for row, node in rows:
            if node >= 0:
                slots[node] = (m, slot_of[(m, row)])
        if not masked:  # a chain: causal over the cache, which holds its ancestors in order
            return Feed(self.models[m], None, cache, ids)
        L, q = cache_length(cache), len(rows)
        mask = torch.zeros(q, L + q, dtype=torch.bool)  # [q, L + q], True = attend
        mask[:, :base] = True
        positions = []
        for j, (row, _) in enumerate(rows):
            depth, anc = 1, parent_of[(m, row)]
            while anc >= 0:
                mask[j, base + slot_of[(m, anc)]] = True
                depth, anc = depth + 1, parent_of[(m, anc)]
            mask[j, L + j] = True
            positions.append(base - 1 + depth)
        return Feed(self.models[m], None, cache, ids, mask=mask, positions=torch.tensor(positions))

    def _relabelled(self, step: TraceStep, p: int, keep: list[int], index: dict[int, int], depths: list[int]
                    ) -> Draft:
        """Recorded nodes ``keep`` in the replaying verifier's tokens: on-path nodes G's token at their depth, the
        others a token that is not (distinct among siblings)."""
        G = self._prompt.continuation
        if G is None:
            raise TraceMiss(f"{self.name}: trace {self._prompt.name!r} has no replay continuation (replay_on)")
        tokens, parents, off = [], [], {}
        for i in keep:
            at, parent = p + depths[i] - 1, step.parents[i]
            if at >= len(G):
                raise TraceMiss(f"{self.name}: trace {self._prompt.name!r}: a draft {depths[i]} deep at position {p} "
                                f"needs {at + 1} continuation tokens, the replay has {len(G)}")
            if step.on_path[i]:
                tokens.append(G[at])
            else:
                k = off[parent] = off.get(parent, 0) + 1
                tokens.append((G[at] + k) % self.vocab)
            parents.append(index[parent] if parent >= 0 else -1)
        return Draft(tokens, parents, meta={"trace": self.arm})

    def observe(self, feedback: StepFeedback) -> None:
        """Keep the accepted nodes that were fed, after the committed tokens (as the chain and tree drafters do)."""
        pending, self._pending = self._pending, None
        if pending is None or not self.models:
            return
        draft, base, slots = pending
        for m, cache in enumerate(self._caches):
            if cache_length(cache) <= base or feedback.draft is not draft:
                crop_to(cache, min(self._cached[m], cache_length(cache)))
                continue
            keep: list[int] = []
            for node in feedback.acceptance.path:
                at = slots.get(node)
                if at is None or at[0] != m:
                    break
                keep.append(at[1])
            keep_positions(cache, base, torch.tensor(keep, dtype=torch.long))
            self._cached[m] = base + len(keep)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "arm": self.arm, "models": len(self.models)}
