"""Draft trees from a pretrained drafter: dynamic (EAGLE-2-style) trees and RSD trees.

The tree grows level by level with ONE batched drafter forward per level over the nodes it expands
(its frontier). Those nodes are appended to the drafter's own KV cache with an ancestor-only 4-D
attention mask and position id = committed length - 1 + depth (the same layout the verifier uses), so
each node's logits equal those of a plain forward over the committed tokens and its path.

Cache life cycle: after ``propose`` the cache holds the committed tokens followed by the expanded tree
nodes. ``observe`` gathers the accepted nodes that were expanded into place (``keep_positions``) and
drops the rest, so the cache holds exactly committed tokens; the inherited catch-up (longest common
prefix) then feeds what is missing (the bonus token, and the last accepted node when it was a leaf) at
the next ``propose``. A tree left unsettled (``observe`` not called) is cropped away at the next
``propose``.

Modes (docs/algorithms.md#pretrained-draft-trees; RSD = Jeon et al. 2024, arXiv 2402.14160):

- ``dynamic`` (EAGLE-2-style, any sampling mode): each node is scored by its cumulative draft
  log-probability. Level 1 = the ``width`` best children of the root; at each further level the
  ``frontier`` best nodes of the previous level are expanded (``width`` best children each); at the end
  the ``nodes`` best nodes overall are kept (ancestor-closed, since scores fall along a path), listed best
  first, so that a node budget (``Draft.first(n)``) keeps the n best. Expansion stops early once no frontier node
  can enter the final top-``nodes`` set; ``ctx.max_nodes`` (a budget arm's budget) bounds that set, so a smaller
  budget grows fewer nodes and drafts exactly the first ``max_nodes`` nodes of the unbounded draft. The draft carries no
  probabilities: greedy acceptance follows the argmax, sampling uses sample-and-match (exact for any
  tree). Scores use the raw drafter log-softmax under greedy and the processed q under sampling.
- ``rsd_c`` (RSD-C, sampling): constant branching factor per level (``branching[d]`` children for every
  expanded node of level d; levels beyond the list repeat its last entry), siblings drawn WITHOUT
  replacement from the processed drafter distribution q with the Gumbel-top-k trick, in the order of
  their perturbed values. When the ``nodes`` budget cannot give every node of a level its children, the
  most likely parents (cumulative draft log-probability) are expanded first.
- ``rsd_s`` (RSD-S, sampling): stochastic beam search (Kool et al. 2019): sequences without replacement.
  Every candidate extension of the beam gets a perturbed cumulative log-probability (a Gumbel conditioned
  on its parent's perturbed value being the maximum over its children); the ``width`` best candidates of
  a level form the next beam, so unlikely sequences are truncated early.

Exactness under sampling (both RSD modes): node i carries ``probs[i]`` = the processed q of its parent
and ``without_replacement=True``, and siblings appear in decreasing order of perturbed value, so
``accept_rejection`` (recursive rejection with q renormalised after each rejected sibling) is exact.
Why this holds for RSD-S too, where the number of children of a node is random: per parent, ordering
children by (conditional) perturbed value is the same as ordering by log q(x | parent) + an independent
Gumbel, i.e. an exponential race; in such a race the identity of the (j+1)-th arrival, given the first j
identities and all arrival times, is distributed as q with the first j removed and renormalised. Whether
a (j+1)-th child exists depends only on arrival times, earlier identities and other parents' draws, so
conditioned on it existing its token is still drawn from exactly the renormalised q that
``accept_rejection`` uses. No other per-sibling rule is needed.

Greedy (``ctx.sampling.greedy``): the RSD modes fall back to ``dynamic`` explicitly (sampling without
replacement makes no sense for argmax verification; the fallback is recorded as ``draft.meta["mode"]``).
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Sequence

import torch
from pydantic import Field, model_validator
from transformers import PreTrainedModel

from metasd.core.decoding.drafter import (Bool, Counterfactual, DrafterParams, Float, Int, StepContext, StepFeedback,
                                          check_params, register_drafter)
from metasd.core.decoding.processing import DraftProcessing
from metasd.core.execution.kv_cache import cache_length, crop_to, keep_positions
from metasd.core.decoding.sampling import process_logits
from metasd.core.execution.draft_batch import Drafting, Feed, drive
from metasd.core.execution.tree import Draft

from .growing_tree import GrowingTree, conditional_gumbel, gumbel_top_k, noise_dtype, read_topk
from .pretrained import HEAD_VOCAB_HELP, TRACK_HELP, PretrainedDrafter
from .tracking import tree_acceptance

TREE_GRAPHS_HELP = ("a scheduler's drafting levels run as one fixed-shape forward for the batch "
                    "(core/execution/draft_rows.py): auto = captured as CUDA graphs where the model is on CUDA, on = "
                    "required (refused elsewhere), off = eager forwards, fixed = the fixed shapes run eagerly (the "
                    "path a GPU captures, on any device); one request alone runs its levels at those shapes too")

MODES = ("dynamic", "rsd_c", "rsd_s")


class PretrainedTreeParams(DrafterParams):
    """Pool-config ``params`` of the pretrained tree drafter (and, extended, of the steered tree drafter)."""

    mode: Literal["dynamic", "rsd_c", "rsd_s"] = "dynamic"
    nodes: Int = Field(16, ge=1, description="maximum draft nodes per step")
    depth: Int = Field(6, ge=1, description="maximum tree depth")
    width: Int = Field(4, ge=1, description="dynamic: children per expanded node; rsd_s: beam width")
    frontier: Int | None = Field(None, ge=1, description="dynamic: nodes expanded per level (default: width)")
    min_path_prob: Float = Field(0.0, ge=0.0, lt=1.0, description="dynamic: expand only nodes at least this likely")
    branching: list[Annotated[Int, Field(ge=1)]] | None = Field(
        None, min_length=1, description="rsd_c: children per expanded node at each level (default [3, 2, 1, 1])")
    head_vocab: Int | None = Field(None, ge=2, description=HEAD_VOCAB_HELP)
    track: Bool = Field(False, description=TRACK_HELP)
    graphs: Literal["auto", "on", "off", "fixed"] = Field("auto", description=TREE_GRAPHS_HELP)

    @model_validator(mode="after")
    def _mode_fields(self) -> "PretrainedTreeParams":
        if self.min_path_prob and self.mode != "dynamic":
            raise ValueError(f"min_path_prob is only used by mode 'dynamic' (mode is {self.mode!r})")
        if self.branching is not None and self.mode != "rsd_c":
            raise ValueError(f"branching is only used by mode 'rsd_c' (mode is {self.mode!r}); use width")
        return self


@register_drafter
class PretrainedTreeDrafter(PretrainedDrafter):
    """A small pretrained LM drafting a token tree per step (see the module docstring for the modes).

    mode: "dynamic" (default), "rsd_c" or "rsd_s".
    nodes: maximum draft nodes per step (all modes).
    depth: maximum tree depth (all modes; also capped by ``ctx.max_depth``).
    width: dynamic: children per expanded node; rsd_s: beam width.
    frontier: dynamic: nodes expanded per level (default: ``width``).
    min_path_prob: dynamic: expand only nodes whose path probability (the product of the draft
        probabilities from the root, ``exp(score)``) is at least this; 0 (default) expands by rank alone.
        The tree analogue of a chain's confidence stop: on text the drafter is unsure of, growth stops
        after one or two levels instead of spending ``depth`` drafter forwards on nodes that will be
        rejected. Such nodes are still drafted as leaves.
    branching: rsd_c: children per expanded node at each level, e.g. [3, 2, 1, 1]; the last entry repeats
        for deeper levels (default [3, 2, 1, 1]). Only valid with mode "rsd_c".
    graphs: a scheduler's forks draft each level for the whole batch as one fixed-shape forward over one set of
        buffers (``DraftRows``), a CUDA graph per shape where the model is on CUDA ("auto"); ``fixed_shapes`` runs
        those shapes eagerly (the CPU check). One request alone runs its levels at those shapes too (one row).
    """

    kind = "pretrained_tree"
    draft_loops = False  # its tree grows where the scores it reads say: not a fixed shape
    Params = PretrainedTreeParams
    cross_tokenizer = False  # keeps accepted nodes in its cache by id (docs/algorithms.md#cross-tokenizer-drafting)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer=None,
        mode: str = "dynamic",
        nodes: int = 16,
        depth: int = 6,
        width: int = 4,
        frontier: int | None = None,
        min_path_prob: float = 0.0,
        branching: Sequence[int] | None = None,
        head_vocab: int | None = None,
        track: bool = False,
        name: str | None = None,
        model_ref: str | None = None,
        graphs: str = "auto",
        fixed_shapes: bool | None = None,
    ):
        super().__init__(model, tokenizer, k=1, head_vocab=head_vocab, track=track, name=name, model_ref=model_ref,
                         graphs=graphs, fixed_shapes=fixed_shapes)
        check_params(PretrainedTreeParams, dict(mode=mode, nodes=nodes, depth=depth, width=width, frontier=frontier,
                                                min_path_prob=min_path_prob, head_vocab=head_vocab, track=track,
                                                branching=None if branching is None else list(branching),
                                                graphs=graphs), self.name)
        frontier = width if frontier is None else frontier
        branching = [3, 2, 1, 1] if branching is None else list(branching)
        self.mode = mode
        self.nodes, self.depth, self.width, self.frontier = nodes, depth, width, frontier
        self.min_log_path_prob = math.log(min_path_prob) if min_path_prob > 0 else float("-inf")
        self.min_path_prob = float(min_path_prob)
        self.branching = branching
        self._pending: tuple[Draft, GrowingTree, list[int]] | None = None
        self._guide: DraftProcessing | None = None  # the request's processing along the draft being grown

    # ---------------------------------------------------------------- request life cycle
    def begin(self, ctx: StepContext) -> None:
        super().begin(ctx)
        self._pending = None

    def end(self) -> None:
        super().end()
        self._pending = None

    def _settle(self) -> None:
        """Drop tree nodes left in the cache by a propose that was never observed."""
        if self.cache is not None and cache_length(self.cache) > len(self.cached_ids):
            crop_to(self.cache, len(self.cached_ids))
        self._pending = None

    # ---------------------------------------------------------------- drafting
    def make_draft(self, ctx: StepContext) -> Drafting:
        depth = min(self.depth, ctx.max_depth)
        if depth <= 0 or ctx.max_nodes == 0:
            return Draft.empty()
        self._settle()
        tokens = ctx.tokens.tolist()
        root_logits = yield from self._sync_steps(tokens)
        mode = "dynamic" if ctx.sampling.greedy else self.mode
        tree = GrowingTree(base=len(tokens))
        # a request with processing (a grammar, bans, a bias): every node's logits processed after its path
        self._guide = DraftProcessing(ctx.processing) if ctx.processing is not None and self.bridge is None else None
        if mode == "dynamic":
            keep, probs = (yield from self._grow_dynamic(tree, root_logits, depth, ctx)), None
        else:
            grow = self._grow_rsd_c if mode == "rsd_c" else self._grow_rsd_s
            rows = yield from grow(tree, root_logits, depth, ctx)
            keep = list(range(len(tree)))
            probs = torch.stack(rows) if rows else None
        remap = {old: new for new, old in enumerate(keep)}
        parents = [remap[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in keep]
        draft = Draft([tree.tokens[i] for i in keep], parents, probs, without_replacement=mode != "dynamic",
                      meta={"mode": mode, "drafter_forwards": 1 + tree.forwards}, catch_up=self.last_catch_up)
        self._pending = (draft, tree, keep)
        return draft

    def _feed_steps(self, tree: GrowingTree, feed: list[int]) -> Drafting:
        """One drafter forward over tree nodes ``feed`` (a ``Feed`` the drafting loop yields); returns their
        next-token logits [len(feed), vocab]."""
        expected = tree.base + tree.n_fed
        if cache_length(self.cache) != expected:
            raise RuntimeError(f"{self.name}: drafter cache holds {cache_length(self.cache)} positions, expected {expected}")
        mask, positions = tree.inputs(feed)  # [1, 1, q, kv], [1, q]
        tokens = [tree.tokens[i] for i in feed]
        steer = self.steering.steer_tree(expected, tokens) if self.steering is not None else None
        logits = yield Feed(self.model, self.draft_head, self.cache, tokens, mask=mask[0, 0], positions=positions[0],
                            steer=steer)
        tree.mark_fed(feed)
        return logits

    def _feed(self, tree: GrowingTree, feed: list[int]) -> torch.Tensor:
        """``_feed_steps`` run alone."""
        return drive(self._feed_steps(tree, feed))

    def _add(self, tree: GrowingTree, token: int, parent: int) -> int:
        node = tree.add(token, parent)
        if self._guide is not None:
            self._guide.add(node, parent, token)
        return node

    def _expandable(self, nodes: list[int]) -> list[int]:
        """The nodes worth drafting below: all of them, or under a grammar those inside it and before an
        end-of-sequence token (``DraftProcessing.expandable``)."""
        return nodes if self._guide is None else [i for i in nodes if self._guide.expandable(i)]

    def _guided(self, logits: torch.Tensor, nodes: list[int]) -> torch.Tensor:
        """logits [len(nodes), vocab] after each node (-1: the root), processed as the request's verifier rows are
        where it has processing (``make_draft``)."""
        return logits if self._guide is None else self._guide.mask(nodes, logits)

    def _log_scores(self, logits: torch.Tensor, ctx: StepContext, tree: GrowingTree, parents: list[int]
                    ) -> torch.Tensor:
        """Log-probabilities used to rank dynamic-tree nodes (float32, -inf for excluded tokens): logits [len(parents),
        vocab] after each of ``parents`` (-1: the root). A seeded request (``ctx.noise``) ranks each parent's children by
        ``log q + G_t`` - the verifier's own keyed noise at their position t - renormalised: the first child of every
        node is then the token the verifier picks where q = p, so the tree holds the keyed chain the chain drafter
        drafts (sample-and-match accepts whatever matches; ``_keyed``)."""
        if ctx.sampling.greedy:
            return torch.log_softmax(logits.float(), dim=-1)
        logq = process_logits(logits, ctx.sampling).log()
        return torch.log_softmax(self._keyed(logq, ctx, tree, parents), dim=-1) if ctx.noise is not None else logq

    @staticmethod
    def _keyed(logq: torch.Tensor, ctx: StepContext, tree: GrowingTree, parents: list[int]) -> torch.Tensor:
        """logq [len(parents), vocab] perturbed by the keyed Gumbel noise of its children's positions (a child of a
        node at depth d is the request's token at position base + d)."""
        noise = torch.stack([ctx.noise.gumbel(tree.base + (tree.depths[p] if p >= 0 else 0), logq.shape[-1])
                             for p in parents]).to(logq.device)  # [len(parents), vocab]
        return logq.float() + noise

    def _grow_dynamic(self, tree: GrowingTree, root_logits: torch.Tensor, depth: int, ctx: StepContext) -> Drafting:
        """EAGLE-2-style expansion (a drafting loop); returns the kept node ids, best first (every prefix is
        ancestor-closed)."""
        scores: list[float] = []

        def add_children(parents: list[int], logp: torch.Tensor) -> Drafting:  # returns the new nodes
            vals, idx = yield from read_topk(logp, min(self.width, logp.shape[-1]))  # the level's one host read
            new = []
            for row, parent in enumerate(parents):
                base = scores[parent] if parent >= 0 else 0.0
                for v, t in zip(vals[row], idx[row]):
                    if v == float("-inf"):
                        break
                    new.append(self._add(tree, t, parent))
                    scores.append(base + v)
            return new

        def rank(ids):  # best first; ties: earlier node first (so a parent precedes its children)
            return sorted(ids, key=lambda i: (-scores[i], i))

        # ctx.max_nodes (a budget arm's budget): keep the best max_nodes instead of the best self.nodes. The draft
        # lists its nodes best first, so that is exactly the unbounded draft's first max_nodes nodes (the pruning
        # below never changes the top-``nodes`` set, only how many forwards grow it), at fewer forwards
        nodes = self.nodes if ctx.max_nodes is None else min(self.nodes, ctx.max_nodes)
        level = yield from add_children([-1], self._log_scores(self._guided(root_logits.reshape(1, -1), [-1]), ctx,
                                                               tree, [-1]))
        for _ in range(2, depth + 1):
            frontier = [i for i in self._expandable(rank(level))[: self.frontier]
                        if scores[i] >= self.min_log_path_prob]
            if len(scores) >= nodes:  # a child scores <= its parent and loses ties: prune hopeless parents
                threshold = scores[rank(range(len(scores)))[nodes - 1]]
                frontier = [i for i in frontier if scores[i] > threshold]
            if not frontier:
                break
            logits = self._guided((yield from self._feed_steps(tree, frontier)), frontier)
            level = yield from add_children(frontier, self._log_scores(logits, ctx, tree, frontier))
        # best first: a topological order too (a child scores <= its parent and loses ties to it), so that a node
        # budget (Draft.first(n)) keeps the n best nodes
        return rank(range(len(scores)))[:nodes]

    def _sample_siblings(self, q: torch.Tensor, k: int, ctx: StepContext, tree: GrowingTree, parent: int) -> list[int]:
        """k tokens drawn without replacement from q [vocab], in draw order: Gumbel-top-k with the request's generator,
        or for a seeded request with the verifier's keyed noise at the children's position (the first sibling is then
        its keyed draw, as the chain drafter's; sample-and-match verifies a seeded request's tree)."""
        if ctx.noise is not None:
            keys = self._keyed(q.log()[None], ctx, tree, [parent])[0]
            top = keys.topk(min(k, keys.shape[-1]))
            vals, idx = torch.stack([top.values, top.indices.to(keys.dtype)]).tolist()  # one host read
            return [int(i) for v, i in zip(vals, idx) if v != float("-inf")]
        return gumbel_top_k(q.log(), k, ctx.generator)

    def _grow_rsd_c(self, tree: GrowingTree, root_logits: torch.Tensor, depth: int, ctx: StepContext) -> Drafting:
        """RSD-C (a drafting loop): returns the probs row of every node (its parent's processed q)."""
        rows: list[torch.Tensor] = []
        logq: list[float] = []

        def add_children(parent: int, q: torch.Tensor, k: int) -> list[int]:
            drawn = self._sample_siblings(q, k, ctx, tree, parent)
            q_drawn = q[drawn].tolist() if drawn else []  # their probabilities: the group's second host read
            new = []
            for t, q_t in zip(drawn, q_drawn):
                new.append(self._add(tree, t, parent))
                rows.append(q)
                logq.append((logq[parent] if parent >= 0 else 0.0) + math.log(max(q_t, 1e-45)))
            return new

        q_root = process_logits(self._guided(root_logits.reshape(1, -1), [-1])[0], ctx.sampling)
        level = add_children(-1, q_root, min(self.branching[0], self.nodes))
        for d in range(1, depth):
            remaining = self.nodes - len(tree)
            if remaining <= 0 or not level:
                break
            b = self.branching[min(d, len(self.branching) - 1)]
            parents = sorted(self._expandable(level), key=lambda i: (-logq[i], i))[: -(-remaining // b)]
            if not parents:
                break
            q = process_logits(self._guided((yield from self._feed_steps(tree, parents)), parents), ctx.sampling)
            level = []
            for row, parent in enumerate(parents):
                k = min(b, self.nodes - len(tree))
                if k <= 0:
                    break
                level += add_children(parent, q[row], k)
        return rows

    def _beam_select(self, phi: torch.Tensor, value: torch.Tensor, logq: torch.Tensor, k: int,
                     generator: torch.Generator | None) -> list[tuple[int, int, float, float]]:
        """One stochastic-beam-search level.

        phi: [B] log-probability of each beam sequence; value: [B] its perturbed value; logq: [B, V]
        processed drafter log-probabilities of the next token. Returns up to k (beam row, token,
        phi of the extension, perturbed value of the extension), best first.
        """
        dtype = noise_dtype(logq.device)
        cand = phi.to(logq.device, dtype)[:, None] + logq.to(dtype)  # [B, V]
        gumbel = -torch.empty(cand.shape, dtype=dtype, device=cand.device).exponential_(generator=generator).log()
        perturbed = conditional_gumbel(value.to(cand.device, dtype)[:, None], cand + gumbel)
        top = perturbed.flatten().topk(min(k, perturbed.numel()))  # -inf entries (zero probability) sort last
        picked = torch.stack([top.indices.to(dtype), cand.flatten()[top.indices], top.values]).tolist()  # one read
        vocab = logq.shape[-1]
        return [(int(i) // vocab, int(i) % vocab, c, v) for i, c, v in zip(*picked) if v != float("-inf")]

    def _grow_rsd_s(self, tree: GrowingTree, root_logits: torch.Tensor, depth: int, ctx: StepContext) -> Drafting:
        """RSD-S (stochastic beam search; a drafting loop): returns the probs row of every node (its parent's
        processed q)."""
        rows: list[torch.Tensor] = []
        beam = [-1]
        phi = torch.zeros(1, dtype=torch.float64)
        value = torch.zeros(1, dtype=torch.float64)
        q = process_logits(self._guided(root_logits.reshape(1, -1), [-1])[0], ctx.sampling)[None]  # [1, V]
        for d in range(depth):
            k = min(self.width, self.nodes - len(tree))
            if k <= 0 or not beam:
                break
            if d > 0:
                open_ = set(self._expandable(beam))
                keep = [r for r, i in enumerate(beam) if i in open_]
                beam, phi, value = [beam[r] for r in keep], phi[keep], value[keep]
                if not beam:
                    break
                q = process_logits(self._guided((yield from self._feed_steps(tree, beam)), beam), ctx.sampling)  # [B, V]
            chosen = self._beam_select(phi, value, q.log(), k, ctx.generator)
            new_beam, new_phi, new_value = [], [], []
            for row, token, p, v in chosen:
                new_beam.append(self._add(tree, token, beam[row]))
                rows.append(q[row])
                new_phi.append(p)
                new_value.append(v)
            beam = new_beam
            phi = torch.tensor(new_phi, dtype=torch.float64)
            value = torch.tensor(new_value, dtype=torch.float64)
        return rows

    def _counterfactual_of(self, rows: torch.Tensor, committed: torch.Tensor, ctx: StepContext, p) -> Counterfactual:
        """The tree's counterfactual along the committed path (``tracking.tree_acceptance``: every mode is scored as
        the dynamic tree it would have grown greedy, the committed tokens standing for sample-and-match's draws)."""
        depth = min(self.depth, ctx.max_depth)
        floor = self.min_path_prob if self.mode == "dynamic" else 0.0
        n, censored = tree_acceptance(rows, committed, depth, self.width, floor, ctx.sampling)
        levels = [1] + [self.frontier] * max(depth - 1, 0)  # the root's children, then one level per depth
        return Counterfactual(n, self.nodes, depth, self._draft_forwards(levels[1:]), censored)

    # ---------------------------------------------------------------- after verification
    @torch.inference_mode()
    def observe(self, feedback: StepFeedback) -> None:
        """Keep the accepted nodes that were fed (gathered next to the committed tokens); drop the rest."""
        pending, self._pending = self._pending, None
        if pending is None or self.cache is None:
            return
        draft, tree, keep = pending
        if feedback.draft is not draft:  # not our last draft (e.g. truncated by the caller): drop the tree
            crop_to(self.cache, len(self.cached_ids))
            return
        slots: list[int] = []
        for node in feedback.acceptance.path:
            slot = tree.slots[keep[node]]
            if slot < 0:
                break
            slots.append(slot)
        keep_positions(self.cache, tree.base, torch.tensor(slots, dtype=torch.long))
        self.cached_ids.extend(int(draft.tokens[node]) for node in feedback.acceptance.path[: len(slots)])

    def describe(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "name": self.name,
            "model": self.model_ref or getattr(self.model.config, "_name_or_path", ""),
            "mode": self.mode,
            "nodes": self.nodes,
            "depth": self.depth,
            "width": self.width,
            "head_vocab": self.head_vocab,
            "track": self.track,
        }
        if self.mode == "dynamic":
            out["frontier"] = self.frontier
            out["min_path_prob"] = self.min_path_prob
        if self.mode == "rsd_c":
            out["branching"] = list(self.branching)
        return out
