"""Block drafter (drafters/block.py) and its training (metasd/training/block.py) on tiny models."""
import copy
import itertools
import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from metasd.config import build_engine, parse_pool_config
from metasd.models.draft_vocab import DraftVocab
from metasd.core.decoding.drafter import StepContext
from metasd.drafters.block import BlockDrafter, BlockHeads, NGramLM, merge_paths, p_best_paths
from metasd.core.engine import Engine
from metasd.core.decoding.sampling import SamplingParams
from metasd.training.block import TrainBlockConfig, block_targets, load_train_block_config, train_block
from metasd.training.common import state_file
from metasd.training.data import Example
from metasd.training.features import extract_features
from metasd.core import Verifier
from tiny import VOCAB, plain_greedy, tiny_qwen

CYCLE = [10, 17, 23, 31, 12, 40, 26]
K = 3
PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]


def cyc(start, n):
    return [CYCLE[(start + j) % len(CYCLE)] for j in range(n)]


def _cycle_model():
    """A tiny Qwen fine-tuned until its greedy continuation of any cycle prefix is the cycle."""
    model = tiny_qwen(seed=0).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        x = torch.tensor([[0] + cyc(s, 47) for s in torch.randint(0, 7, (8,), generator=g).tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def cycle_setup(tmp_path_factory, tokenizer):
    """Cycle verifier saved as a model directory, its features, and a base training config."""
    root = tmp_path_factory.mktemp("block")
    model = _cycle_model()
    assert plain_greedy(model, [0] + cyc(2, 4), 14) == cyc(6, 14)
    model.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    examples = []
    for s in range(24):
        ids = [0] + cyc(s, 39)
        examples.append(Example(ids, [False] * 6 + [True] * 34))
    extract_features(model, examples, root / "features", layers=[1, 2], topk=4, shard_size=6, log=lambda *a: None)
    base = dict(features=str(root / "features"), verifier=str(root / "verifier"), k=K, vocab_size=16, steps=120,
                batch_size=64, lr=2e-2, warmup=5, bf16=False, log_every=40, eval_every=60, save_every=1000,
                mlflow=False, val_shards="3", threads=1)
    return root, model, base


@pytest.fixture(scope="module")
def trained(cycle_setup, tmp_path_factory):
    root, model, base = cycle_setup
    out = root / "ckpt"
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    try:
        result = train_block(TrainBlockConfig(**{**base, "out": str(out), "mlflow": True, "run_name": "tiny"}),
                             log=lambda *a: None)
    finally:
        mp.undo()
    return out, result


def _heads(model, ckpt):
    return BlockHeads.load(ckpt, model.get_output_embeddings().weight)


# ---------------------------------------------------------------- indexing
def test_block_targets_are_the_tokens_after_the_pending_one():
    ids = torch.arange(100, 110)
    mask = torch.tensor([False] * 4 + [True] * 6)
    y = block_targets(ids, mask, 3)
    # position t produced token t+1 (the pending token); head i targets token t+2+i
    assert y[2].tolist() == [104, 105, 106] and y[1].tolist() == [-1, 104, 105]  # token 103 is prompt
    assert y[7].tolist() == [109, -1, -1] and (y[8:] == -1).all()
    nxt = ids + 1000  # the verifier's prediction at position j is for token j+1
    assert block_targets(ids, mask, 3, nxt)[2].tolist() == [1103, 1104, 1105]


def test_heads_learn_the_cycle(trained):
    out, r = trained
    assert r["finished"] and r["step"] == 120
    for i in range(K):
        assert r[f"val/acc_head{i}"] > 0.97, r
    assert r["val/tau"] > K + 0.9
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["k"] == K and cfg["hidden_layer"] == 2 and cfg["draft_vocab_size"] == 16
    assert set(CYCLE) <= set(DraftVocab.load(out / "draft_vocab.safetensors").token_ids.tolist())
    assert "tokens per step" in (out / "MODEL_CARD.md").read_text()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out.parent / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("metasd-block").experiment_id])
    assert len(runs) == 1 and runs[0].data.metrics["val/acc_head0"] > 0.97 and runs[0].data.params["k"] == str(K)


def test_head_i_predicts_pending_plus_1_plus_i(cycle_setup, trained):
    _, model, _ = cycle_setup
    drafter = BlockDrafter(_heads(model, trained[0]), paths=1)
    verifier = Verifier(model)
    for start in range(len(CYCLE)):
        tokens = [0] + cyc(start, 9)  # the last one is the pending token
        verifier.prefill(torch.tensor(tokens[:-1]), [2])
        ctx = StepContext(torch.tensor(tokens), len(tokens), max_depth=10, sampling=SamplingParams(),
                          hidden=verifier.hidden)
        draft = drafter.propose(ctx)
        assert draft.is_chain and draft.tokens.tolist() == cyc(start + 9, K)


# ---------------------------------------------------------------- lattice search
def test_p_best_on_a_hand_built_lattice():
    tokens = [[1, 2], [3, 4], [5, 6]]
    logp = [[-0.1, -1.0], [-0.5, -0.7], [-0.2, -0.3]]
    # heads alone: scores are sums, best first
    got = p_best_paths(tokens, logp, 3)
    assert [p for _, p in got] == [(1, 3, 5), (1, 3, 6), (1, 4, 5)]
    assert [round(s, 6) for s, _ in got] == [-0.8, -0.9, -1.0]
    # with a bigram bonus that strongly prefers 2 -> 4 -> 6 and dislikes 3 after 1
    bigram = {(2, 4): 2.0, (4, 6): 1.0, (1, 3): -1.0}
    extra = lambda state, x: bigram.get((state[-1], x), 0.0)
    got = p_best_paths(tokens, logp, 4, extra, state_len=1, context=[7])
    # by hand: 2,4,6: -1-0.7-0.3+2+1 = 1.0; 2,4,5: 0.1; 1,4,6: -0.1; 1,4,5: -1.0 (1,3,.. pay -1)
    assert [p for _, p in got] == [(2, 4, 6), (2, 4, 5), (1, 4, 6), (1, 4, 5)]
    assert all(math.isclose(s, e, abs_tol=1e-9) for (s, _), e in zip(got, [1.0, 0.1, -0.1, -1.0]))


def test_p_best_with_trigram_state_is_exact():
    g = torch.Generator().manual_seed(0)
    tokens = [[int(t) for t in torch.randperm(6, generator=g)[:3]] for _ in range(4)]
    logp = torch.randn(4, 3, generator=g).tolist()
    table = torch.randn(6, 6, 6, generator=g)
    extra = lambda state, x: float(table[state[0], state[1], x])
    got = p_best_paths(tokens, logp, 5, extra, state_len=2, context=[1, 2])
    scored = []
    for path in itertools.product(*[range(3)] * 4):
        seq, s = [1, 2], 0.0
        for i, j in enumerate(path):
            s += logp[i][j] + extra(tuple(seq[-2:]), tokens[i][j])
            seq.append(tokens[i][j])
        scored.append((s, tuple(seq[2:])))
    scored.sort(key=lambda h: -h[0])
    assert [p for _, p in got] == [p for _, p in scored[:5]]


def test_merge_paths_shares_prefixes():
    d = merge_paths([(1, 2, 3), (1, 2, 4), (1, 5, 6), (7, 2, 3)])
    assert d.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 2, 3]
    assert d.parents.tolist() == [-1, 0, 1, 1, 0, 4, -1, 6, 7]
    assert merge_paths([(1, 2)]).is_chain


def test_ngram_lm_is_a_distribution_and_syncs():
    lm = NGramLM(3, VOCAB)
    lm.sync([5, 6, 7, 5, 6, 8, 5, 6])
    for hist in ([5, 6], [6], [], [9, 9]):
        total = sum(math.exp(lm.logprob(hist, x)) for x in range(VOCAB))
        assert math.isclose(total, 1.0, rel_tol=1e-9)
    assert lm.logprob([5, 6], 7) > lm.logprob([5, 6], 9)
    again = NGramLM(3, VOCAB)
    again.sync([5, 6, 7])
    again.sync([5, 6, 7, 5, 6, 8, 5, 6])  # incremental
    again.sync([1, 2, 3])  # diverges: recount
    fresh = NGramLM(3, VOCAB)
    fresh.extend([1, 2, 3])
    assert again.counts == fresh.counts
    corpus = NGramLM(3, VOCAB)
    corpus.extend([5, 6, 9] * 5)
    with_base = NGramLM(3, VOCAB, base=corpus)
    with_base.sync([5, 6, 7])
    assert with_base.logprob([5, 6], 9) > lm.logprob([5, 6], 9)
    assert math.isclose(sum(math.exp(with_base.logprob([5, 6], x)) for x in range(VOCAB)), 1.0, rel_tol=1e-9)


# ---------------------------------------------------------------- exactness
def _random_heads(model, k=4, vocab_size=48, seed=0):
    torch.manual_seed(seed)
    vocab = DraftVocab(torch.randperm(VOCAB)[:vocab_size], VOCAB)
    w = model.get_output_embeddings().weight
    return BlockHeads(w.shape[1], k, vocab.head_weight(w), vocab, model.config.num_hidden_layers, init="normal").eval()


def _drafter(refine, heads, paths=3, lm_model=None):
    return BlockDrafter(heads, refine=refine, paths=paths, top_m=4,
                        model=lm_model if refine == "neural" else None)


@pytest.mark.parametrize("refine", ["none", "ngram", "neural"])
def test_greedy_output_identical_to_plain_decoding(refine, cycle_setup, trained):
    model = tiny_qwen(seed=0)
    for paths in (1, 3):
        drafter = _drafter(refine, _random_heads(model), paths, tiny_qwen(seed=1))
        engine = Engine(Verifier(model), drafter, check_tokenizers=False)
        for n in (1, 9, 40):
            res = engine.generate(PROMPT, max_new_tokens=n)
            assert res.token_ids == plain_greedy(model, PROMPT, n)
            assert res.stats.new_tokens == n
    # a verifier the trained heads predict well: long accepted paths, still identical
    _, cmodel, _ = cycle_setup
    drafter = _drafter(refine, _heads(cmodel, trained[0]), 3, cmodel)
    prompt = [0] + cyc(3, 6)
    res = Engine(Verifier(cmodel), drafter, check_tokenizers=False).generate(prompt, max_new_tokens=33)
    assert res.token_ids == plain_greedy(cmodel, prompt, 33)
    assert res.stats.mean_tokens_per_step > K + 0.5  # every head right: tau = k + 1
    # sampling: drafts carry no probabilities and go through sample-and-match
    res = Engine(Verifier(model), _drafter(refine, _random_heads(model), 3, tiny_qwen(seed=1)),
                 check_tokenizers=False).generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=3)
    assert len(res.token_ids) == 12


def test_neural_rescoring_restores_the_lm_cache_and_uses_the_lm():
    model = tiny_qwen(seed=0)
    lm_model = tiny_qwen(seed=1)
    drafter = _drafter("neural", _random_heads(model), paths=3, lm_model=lm_model)
    verifier = Verifier(model)
    verifier.prefill(torch.tensor(PROMPT[:-1]), [2])
    ctx = StepContext(torch.tensor(PROMPT), len(PROMPT), max_depth=10, sampling=SamplingParams(), hidden=verifier.hidden)
    drafter.begin(ctx)
    draft = drafter.propose(ctx)
    assert draft.depth == 4 and len(draft) <= 12
    assert drafter.lm.cached_ids == PROMPT and drafter.lm.cache.get_seq_length() == len(PROMPT)
    # a huge LM weight makes the first draft token the LM's own choice among head 0's candidates
    strong = _drafter("neural", drafter.heads, paths=1, lm_model=lm_model)
    strong.weight = 1e3
    strong.begin(ctx)
    first = int(strong.propose(ctx).tokens[0])
    cand, _ = strong.lattice(verifier.hidden.last(2), 1)
    with torch.no_grad():
        lm_logits = lm_model(torch.tensor([PROMPT])).logits[0, -1]
    assert first == max(cand[0].tolist(), key=lambda t: float(lm_logits[t]))
    # beam scores (LM scored through tree forwards on its cache) equal a full recomputation
    cand, logp = drafter.lattice(verifier.hidden.last(2), 4)
    best = drafter._beam_search(PROMPT, cand.tolist(), logp.tolist())
    assert len(best) == 3 and drafter.lm.cache.get_seq_length() == len(PROMPT)
    for score, path in best:
        expect = 0.0
        for i, x in enumerate(path):
            with torch.no_grad():
                lp = lm_model(torch.tensor([PROMPT + list(path[:i])])).logits[0, -1].log_softmax(-1)
            expect += float(logp[i][cand[i].tolist().index(x)]) + drafter.weight * float(lp[x])
        assert math.isclose(score, expect, abs_tol=1e-4)


# ---------------------------------------------------------------- training state
def test_checkpoint_resume_matches_an_uninterrupted_run(cycle_setup, tmp_path):
    root, _, base = cycle_setup
    common = {**base, "steps": 30, "eval_every": 1000, "log_every": 1000}
    straight = train_block(TrainBlockConfig(**common, out=str(tmp_path / "a")), log=lambda *a: None)
    r1 = train_block(TrainBlockConfig(**common, out=str(tmp_path / "b")), until_step=13, log=lambda *a: None)
    assert r1["step"] == 13 and not r1["finished"]
    meta = json.loads((tmp_path / "b" / "train_state" / "trainer.json").read_text())
    assert meta["step"] == 13 and meta["positions_seen"] == 13 * 64
    r2 = train_block(TrainBlockConfig(**common, out=str(tmp_path / "b")), log=lambda *a: None)
    assert r2["step"] == 30 and r2["finished"] and r2["positions_seen"] == straight["positions_seen"]
    a, b = (load_file(str(state_file(tmp_path / run / "train_state",
                                     json.loads((tmp_path / run / "train_state" / "trainer.json").read_text()), "weights")))
            for run in ("a", "b"))
    assert sorted((tmp_path / "b" / "train_state").glob("*.safetensors")) == [  # older steps' files are gone
        tmp_path / "b" / "train_state" / "draft_vocab.safetensors",
        tmp_path / "b" / "train_state" / "model_fp32.step30.safetensors"]
    assert torch.allclose(a["weight"], b["weight"], atol=1e-6) and torch.allclose(a["bias"], b["bias"], atol=1e-6)
    assert math.isclose(straight["val/loss"], r2["val/loss"], rel_tol=1e-4)


def test_config_files_and_pool_entry(cycle_setup, trained, tmp_path):
    root, cmodel, base = cycle_setup
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**base, "out": "x", "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        load_train_block_config(path)
    pool = parse_pool_config({
        "verifier": {"model": base["verifier"], "dtype": "fp32"},
        "drafters": [{"name": "heads", "type": "block", "checkpoint": str(trained[0]), "params": {"refine": "ngram"}}],
    })
    engine = build_engine(pool)
    drafter = engine.drafter("heads")
    assert isinstance(drafter, BlockDrafter) and drafter.hidden_layers == (2,) and drafter.weight == 0.5
    prompt = [0] + cyc(1, 6)
    res = engine.generate(prompt, max_new_tokens=20)
    assert res.token_ids == plain_greedy(cmodel, prompt, 20)
    with pytest.raises(ValueError, match="checkpoint"):
        build_engine(parse_pool_config({"verifier": {"model": base["verifier"], "dtype": "fp32"},
                                        "drafters": [{"name": "h", "type": "block"}]}))


# ---------------------------------------------------------------- batched drafting
@pytest.mark.parametrize("refine", ["none", "ngram", "neural"])
def test_concurrent_requests_run_the_heads_as_one_call_and_decode_as_alone(refine, cycle_setup, trained):
    # the scheduler's batched drafting (core/batching/drafting.py): the heads of four running requests score their
    # four verifier states in ONE call per step (a RowFeed each), and each request's steps are those it takes alone -
    # the same drafts, so the same tokens per step (a row given another request's state would draft its cycle); the
    # neural rescoring LM's forwards (its catch-up, then one per depth over the beams) are one per round for all
    from drafting_helpers import schedule_together

    _, model, _ = cycle_setup
    heads = _heads(model, trained[0])
    lm_model = copy.deepcopy(model)  # an LM that knows the cycles: a row given another request's scores would rank
    drafter = _drafter(refine, heads, paths=2, lm_model=lm_model)  # that request's next token first
    if refine == "neural":
        drafter.weight = 3.0
    engine = Engine(Verifier(model), drafter, check_tokenizers=False)
    prompts = [[0] + cyc(2, 4), [0] + cyc(5, 9), [0] + cyc(0, 2), [0] + cyc(3, 6)]
    max_new = [30, 22, 36, 14]
    alone = [engine.generate(p, n) for p, n in zip(prompts, max_new)]
    rows, lm_rows = [], []
    heads.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    lm_model.register_forward_pre_hook(lambda module, args, kwargs: lm_rows.append(kwargs["input_ids"].shape[0]),
                                       with_kwargs=True)
    results, calls = schedule_together(engine, prompts, max_new, lambda: (len(rows), len(lm_rows)))
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert [r.stats.tokens_per_step for r in results] == [a.stats.tokens_per_step for a in alone]
    assert sum(a.stats.accepted for a in alone) > 40  # the trained heads draft the cycle: acceptance decides
    full = [n for b, n in calls if b == 4]
    assert full and max(h for h, _ in full) == 1 and max(rows) == 4, calls  # one heads call per step for the batch
    if refine == "neural":  # its catch-up and a forward per depth after the first: K forwards a step, shared
        assert max(n for _, n in full) == K and max(lm_rows) == 4, calls
    else:
        assert not lm_rows
