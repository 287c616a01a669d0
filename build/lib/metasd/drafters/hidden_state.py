"""Hidden-state drafter that reuses rejected drafts (docs/algorithms.md#hidden-state-drafter; MEDC, arXiv 2602.21224).

Network (``hidden_state_net``): a token-free recurrence over verifier states, s_{t+1} = f(h_0..h_t), and a
token injection q(x_{t+2}) = softmax(head(g(s_{t+1}, e(x_{t+1})))) over a reduced draft vocabulary.

Engine convention: with T committed tokens, verifier states exist for rows 0..T-2; the pending token
x_{T-1} has none. Per step, depth D = min(depth, ctx.max_depth):

1. states. ``_states`` holds the layer's KV cache over input positions 0..L-1 (the first R of them real
   verifier states, the rest the drafter's own predictions) and the predicted states ``pred`` [L-R+1, d] of
   positions R..L. The depth-d draft token x_{T-1+d} needs the state of position T-2+d.
   * refresh (always when ``reuse`` is false): crop the cache to its R real positions, feed the real rows
     R..T-2 in one forward (catch-up); its last output is s_{T-1}; pred = [s_{T-1}], R = T-1.
   * reuse (``reuse: true``): the states predicted by the previous drafts never saw a drafted token, so they
     remain the drafter's prediction for the positions whatever got committed there. If the cache already
     holds predicted inputs up to position T-2 (``pred`` covers position T-1: the previous draft was rejected
     or cut before its last depth) and at most ``max_stale`` committed positions are predicted inputs, the
     step skips the catch-up forward entirely and reuses every state it already has: the new depth 1 is the
     previous draft's depth n_acc+2 state with the bonus (correction) token injected.
   Then extend the recurrence one position per forward until the state of position T-2+D exists.
2. tokens (token injection only; the states do not depend on them):
   * ``chain``: depth d injects the previous token (the pending token for d = 1) into its state; greedy argmax,
     or a sample of the processed q (``process_logits``) with q scattered into full-vocabulary ``probs``
     rows for rejection sampling (exact);
   * ``tree``: per depth, the ``k`` best nodes by path log-prob inject their tokens into that depth's state in
     one batched head call and get their top-``k`` children; the ``nodes`` best nodes overall form the draft.
     ``probs`` None: sample-and-match (exact).

``draft.meta``: ``reused_states`` (depth states taken from an earlier draft), ``drafter_forwards`` (layer
forwards this step), ``refreshed``, ``catch_up`` (tokens committed since this drafter's last step that its own
step did not commit: the prompt, other drafters' steps; as TreeFlash counts them).
The request's ``RequestStats.drafter_counts`` sums them (``refreshed``: steps that refreshed).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from metasd.models.draft_vocab import DraftVocab
from metasd.core.decoding.drafter import Bool, DrafterParams, Int, StepContext, check_params, register_drafter
from metasd.models.quantize import quantize_model
from metasd.core.decoding.sampling import process_logits, sample
from metasd.core.execution.draft_batch import Drafting, PackedFeed, RowFeed, drive
from metasd.core.execution.staging import to_device
from metasd.core.execution.tree import Draft

from .hidden_state_net import HiddenStateNet, load_checkpoint
from .treeflash_backbone import VerifierPieces
from .verifier_state import VerifierStateDrafter, check_verifier_fit

MODES = ("chain", "tree")


class HiddenStateParams(DrafterParams):
    """Pool-config ``params`` of the hidden-state drafter; keys left out take the checkpoint's defaults."""

    mode: Literal["chain", "tree"] = "chain"
    depth: Int = Field(4, ge=1, description="deepest draft depth")
    nodes: Int = Field(16, ge=1, description="tree: draft nodes per step")
    k: Int = Field(4, ge=1, description="tree: children per node")
    reuse: Bool = Field(True, description="reuse earlier predicted states")
    max_stale: Int = Field(8, ge=0, description="committed positions that may keep predicted inputs")


@register_drafter
class HiddenStateDrafter(VerifierStateDrafter):
    """Token-free hidden-state recurrence + token injection, with reuse of earlier drafts' states.

    net: a ``HiddenStateNet``; verifier_model: the verifier (its embeddings and LM head are used, frozen);
    vocab: the reduced draft vocabulary. mode: "chain" | "tree"; depth: deepest draft depth; nodes, k: tree
    size and children per node; reuse: reuse earlier predicted states (see module docstring); max_stale: at
    most this many committed positions may keep predicted inputs before real states replace them.
    """

    kind = "hidden_state"
    load_checkpoint = staticmethod(load_checkpoint)
    Params = HiddenStateParams

    def __init__(self, net: HiddenStateNet, verifier_model, vocab: DraftVocab, mode: str = "chain", depth: int = 4,
                 nodes: int = 16, k: int = 4, reuse: bool = True, max_stale: int = 8, name: str | None = None,
                 checkpoint: str | None = None):
        super().__init__(name)
        check_params(HiddenStateParams, dict(mode=mode, depth=depth, nodes=nodes, k=k, reuse=reuse, max_stale=max_stale),
                     self.name)
        cfg = net.cfg
        where = f"{self.name}: checkpoint {checkpoint or '(in memory)'}"
        n_layers = check_verifier_fit(where, cfg, verifier_model, vocab)
        if not 0 <= cfg.state_layer <= n_layers:
            raise ValueError(f"{where} reads verifier layer {cfg.state_layer}; this verifier has hidden states 0..{n_layers}")
        self.mode, self.depth, self.nodes, self.k = mode, int(depth), int(nodes), int(k)
        self.reuse, self.max_stale = bool(reuse), int(max_stale)
        self.net = net.to(verifier_model.device, verifier_model.dtype).eval().requires_grad_(False)  # beside the verifier
        self.vocab = vocab
        self.pieces = VerifierPieces.from_model(verifier_model, vocab.token_ids)
        # the verifier's head restricted to the draft vocabulary, as a layer of its own (a copy: quantizing it
        # with the drafter never touches the verifier's head)
        w = self.pieces.head_weight
        self.head = nn.Linear(w.shape[1], w.shape[0], bias=self.pieces.head_bias is not None, dtype=w.dtype, device=w.device)
        self.head.weight = nn.Parameter(w, requires_grad=False)
        if self.pieces.head_bias is not None:
            self.head.bias = nn.Parameter(self.pieces.head_bias, requires_grad=False)
        self.hidden_layers = (cfg.state_layer,)
        self.checkpoint = checkpoint
        self.last_states: torch.Tensor | None = None  # [D, d] depth states of the last draft (tests, analysis)
        self._reset()

    def quantize(self, mode: str) -> None:
        """Weight-only quantization of the drafter's own layers and of its draft-vocabulary head slice (a
        one-row int4 head over 32k tokens costs ~3 ms instead of ~13 ms in bf16 on a 2-core CPU)."""
        quantize_model(self.net, mode, name=f"drafter {self.name!r}")
        holder = nn.ModuleDict({"head": self.head})
        quantize_model(holder, mode, name=f"drafter {self.name!r} (draft-vocabulary head)")
        if holder["head"] is not self.head:  # quantized: the dense slice the head was built from is not read again
            self.pieces.head_weight = self.pieces.head_bias = None
        self.head = holder["head"]

    # ---------------------------------------------------------- per request
    def _reset(self) -> None:
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None  # [n_kv, L, hd] each
        self._real = 0  # R: leading cache positions whose input is a real verifier state
        self._pred: torch.Tensor | None = None  # [L-R+1, d] predicted states of positions R..L
        self._own_rows = 0  # tokens this drafter's own last step committed
        self._seen = 0  # pending position at this drafter's last step

    def begin(self, ctx: StepContext) -> None:
        self._reset()

    def end(self) -> None:
        self._reset()

    def _forked(self, cross_request: bool) -> None:
        self._reset()
        self.last_states = None

    def observe(self, feedback) -> None:
        self._own_rows = len(feedback.committed)

    def _forward(self, h: torch.Tensor, start: int) -> Drafting:
        """Feed inputs h [n, d] at positions start.. (= the cache length): one recurrence step, yielded as a
        ``PackedFeed`` (a scheduler packs the steps of all its requests into one); returns predicted states [n, d]."""
        s, (k, v) = yield PackedFeed(self.net, h, torch.arange(start, start + len(h), device=h.device), self._kv)
        self._kv = (k, v) if self._kv is None else (torch.cat([self._kv[0], k], 1), torch.cat([self._kv[1], v], 1))
        return s

    def _states(self, ctx: StepContext, D: int) -> Drafting:
        """(a drafting loop) [D, d] token-free states of positions T-1..T-2+D (depths 1..D) and this step's counts."""
        P = len(ctx.tokens) - 1  # pending position; real rows 0..P-1
        if ctx.hidden is None or len(ctx.hidden) < P:
            raise RuntimeError(f"{self.name}: the engine gave {0 if ctx.hidden is None else len(ctx.hidden)} verifier "
                               f"states (layer {self.hidden_layers}) for {P} committed positions")
        R, pred = self._real, self._pred
        have = -1 if pred is None else R + len(pred) - 1  # last position with a predicted state
        reusable = self.reuse and pred is not None and R <= P <= have and P - R <= self.max_stale
        forwards = 0
        if not reusable:
            R = min(R, P - 1) if self._kv is not None and R <= P else 0  # refeed >= 1 row: its output is s_{T-1}
            self._kv = None if R == 0 else (self._kv[0][:, :R], self._kv[1][:, :R])
            rows = ctx.hidden.get(self.net.cfg.state_layer)[R:P]
            s = yield from self._forward(rows, R)
            forwards = 1
            self._real, self._pred = P, s[-1:]
            R, have = P, P
        reused = min(D, have - P + 1) if reusable else 0
        while self._real + len(self._pred) - 1 < P - 1 + D:  # extend the recurrence by one position
            last = self._real + len(self._pred) - 1
            self._pred = torch.cat([self._pred, (yield from self._forward(self._pred[-1:], last))])
            forwards += 1
        off = P - self._real
        meta = {"reused_states": reused, "drafter_forwards": forwards, "refreshed": not reusable,
                "catch_up": max(P - self._seen - self._own_rows, 0)}
        self._seen, self._own_rows = P, 0
        return self._pred[off:off + D], meta

    # ---------------------------------------------------------- drafting
    def _logits(self, states: torch.Tensor, tokens: torch.Tensor) -> Drafting:
        """(a drafting loop) states [n, d], full token ids [n] injected at those positions -> [n, N] draft-vocabulary
        logits; the head's call is yielded (a ``RowFeed``: a scheduler scores every request's rows in one call)."""
        emb = self.pieces.embed(tokens, self.net.dtype)
        return (yield RowFeed(self.head, self.net.inject(states, emb))).float()

    def _chain(self, states: torch.Tensor, root: int, ctx: StepContext) -> Drafting:
        """One token per depth, drafted on the device (each depth injects the previous depth's token) and read once."""
        greedy = ctx.sampling.greedy
        device = states.device
        token_ids = self.vocab.ids_on(device)  # [N] reduced index -> full id
        prev = to_device([root], device, torch.long)  # [1] full id injected at the next depth
        toks, rows = [], []
        for d in range(len(states)):
            logits = (yield from self._logits(states[d:d + 1], prev))[0]  # [N]
            if greedy:
                tok = logits.argmax(-1, keepdim=True)
            else:
                q = process_logits(logits, ctx.sampling)  # [N]
                tok = sample(q, ctx.generator).view(1)
                rows.append(q)
            prev = token_ids[tok]
            toks.append(prev)
        probs = None
        if rows:  # q over the full vocabulary: zero outside the draft vocabulary
            probs = torch.zeros(len(rows), self.vocab.full_size, device=device)
            probs[:, token_ids] = torch.stack(rows)
        return Draft.chain(torch.cat(toks).tolist(), probs)  # the chain's one host read

    def _tree(self, states: torch.Tensor, root: int) -> Drafting:
        """Beam-expanded tree (as EAGLE-2 grows its trees), one batched head call per depth: at depth d the
        ``k`` best nodes of depth d-1 by path log-prob (the root at d = 1) inject their token into the depth-d
        state and each gets its top-``k`` children; the draft keeps the ``nodes`` best nodes overall. A child's
        path log-prob is at most its parent's, so the kept set contains the parent of every kept node."""
        D, k = len(states), min(self.k, len(self.vocab))
        scores: list[float] = []  # path log-prob per candidate
        tokens: list[int] = []
        parents: list[int] = []  # candidate index of the parent, -1 for depth 1
        depths: list[int] = []
        frontier = [-1]  # candidates expanded at the next depth (-1: the root)
        device = states.device
        token_ids = self.vocab.ids_on(device)  # [N] reduced index -> full id
        for d in range(D):
            toks = to_device([root if i < 0 else tokens[i] for i in frontier], device, torch.long)  # [F]
            logits = yield from self._logits(states[d:d + 1].expand(len(frontier), -1), toks)  # [F, N]
            top = logits.log_softmax(-1).topk(k)
            base = to_device([0.0 if i < 0 else scores[i] for i in frontier], device, torch.float32)[:, None]  # [F, 1]
            # path log-probs and full ids of the level's candidates in one host read (ids < 2**24: exact in float32)
            path, ids = torch.stack([(base + top.values).flatten(), token_ids[top.indices.flatten()].float()]).tolist()
            first = len(tokens)
            for j, (sc, tok) in enumerate(zip(path, ids)):
                scores.append(sc)
                tokens.append(int(tok))
                parents.append(frontier[j // k])
                depths.append(d + 1)
            level = range(first, len(tokens))
            frontier = sorted(level, key=lambda i: -scores[i])[:k]
        keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:self.nodes]
        keep.sort(key=lambda i: (depths[i], i))  # parents before children
        index = {c: n for n, c in enumerate(keep)}
        return Draft(torch.tensor([tokens[c] for c in keep], dtype=torch.long),
                     torch.tensor([-1 if parents[c] < 0 else index[parents[c]] for c in keep], dtype=torch.long))

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> Draft:
        return drive(self.drafting(ctx))

    @torch.inference_mode()  # on a generator: each stretch between its feeds runs in inference mode
    def drafting(self, ctx: StepContext) -> Drafting:
        """``propose`` as a drafting loop: its recurrence steps and head calls are yielded, so that a scheduler runs
        those of all its requests drafting with this network as one step / one call per depth."""
        D = min(self.depth, ctx.max_depth)
        if D <= 0 or len(ctx.tokens) < 2:  # no depth to draft, or no verifier state yet (one-token prompt)
            draft = Draft.empty()
            draft.meta.update(reused_states=0, drafter_forwards=0, refreshed=False, catch_up=0)
            return draft
        states, meta = yield from self._states(ctx, D)
        self.last_states = states.clone()
        root = int(ctx.tokens[-1])
        draft = yield from (self._chain(states, root, ctx) if self.mode == "chain" else self._tree(states, root))
        draft.meta.update(meta)
        draft.catch_up = int(meta["catch_up"])
        return draft

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": self.mode, "depth": self.depth, "nodes": self.nodes, "k": self.k,
                "reuse": self.reuse, "max_stale": self.max_stale, "draft_vocab": len(self.vocab),
                "state_layer": self.net.cfg.state_layer, "checkpoint": self.checkpoint}
