"""Block drafter: k parallel heads on the verifier's last hidden state, with lattice rescoring
(docs/algorithms.md#block-drafters-and-lattice-rescoring; Stern et al. 2018, Kim et al. arXiv 2404.09221).

Indexing. ``HiddenStore.last(L)`` is the verifier state (after the final norm) that produced the
pending token, i.e. the state at position t whose LM-head output is token t+1 = the pending token. The
draft continues *after* the pending token, so head i predicts token t+2+i = pending+1+i (head 0 is the
first draft token). Training uses the same offsets (``metasd.training.block.block_targets``).

Each head is a residual SiLU block ``z = h + SiLU(W_i h + b_i)`` (W, b zero-initialised, so an untrained
head is the identity and reproduces the verifier's own next-token prediction) followed by the verifier's
frozen LM head restricted to a reduced ``DraftVocab`` (or the full vocabulary).

Refinement (``refine``), over the lattice of each head's top-m tokens:
  none    the p best paths under the heads' log-probs alone (p=1: the per-head argmax chain);
  ngram   exact p-best paths by dynamic programming over  sum_i head_logp_i + weight * ngram_logp_i, with a
          Witten-Bell n-gram model of the prompt and generated tokens (plus an optional corpus);
  neural  beam search (width p) over  head_logp + weight * lm_logp  where lm_logp is a small LM's
          next-token log-prob along the path; the LM keeps its own KV cache and catches up on committed
          tokens through a composed ``PretrainedDrafter``; beams are scored in one tree forward per depth.
The p paths are merged into one token tree (shared prefixes once) and verified together. Drafts carry
no probabilities (sample-and-match / greedy), so verification is exact for any refinement.
"""
from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field
from safetensors.torch import save_file

from metasd.core.execution.draft_batch import Drafting, Feed, HostRead, RowFeed, drive
from metasd.core.pricing.cost import counted_linear
from metasd.core.execution.staging import to_device
from metasd.models.draft_vocab import DraftVocab
from metasd.core.decoding.drafter import Drafter, DrafterParams, Float, Int, StepContext, check_params, register_drafter
from metasd.core.execution.kv_cache import cache_length, crop_to
from metasd.models.packed_weights import load_weights
from metasd.models.quantize import dense_weight
from metasd.core.execution.tree import Draft

from .ngram_lm import NGramLM
from .pretrained import PretrainedDrafter

HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "config.json"
VOCAB_FILE = "draft_vocab.safetensors"
REFINEMENTS = ("none", "ngram", "neural")
DEFAULT_WEIGHT = {"none": 0.0, "ngram": 0.5, "neural": 1.0}


# ------------------------------------------------------------------------------------------- heads
class BlockHeads(torch.nn.Module):
    """k residual SiLU blocks on one verifier hidden state, scored by the frozen (reduced) LM head.

    weight [k, d, d], bias [k, d]: head i computes ``z_i = h + SiLU(weight[i] @ h + bias[i])``.
    lm_weight [N, d] (buffer, not trained, not saved): rows of the verifier's LM head for the draft vocab.
    ``forward(h [B, d]) -> logits [B, k, N]`` over the reduced vocabulary.
    """

    def __init__(self, hidden_size: int, k: int, lm_weight: torch.Tensor, vocab: DraftVocab, hidden_layer: int,
                 init: str = "zero", dtype: torch.dtype | None = None):
        super().__init__()
        if k < 1:
            raise ValueError(f"BlockHeads: k must be >= 1, got {k}")
        if lm_weight.shape != (len(vocab), hidden_size):
            raise ValueError(f"BlockHeads: LM-head rows {tuple(lm_weight.shape)} do not match draft vocab "
                             f"{len(vocab)} x hidden size {hidden_size}")
        dtype = dtype or torch.float32
        self.hidden_size, self.k, self.hidden_layer, self.vocab = hidden_size, k, hidden_layer, vocab
        self.weight = torch.nn.Parameter(torch.zeros(k, hidden_size, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(k, hidden_size, dtype=dtype))
        if init == "normal":  # small random blocks (tests; zero is the default, identity-friendly)
            torch.nn.init.normal_(self.weight, std=hidden_size ** -0.5)
        elif init != "zero":
            raise ValueError(f"BlockHeads: init must be 'zero' or 'normal', got {init!r}")
        self.register_buffer("lm_weight", lm_weight.detach(), persistent=False)

    def blocks(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, d] -> z [B, k, d] (residual SiLU blocks)."""
        k, d = self.k, self.hidden_size
        u = counted_linear(h, self.weight.reshape(k * d, d), self.bias.reshape(k * d)).view(*h.shape[:-1], k, d)
        return h.unsqueeze(-2) + F.silu(u)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.blocks(h)
        return counted_linear(z.to(self.lm_weight.dtype), self.lm_weight)

    # ---------------------------------------------------------------- files
    def config(self) -> dict[str, Any]:
        return {"kind": "block", "k": self.k, "hidden_size": self.hidden_size, "hidden_layer": self.hidden_layer,
                "draft_vocab_size": len(self.vocab), "full_vocab_size": self.vocab.full_size,
                "heads_file": HEADS_FILE, "draft_vocab": VOCAB_FILE}

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> Path:
        """Write heads (``dtype``), draft vocab and config.json into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {"weight": self.weight.detach().to(dtype).contiguous().cpu(),
                   "bias": self.bias.detach().to(dtype).contiguous().cpu()}
        save_file(tensors, str(out / HEADS_FILE))
        self.vocab.save(out / VOCAB_FILE)
        (out / CONFIG_FILE).write_text(json.dumps({**self.config(), **(extra or {})}, indent=1))
        return out

    @classmethod
    def load(cls, ckpt_dir: str | Path, full_lm_weight: torch.Tensor, dtype: torch.dtype | None = None) -> "BlockHeads":
        """Heads of a checkpoint directory; ``full_lm_weight`` [vocab, d] is the verifier's LM head."""
        path = Path(ckpt_dir)
        cfg_path = path / CONFIG_FILE
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path} has no {CONFIG_FILE}: not a block-drafter checkpoint")
        cfg = json.loads(cfg_path.read_text())
        vocab = DraftVocab.load(path / cfg.get("draft_vocab", VOCAB_FILE))
        if vocab.full_size != full_lm_weight.shape[0] or cfg["hidden_size"] != full_lm_weight.shape[1]:
            raise ValueError(f"checkpoint {path} was trained for vocab {vocab.full_size} x d {cfg['hidden_size']}; "
                             f"the verifier's LM head is {tuple(full_lm_weight.shape)}")
        dtype = dtype or full_lm_weight.dtype
        state = load_weights(path / cfg.get("heads_file", HEADS_FILE))  # plain or packed (metasd pack-weights)
        heads = cls(cfg["hidden_size"], cfg["k"], vocab.head_weight(full_lm_weight).to(dtype), vocab,
                    cfg["hidden_layer"], dtype=dtype)
        with torch.no_grad():
            heads.weight.copy_(state["weight"])
            heads.bias.copy_(state["bias"])
        return heads.to(full_lm_weight.device).eval().requires_grad_(False)  # beside the verifier's head


# ------------------------------------------------------------------------------------------- lattice search
Path_ = tuple[int, ...]


def p_best_paths(tokens: Sequence[Sequence[int]], logp: Sequence[Sequence[float]], p: int,
                 extra: Callable[[tuple, int], float] | None = None, state_len: int = 0,
                 context: Sequence[int] = ()) -> list[tuple[float, Path_]]:
    """The ``p`` best paths through a lattice, best first: exact p-best Viterbi.

    tokens[i][j], logp[i][j]: candidate j of position i and its head log-prob. A path picks one candidate
    per position; its score is sum_i logp[i][j_i] + extra(state_i, x_i), where ``extra`` depends only on
    ``state_i`` = the last ``state_len`` tokens of ``context + path[:i]`` (an n-gram of order n uses
    state_len = n-1). Keeping the p best partial paths per state is then exact. Ties keep lattice order.
    """
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")

    def cut(seq: tuple) -> tuple:
        return seq[len(seq) - state_len:] if state_len else ()

    beams: dict[tuple, list[tuple[float, Path_]]] = {cut(tuple(context)): [(0.0, ())]}
    for cand, lps in zip(tokens, logp):
        grown: dict[tuple, list[tuple[float, Path_]]] = {}
        for state, hyps in beams.items():
            for x, lp in zip(cand, lps):
                add = float(lp) + (extra(state, int(x)) if extra is not None else 0.0)
                nxt = cut(state + (int(x),))
                grown.setdefault(nxt, []).extend((s + add, path + (int(x),)) for s, path in hyps)
        beams = {st: heapq.nlargest(p, hyps, key=lambda h: h[0]) for st, hyps in grown.items()}
    return heapq.nlargest(p, (h for hyps in beams.values() for h in hyps), key=lambda h: h[0])


def merge_paths(paths: Sequence[Sequence[int]]) -> Draft:
    """Merge token paths into one tree (shared prefixes become shared nodes), first path first."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, ...], int] = {}
    for path in paths:
        parent = -1
        for d in range(len(path)):
            key = tuple(path[:d + 1])
            node = index.get(key)
            if node is None:
                node = index[key] = len(tokens)
                tokens.append(int(path[d]))
                parents.append(parent)
            parent = node
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


# ------------------------------------------------------------------------------------------- drafter
class BlockParams(DrafterParams):
    """Pool-config ``params`` of the block drafter (the heads come from the entry's ``checkpoint``)."""

    k: Int | None = Field(None, ge=1, description="heads used (default: all; at most the trained heads, checked on load)")
    top_m: Int = Field(8, ge=1, description="candidates per head in the lattice")
    paths: Int = Field(4, ge=1, description="paths verified together as a tree (1 = a chain)")
    refine: Literal["none", "ngram", "neural"] = "none"
    weight: Float | None = Field(None, allow_inf_nan=False,
                                 description="rescoring weight (default 0.5 for ngram, 1.0 for neural)")
    ngram_order: Int = Field(3, ge=1, description="order of the n-gram model (refine ngram)")
    corpus: str | None = Field(None, description="text file counted into the n-gram model (refine ngram)")


@register_drafter
class BlockDrafter(Drafter):
    """Parallel heads on the verifier's final hidden state, refined over a lattice (see module doc).

    k: heads used (<= trained heads); top_m: candidates per head in the lattice; paths: p, the number of
    paths verified together as a tree (1 = a chain); refine: none | ngram | neural; weight: rescoring
    weight of the n-gram / small-LM log-prob (default 0.5 for ngram, 1.0 for neural); ngram_order,
    corpus (a text file tokenized with the verifier's tokenizer, counted once, added to the request's
    counts). neural needs ``model`` (a small causal LM with the verifier's tokenizer; in a pool config
    the entry's ``model`` reference).
    """

    verifier_weights = True  # runs / reads the verifier's torch model
    kind = "block"
    model_field, checkpoint_field = "optional", "required"
    Params = BlockParams

    def __init__(self, heads: BlockHeads, k: int | None = None, top_m: int = 8, paths: int = 4,
                 refine: str = "none", weight: float | None = None, ngram_order: int = 3,
                 corpus: str | None = None, model=None, tokenizer=None, verifier_tokenizer=None,
                 name: str | None = None, model_ref: str | None = None):
        super().__init__(name)
        check_params(BlockParams, dict(k=k, top_m=top_m, paths=paths, refine=refine, weight=weight,
                                       ngram_order=ngram_order, corpus=corpus), self.name)
        k = heads.k if k is None else k
        if k > heads.k:  # needs the loaded heads
            raise ValueError(f"{self.name}: k must be in 1..{heads.k} (the trained heads), got {k}")
        self.heads = heads.eval().requires_grad_(False)
        self.hidden_layers = (heads.hidden_layer,)
        self.k, self.top_m, self.paths, self.refine = k, min(top_m, len(heads.vocab)), paths, refine
        self.weight = DEFAULT_WEIGHT[refine] if weight is None else float(weight)
        self.ngram_order, self.corpus, self.model_ref = ngram_order, corpus, model_ref
        self.lm: PretrainedDrafter | None = None
        if refine == "neural":
            if model is None:
                raise ValueError(f"{self.name}: refine 'neural' needs a small LM (pool config: the entry's 'model')")
            self.lm = PretrainedDrafter(model, tokenizer, k=1, name=f"{self.name}.lm")
            self.tokenizer = tokenizer
        base = None
        if refine == "ngram" and corpus:
            base = NGramLM.from_text_file(corpus, verifier_tokenizer or tokenizer, ngram_order, heads.vocab.full_size)
        self.ngram = NGramLM(ngram_order, heads.vocab.full_size, base) if refine == "ngram" else None

    @classmethod
    def from_config(cls, name, params, build):
        ckpt = build.checkpoint
        if not ckpt:
            raise ValueError(f"drafter {name!r} of type 'block' needs a checkpoint directory (field 'checkpoint')")
        verifier = build.verifier
        heads = BlockHeads.load(ckpt, dense_weight(verifier.model.get_output_embeddings()), dtype=verifier.dtype)
        if heads.hidden_layer != verifier.num_layers:
            raise ValueError(f"checkpoint {ckpt} reads verifier layer {heads.hidden_layer}; "
                             f"{verifier.name} has {verifier.num_layers} layers (heads read the state after the final norm)")
        model = tokenizer = None
        if params.get("refine") == "neural":
            if not build.model:
                raise ValueError(f"drafter {name!r}: refine 'neural' needs a small LM reference (field 'model')")
            model, tokenizer = build.load_model(build.model)
        elif build.model:
            raise ValueError(f"drafter {name!r}: a model is only used with refine 'neural'")
        else:  # the heads read the verifier's (possibly quantized) LM head; only the rescoring LM is quantizable
            build.refuse_quantize(name, cls.kind)
        return cls(heads, model=model, tokenizer=tokenizer, verifier_tokenizer=verifier.tokenizer, name=name,
                   model_ref=build.model, **params)

    # ---------------------------------------------------------------- per request
    def begin(self, ctx: StepContext) -> None:
        if self.ngram is not None:  # new counts, not reset in place: a fork's (Drafter.fork) are its own
            self.ngram = NGramLM(self.ngram.order, self.ngram.vocab_size, self.ngram.base)
        if self.lm is not None:
            self.lm.begin(ctx)

    def end(self) -> None:
        if self.lm is not None:
            self.lm.end()

    # ---------------------------------------------------------------- drafting
    def _heads_input(self, h: torch.Tensor) -> torch.Tensor:
        """The verifier state h [d] as the heads' input row [1, d]."""
        return h.to(self.heads.lm_weight.dtype).reshape(1, -1).contiguous()

    def _top(self, logits: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' logits [k, N] -> head i's top-m (full token ids [depth, m], log-probs [depth, m])."""
        top = logits[:depth].float().log_softmax(-1).topk(self.top_m, dim=-1)
        return self.heads.vocab.to_full(top.indices), top.values

    @torch.inference_mode()
    def lattice(self, h: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Head i's top-m candidates for token pending+1+i from the verifier state h [d]."""
        return self._top(self.heads(self._heads_input(h))[0], depth)

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> Draft:
        return drive(self.drafting(ctx))

    @torch.inference_mode()  # on a generator: each stretch between its feeds runs in inference mode
    def drafting(self, ctx: StepContext) -> Drafting:
        """``propose`` as a drafting loop: the heads' forward is yielded (a ``RowFeed``: one row, the verifier's
        state), so that a scheduler runs the heads of all its requests that draft with them in one call."""
        depth = min(self.k, ctx.max_depth)
        if depth <= 0 or ctx.hidden is None or len(ctx.hidden) == 0:
            return Draft.empty()
        logits = yield RowFeed(self.heads, self._heads_input(ctx.hidden.last(self.heads.hidden_layer)))  # [1, k, N]
        cand, logp = self._top(logits[0], depth)  # [depth, m] each
        both = yield HostRead(torch.stack([cand.float(), logp]))  # the lattice in one host read (ids < 2**24: exact)
        cand_l, logp_l = [[int(x) for x in row] for row in both[0]], both[1]
        catch_up = 0
        if self.refine == "neural":
            best = yield from self._beam_steps(ctx.tokens.tolist(), cand_l, logp_l)
            catch_up = self.lm.last_catch_up
        elif self.refine == "ngram":
            tokens = ctx.tokens.tolist()
            self.ngram.sync(tokens)
            memo: dict[tuple, float] = {}
            w, lm = self.weight, self.ngram

            def extra(state: tuple, x: int) -> float:
                key = state + (x,)
                if key not in memo:
                    memo[key] = w * lm.logprob(state, x)
                return memo[key]

            best = p_best_paths(cand_l, logp_l, self.paths, extra, self.ngram_order - 1, tokens)
        else:
            best = p_best_paths(cand_l, logp_l, self.paths)
        draft = merge_paths([path for _, path in best])
        draft.catch_up = catch_up
        return draft

    @torch.inference_mode()
    def _beam_search(self, tokens: list[int], cand: list[list[int]], logp: list[list[float]]) -> list[tuple[float, Path_]]:
        """Beam search (width ``paths``) over head log-prob + weight * small-LM log-prob along each path.

        The LM scores every beam of a depth in one forward over the beams' new tokens, with an
        ancestor-only mask over the nodes fed so far; its cache is cropped back to the committed tokens.
        """
        return drive(self._beam_steps(tokens, cand, logp))

    def _beam_steps(self, tokens: list[int], cand: list[list[int]], logp: list[list[float]]) -> Drafting:
        """``_beam_search`` as a drafting loop: the LM's catch-up and its forward per depth are yielded (``Feed`` s),
        so that a scheduler runs those of all its requests rescoring with one LM in one forward."""
        lm = self.lm
        first = (yield from lm._sync_steps(tokens)).float().log_softmax(-1)  # LM distribution of token pending+1
        committed = cache_length(lm.cache)
        vocab = first.shape[-1]
        # beams: (score, path, node index among fed nodes or -1 for the root, LM log-probs after the path)
        beams = [(0.0, (), -1, first)]
        fed_parents: list[int] = []  # parent node of each fed node (-1: the committed prefix)
        depth = len(cand)
        try:
            for i in range(depth):
                grown = []
                ids = to_device([min(x, vocab - 1) for x in cand[i]], first.device, torch.long)  # [m]
                lm_rows = yield HostRead(torch.stack([lp[ids] for _, _, _, lp in beams]))  # the depth's one read
                for (score, path, node, _), row in zip(beams, lm_rows):
                    for x, hl, lm_lp in zip(cand[i], logp[i], row):
                        lm_lp = lm_lp if x < vocab else -1e4
                        grown.append((score + hl + self.weight * lm_lp, path + (x,), node))
                grown = heapq.nlargest(self.paths, grown, key=lambda g: g[0])
                if i == depth - 1:
                    return [(s, path) for s, path, _ in grown]
                new_lp = yield from self._score_nodes(committed, fed_parents,
                                                      [(path[-1], node) for _, path, node in grown], i)
                start = len(fed_parents)
                fed_parents.extend(node for _, _, node in grown)
                beams = [(s, path, start + j, new_lp[j]) for j, (s, path, _) in enumerate(grown)]
        finally:
            crop_to(lm.cache, committed)
        return []

    def _score_nodes(self, committed: int, fed_parents: list[int], new: list[tuple[int, int]], depth: int) -> Drafting:
        """Feed new tree nodes (token, parent node) at tree depth ``depth`` into the LM (a ``Feed`` yielded); returns
        their log-probs [n, vocab]."""
        n_old, n_new = len(fed_parents), len(new)
        anc = torch.zeros(n_old + n_new, n_old + n_new, dtype=torch.bool)  # node -> its ancestors and itself
        for j, par in enumerate(fed_parents + [par for _, par in new]):
            if par >= 0:
                anc[j] = anc[par]
            anc[j, j] = True
        mask = torch.cat([torch.ones(n_new, committed, dtype=torch.bool), anc[n_old:]], dim=1)  # [n, L + n]
        logits = yield Feed(self.lm.model, None, self.lm.cache, [t for t, _ in new], mask=mask,
                            positions=torch.full((n_new,), committed + depth, dtype=torch.long))  # [n, vocab]
        return logits.float().log_softmax(-1)

    def describe(self) -> dict[str, Any]:
        d = {**super().describe(), "k": self.k, "top_m": self.top_m, "paths": self.paths, "refine": self.refine,
             "weight": self.weight, "draft_vocab": len(self.heads.vocab)}
        if self.refine == "ngram":
            d.update(ngram_order=self.ngram_order, corpus=self.corpus)
        if self.refine == "neural":
            d["model"] = self.model_ref or getattr(self.lm.model.config, "_name_or_path", "")
        return d
