"""Hidden-state drafter (MEDC): greedy identity and sampling exactness through the engine, token-free states,
reuse of earlier states, training/drafting consistency, checkpoints, training and resume, pool configs."""
import json

import pytest
import torch
import yaml

from metasd.config import ConfigError, build_engine, parse_pool_config
from metasd.models.draft_vocab import DraftVocab
from metasd.core.decoding.drafter import StepContext
from metasd.drafters import HiddenStateDrafter
from metasd.drafters.hidden_state_net import HiddenStateConfig, HiddenStateNet, load_checkpoint, save_checkpoint
from metasd.models.packed_weights import group_for
from metasd.core.engine import Engine
from metasd.core.decoding.sampling import SamplingParams
from metasd.training.data import Example
from metasd.training.features import extract_features
from metasd.training.hidden_state import load_train_hidden_state_config, train_hidden_state
from metasd.core import HiddenStore, Verifier
from drafting_helpers import MAX_NEW, PROMPTS, drive_together
from sampling_check import joint_check
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]
RUN = dict(mode="chain", depth=4, nodes=10, k=3)


def _net(vocab=64, hidden=32, layer=2, seed=0):
    torch.manual_seed(seed)
    net = HiddenStateNet(HiddenStateConfig(hidden, vocab, layer, num_heads=4, num_kv_heads=2, intermediate_size=32,
                                           inject_intermediate_size=16))
    torch.nn.init.normal_(net.inject.down.weight, std=0.5)  # make the token injection matter
    return net


@pytest.fixture(scope="module")
def verifier_model():
    return tiny_qwen(seed=0)


def _drafter(model, net=None, **kw):
    return HiddenStateDrafter(net or _net(), model, DraftVocab(torch.arange(50, 2, -1), 64), **{**RUN, **kw})


def _ctx(model, tokens, layer=2, **kw):
    store = HiddenStore([layer])
    with torch.no_grad():
        out = model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
    store.append({layer: out.hidden_states[layer][0]})
    return StepContext(tokens=torch.tensor(tokens), prompt_len=len(tokens), max_depth=8,
                       sampling=kw.pop("sampling", SamplingParams()), hidden=store, **kw)


# ---------------------------------------------------------------- losslessness
@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_identical(verifier_model, mode, reuse):
    drafter = _drafter(verifier_model, mode=mode, reuse=reuse)
    engine = Engine(Verifier(verifier_model), drafter, check_tokenizers=False)
    for n in (1, 7, 40):
        result = engine.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == plain_greedy(verifier_model, PROMPT, n)
        assert result.stats.new_tokens == n == result.stats.committed
    counts = result.stats.drafter_counts[drafter.name]  # the drafter's figures reach the request's record
    assert counts["steps"] == result.stats.steps and (counts["reused_states"] > 0) == reuse


def test_tree_is_beam_expanded_with_one_head_call_per_depth(verifier_model):
    drafter = _drafter(verifier_model, mode="tree", depth=4, nodes=9, k=3)
    rows = []
    head = drafter.head
    drafter.head = lambda x: rows.append(x.shape[0]) or head(x)
    draft = drafter.propose(_ctx(verifier_model, PROMPT))
    assert rows == [1, 3, 3, 3]  # the root, then the k best nodes of each depth, each depth in one call
    assert len(draft) == 9 and 1 <= draft.depth <= 4
    parents = draft.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))  # topological order, a valid tree
    states = drafter.last_states

    def logp(depth, prev):  # [N] draft-vocabulary log-probs at ``depth`` (0-based) after token ``prev``
        emb = drafter.pieces.embed(torch.tensor([prev]), drafter.net.dtype)
        return head(drafter.net.inject(states[depth:depth + 1], emb)).float().log_softmax(-1)[0]

    def path_logp(i):
        chain = []
        while i >= 0:
            chain.append(i)
            i = parents[i]
        lp, prev = 0.0, PROMPT[-1]
        for depth, n in enumerate(reversed(chain)):
            lp += float(logp(depth, prev)[int((drafter.vocab.token_ids == draft.tokens[n]).nonzero())])
            prev = int(draft.tokens[n])
        return lp

    kept = [path_logp(i) for i in range(len(draft))]
    first = sorted(logp(0, PROMPT[-1]).tolist(), reverse=True)
    m = parents.count(-1)  # depth-1 nodes kept: the m best first tokens, and no kept node below the next one
    assert sorted(kept[i] for i in range(len(draft)) if parents[i] < 0) == pytest.approx(sorted(first[:m]), abs=1e-4)
    assert min(kept) >= first[m] - 1e-4 if m < 3 else True
    assert any(p >= 0 for p in parents)  # the tree goes below depth 1


def test_one_token_prompt_drafts_nothing_then_works(verifier_model):
    engine = Engine(Verifier(verifier_model), _drafter(verifier_model), check_tokenizers=False)
    assert engine.generate([5], max_new_tokens=10).token_ids == plain_greedy(verifier_model, [5], 10)


SMALL_V = 8


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_is_exact(mode):
    verifier = tiny_qwen(seed=5, vocab=SMALL_V, logit_scale=4.0)
    vocab = DraftVocab(torch.tensor([3, 1, 0, 6, 5, 2]), SMALL_V)  # 4 and 7 can never be drafted
    drafter = HiddenStateDrafter(_net(vocab=SMALL_V, seed=1), verifier, vocab, mode=mode, depth=2, nodes=5, k=2)
    engine = Engine(Verifier(verifier), drafter, check_tokenizers=False)
    with_probs = 0
    orig = drafter.propose

    def spy(ctx):
        d = orig(ctx)
        nonlocal with_probs
        with_probs += d.probs is not None
        if d.probs is not None:  # full-vocabulary rows, zero outside the draft vocabulary
            assert torch.allclose(d.probs.sum(-1), torch.ones(len(d))) and (d.probs[:, [4, 7]] == 0).all()
        return d

    drafter.propose = spy
    check = joint_check(engine, [1, 2, 3], 1000, length=2)  # rare pairs pooled (sampling_check)
    assert check.pvalue > 1e-3
    assert check.taken_at(1) > 0  # acceptance was exercised
    assert (with_probs > 0) == (mode == "chain")  # chains carry q (rejection sampling), trees sample-and-match


# ---------------------------------------------------------------- token-free states and reuse
def test_states_do_not_depend_on_drafted_tokens(verifier_model):
    tokens = PROMPT + [3, 17, 22]
    net = _net()
    states, drafts = [], []
    for mode, temp, seed in [("chain", 0.0, 0), ("chain", 1.5, 1), ("chain", 1.5, 2), ("tree", 0.0, 0)]:
        d = _drafter(verifier_model, net, mode=mode, depth=5, reuse=False)
        g = torch.Generator().manual_seed(seed)
        ctx = _ctx(verifier_model, tokens, sampling=SamplingParams(temperature=temp), generator=g)
        d.begin(ctx)
        drafts.append(d.propose(ctx).tokens.tolist())
        states.append(d.last_states)
    assert len({tuple(t[:5]) for t in drafts}) >= 3  # different tokens were drafted (and injected) ...
    assert states[0].shape == (5, 32)
    assert all(torch.equal(states[0], s) for s in states[1:])  # ... over the very same states
    # and a different injected pending token leaves the states alone too
    d = _drafter(verifier_model, net, depth=5, reuse=False)
    ctx = _ctx(verifier_model, tokens[:-1] + [40])
    d.begin(ctx)
    d.propose(ctx)
    assert torch.equal(d.last_states, states[0])


def test_drafting_states_equal_unrolled_training_states(verifier_model):
    tokens = PROMPT + [3, 17]
    net = _net()
    d = _drafter(verifier_model, net, depth=4, reuse=False)
    ctx = _ctx(verifier_model, tokens)
    d.begin(ctx)
    d.propose(ctx)
    h = ctx.hidden.get(2)  # rows 0..T-2
    outs = net.unrolled_states(torch.cat([h, torch.zeros(3, 32)]), unroll=3)  # positions beyond: never attended
    t = len(h) - 1  # last real row; depth k+1 state = out[k][t + k]
    expect = torch.stack([outs[k][t + k] for k in range(4)])
    assert torch.allclose(d.last_states, expect, atol=1e-5)


def test_reuse_skips_recomputation(verifier_model):
    runs = {}
    for reuse in (True, False):
        drafter = _drafter(verifier_model, _net(), reuse=reuse)  # same seed: same weights
        forwards = []
        orig = drafter.net.layer.forward
        drafter.net.layer.forward = lambda *a, **kw: forwards.append(a[0].shape[0]) or orig(*a, **kw)
        metas = []
        op = drafter.propose
        drafter.propose = lambda ctx: metas.append(op(ctx)) or metas[-1]
        engine = Engine(Verifier(verifier_model), drafter, check_tokenizers=False)
        result = engine.generate(PROMPT, max_new_tokens=40)
        assert result.token_ids == plain_greedy(verifier_model, PROMPT, 40)
        counts = result.stats.drafter_counts[drafter.name]
        assert len(forwards) == counts["drafter_forwards"] == sum(m.meta["drafter_forwards"] for m in metas)
        runs[reuse] = (len(forwards), counts, metas)
    on, off = runs[True], runs[False]
    drafted = sum(1 for m in off[2] if len(m))  # steps with a draft (the last may have no depth left)
    assert off[1]["reused_states"] == 0 and off[1]["refreshed"] == drafted > 0
    assert on[1]["reused_states"] > 0 and on[0] < off[0]
    # without reuse every step costs one catch-up forward plus one per depth beyond the first
    assert all(m.meta["drafter_forwards"] == m.depth for m in off[2])


def test_reused_state_is_the_rejected_depth_state(verifier_model):
    """After a rejection at depth n_acc+1, the next depth-1 state is the previous draft's depth n_acc+2 state."""
    d = _drafter(verifier_model, depth=4, reuse=True)
    engine = Engine(Verifier(verifier_model), d, check_tokenizers=False)
    seen = []
    op = d.propose

    def spy(ctx):
        draft = op(ctx)
        seen.append((len(ctx.tokens), d.last_states.clone(), draft))
        return draft

    d.propose = spy
    engine.generate(PROMPT, max_new_tokens=30)
    checked = 0
    for (t0, s0, dr0), (t1, s1, dr1) in zip(seen, seen[1:]):
        n_acc = t1 - t0 - 1
        if dr1.meta["reused_states"] and n_acc + 1 < len(s0):
            shared = min(len(s0) - n_acc - 1, len(s1))
            assert dr1.meta["reused_states"] == shared
            assert torch.equal(s1[:shared], s0[n_acc + 1:n_acc + 1 + shared])
            checked += 1
    assert checked > 0


def test_max_stale_forces_refresh(verifier_model):
    d = _drafter(verifier_model, reuse=True, max_stale=0)
    stats = Engine(Verifier(verifier_model), d, check_tokenizers=False).generate(PROMPT, max_new_tokens=20).stats
    counts, drafted = stats.drafter_counts[d.name], stats.position_drafted[0]  # steps whose draft reached depth 1
    assert counts["reused_states"] == 0 and counts["refreshed"] == drafted > 0


# ---------------------------------------------------------------- checkpoints and configs
def test_checkpoint_round_trip(tmp_path, verifier_model):
    net = _net()
    vocab = DraftVocab(torch.arange(50, 2, -1), 64)
    save_checkpoint(tmp_path / "ck", net, vocab, {"defaults": {"mode": "tree", "depth": 3, "nodes": 7, "k": 2}})
    net2, vocab2, meta = load_checkpoint(tmp_path / "ck")
    assert torch.equal(vocab2.token_ids, vocab.token_ids) and meta["defaults"]["nodes"] == 7
    a = HiddenStateDrafter(net, verifier_model, vocab, mode="tree", depth=3, nodes=7, k=2)
    b = HiddenStateDrafter.from_checkpoint(tmp_path / "ck", verifier_model)
    assert (b.mode, b.depth, b.nodes, b.k) == ("tree", 3, 7, 2)
    ctx = _ctx(verifier_model, PROMPT)
    a.begin(ctx)
    b.begin(ctx)
    da, db = a.propose(ctx), b.propose(ctx)
    assert da.tokens.tolist() == db.tokens.tolist() and da.parents.tolist() == db.parents.tolist() and len(da) == 7


def test_int4_checkpoint_round_trip(tmp_path, verifier_model):
    net = _net(hidden=64)
    vocab = DraftVocab(torch.arange(50, 2, -1), 64)
    save_checkpoint(tmp_path / "q4", net, vocab, {"defaults": {"mode": "chain", "depth": 3}}, dtype="int4", group_size=32)
    save_checkpoint(tmp_path / "bf16", net, vocab, {"defaults": {"mode": "chain", "depth": 3}}, dtype=torch.bfloat16)
    sizes = {k: (tmp_path / k / "model.safetensors").stat().st_size for k in ("q4", "bf16")}
    assert sizes["q4"] < 0.45 * sizes["bf16"]
    loaded, _, meta = load_checkpoint(tmp_path / "q4")
    assert meta["weights_dtype"] == "int4" and meta["int4_group_size"] == 32
    for (name, a), b in zip(net.state_dict().items(), loaded.state_dict().values()):
        g = group_for(a, 32, min_numel=0)  # every weight matrix: groups of 32, or 16 where 32 does not divide
        if g:  # 4-bit groups: error at most half a step of (max - min) / 15
            step = (a.reshape(a.shape[0], -1, g).amax(-1) - a.reshape(a.shape[0], -1, g).amin(-1)) / 15
            assert ((a - b).abs().reshape(a.shape[0], -1, g) <= step[..., None] * 0.51 + 1e-2 * step[..., None]).all(), name
        else:
            assert torch.allclose(a, b, atol=1e-2 * a.abs().max().item() + 1e-6), name


def test_argument_errors(tmp_path, verifier_model):
    vocab = DraftVocab.full(64)
    with pytest.raises(ValueError, match="mode"):
        HiddenStateDrafter(_net(), verifier_model, vocab, mode="beam")
    with pytest.raises(ValueError, match="width 48"):
        HiddenStateDrafter(_net(hidden=48), verifier_model, vocab)
    with pytest.raises(ValueError, match="layer 3"):
        HiddenStateDrafter(_net(layer=3), verifier_model, vocab)
    with pytest.raises(ValueError, match="80 tokens"):
        HiddenStateDrafter(_net(vocab=80), verifier_model, DraftVocab.full(80))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, verifier_model):
    root = tmp_path_factory.mktemp("hs")
    verifier_model.save_pretrained(root / "verifier")
    tiny_tokenizer().save_pretrained(root / "verifier")
    save_checkpoint(root / "ckpt", _net(), DraftVocab(torch.arange(50, 2, -1), 64), {"defaults": {"depth": 3}})
    return root


def _pool(root, **entry):
    return parse_pool_config({"verifier": {"model": str(root / "verifier"), "dtype": "fp32", "device": "cpu"},
                              "drafters": [{"name": "hs", "type": "hidden_state", **entry}]})


def test_pool_config_builds_and_errors(tiny_dir):
    engine = build_engine(_pool(tiny_dir, checkpoint="ckpt", params={"mode": "tree", "nodes": 6}), base_dir=tiny_dir)
    d = engine.drafter("hs")
    assert isinstance(d, HiddenStateDrafter) and (d.mode, d.nodes, d.depth) == ("tree", 6, 3)
    assert engine.generate(PROMPT, max_new_tokens=12).token_ids == plain_greedy(engine.verifier.model, PROMPT, 12)
    with pytest.raises(ConfigError, match="drafters.0.checkpoint: drafter type 'hidden_state' needs a checkpoint"):
        _pool(tiny_dir)  # refused when the pool is read, before any model loads
    with pytest.raises(ConfigError, match="drafters.0.model: drafter type 'hidden_state' takes no model"):
        _pool(tiny_dir, checkpoint="ckpt", model="bundled:x")
    with pytest.raises(ConfigError, match="depht"):
        _pool(tiny_dir, checkpoint="ckpt", params={"depht": 3})
    engine = build_engine(_pool(tiny_dir, checkpoint="ckpt", quantize="int8"), base_dir=tiny_dir)
    d = engine.drafter("hs")
    assert d.net.metasd_quantize == "int8" and type(engine.verifier.model.lm_head) is torch.nn.Linear
    assert type(d.head).__name__ == "QuantizedLinear" and d.head.mode == "int8"  # the head slice too, not the verifier's
    assert engine.generate(PROMPT, max_new_tokens=12).token_ids == plain_greedy(engine.verifier.model, PROMPT, 12)


# ---------------------------------------------------------------- training
def test_chain_accepted_counts_leading_hits():
    from metasd.training.hidden_state import chain_accepted

    T, F = True, False
    hits = [torch.tensor([T, T, F, T, T, T]),  # depth 1 at position t
            torch.tensor([F, T, T, F, T, F]),  # depth 2 at position t (anchor t-1)
            torch.tensor([T, T, T, T, T, T])]  # depth 3 at position t (anchor t-2)
    # anchor 0: d1 hits[0][0]=T, d2 hits[1][1]=T, d3 hits[2][2]=T -> 3; anchor 1: T, hits[1][2]=T, T -> 3
    # anchor 2: hits[0][2]=F -> 0; anchor 3: T, hits[1][4]=T, hits[2][5]=T -> 3; anchor 4: T, hits[1][5]=F -> 1
    # anchor 5: T, then past the end -> 1
    assert chain_accepted(hits, torch.arange(6)).tolist() == [3, 3, 0, 3, 1, 1]
    assert chain_accepted(hits[:1], torch.tensor([2, 3])).tolist() == [0, 1]


@torch.no_grad()
def _examples(model, n, seed, prompt_len=6, new=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.zeros(n, 1, dtype=torch.long), torch.randint(6, 64, (n, prompt_len - 1), generator=g)], 1)
    for _ in range(new):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return [Example(s.tolist(), [False] * prompt_len + [True] * new) for s in ids]


@pytest.fixture(scope="module")
def features(tiny_dir, verifier_model):
    extract_features(verifier_model, _examples(verifier_model, 12, 0), tiny_dir / "feat", layers=[1, 2], topk=8,
                     shard_size=4, log=lambda *a: None)
    return tiny_dir


def _train_yaml(root, name, **over):
    cfg = {"features": str(root / "feat"), "verifier": str(root / "verifier"), "out": str(root / name),
           "train_shards": "0-1", "val_shards": "2", "vocab_size": 48, "max_len": 24, "unroll": 2,
           "model": {"num_heads": 4, "num_kv_heads": 2, "intermediate_size": 32, "inject_intermediate_size": 16},
           "optim": {"steps": 12, "lr": 3e-3, "warmup": 1, "sequences_per_step": 2},
           "defaults": {"mode": "chain", "depth": 3}, "log_every": 4, "eval_every": 6, "save_every": 3,
           "val_sequences": 4, "bf16": False, "mlflow": False, "threads": 1, "save_dtype": "fp32"}
    cfg.update(over)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_training_reduces_loss_and_exports(features, verifier_model):
    from metasd.cli import main

    cfg = _train_yaml(features, "trained")
    assert main(["train", "hidden_state", str(cfg), "--set", "keep_best=false"]) == 0
    meta = json.loads((features / "trained" / "config.json").read_text())
    hist = meta["validation"]["history"]
    assert [h["step"] for h in hist] == [0, 6, 12] and meta["training"]["steps"] == 12
    assert hist[-1]["loss_ce"] < hist[0]["loss_ce"] - 0.05
    assert hist[-1]["loss_reg_1"] < hist[0]["loss_reg_1"]
    assert set(hist[-1]) >= {"acc_1", "acc_2", "acc_3", "tau_chain"} and 1.0 <= hist[-1]["tau_chain"] <= 1 + meta["defaults"]["depth"]
    card = (features / "trained" / "MODEL_CARD.md").read_text()
    assert f"{hist[-1]['tau_chain']:.3f}" in card and "metasd train hidden_state" in card
    d = HiddenStateDrafter.from_checkpoint(features / "trained", verifier_model)
    engine = Engine(Verifier(verifier_model), d, check_tokenizers=False)
    assert engine.generate(PROMPT, max_new_tokens=15).token_ids == plain_greedy(verifier_model, PROMPT, 15)


def test_resume_equals_uninterrupted(features, verifier_model):
    from safetensors.torch import load_file

    full = load_train_hidden_state_config(_train_yaml(features, "full", optim={"steps": 6, "lr": 3e-3, "warmup": 1,
                                                                                "sequences_per_step": 2}))
    train_hidden_state(full, verifier_model=verifier_model, log=lambda *a: None)
    parts = full.model_copy(update={"out": str(features / "parts")})
    for stop in (2, 4):
        train_hidden_state(parts, verifier_model=verifier_model, until_step=stop, log=lambda *a: None)
        assert not (features / "parts" / "model.safetensors").exists()
        state = json.loads((features / "parts" / "train_state" / "trainer.json").read_text())
        assert state["step"] == stop
    train_hidden_state(parts, verifier_model=verifier_model, log=lambda *a: None)
    a = load_file(str(features / "full" / "model.safetensors"))
    b = load_file(str(features / "parts" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_state_write_killed_midway_leaves_the_previous_state(features, verifier_model, monkeypatch):
    """Kill (here: an exception) while the optimizer of step 4 is being written: the state of step 2 stays
    the committed one, complete, and a rerun resumes from it to the same weights as an uninterrupted run."""
    from safetensors.torch import load_file

    from metasd.training import common

    cfg = load_train_hidden_state_config(_train_yaml(features, "killed", save_every=2, optim={"steps": 6, "lr": 3e-3, "warmup": 1,
                                                                                                  "sequences_per_step": 2}))
    train_hidden_state(cfg, verifier_model=verifier_model, until_step=2, log=lambda *a: None)
    state_dir = features / "killed" / "train_state"
    committed = json.loads((state_dir / "trainer.json").read_text())
    assert committed["step"] == 2 and (state_dir / committed["files"]["weights"]).exists()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing the optimizer")
    monkeypatch.setattr(common.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        train_hidden_state(cfg, verifier_model=verifier_model, until_step=4, log=lambda *a: None)
    monkeypatch.undo()
    after = json.loads((state_dir / "trainer.json").read_text())
    assert after["step"] == 2 and after["files"] == committed["files"]  # the new weights file is not committed
    for name in committed["files"].values():
        assert (state_dir / name).exists()
    load_file(str(state_dir / committed["files"]["weights"]))  # complete, loadable
    train_hidden_state(cfg, verifier_model=verifier_model, log=lambda *a: None)
    whole = cfg.model_copy(update={"out": str(features / "whole")})
    train_hidden_state(whole, verifier_model=verifier_model, log=lambda *a: None)
    a, b = load_file(str(features / "killed" / "model.safetensors")), load_file(str(features / "whole" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_training_config_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"features": "x", "verifier": "y", "out": "z", "optim": {"stepz": 3}}))
    with pytest.raises(ValueError, match="optim.stepz"):
        load_train_hidden_state_config(path)
    path.write_text(yaml.safe_dump({"features": "x", "verifier": "y", "out": "z"}))
    assert load_train_hidden_state_config(path, ["optim.steps=7", "defaults.reuse=false"]).optim.steps == 7
    with pytest.raises(ValueError, match="reg_loss"):
        load_train_hidden_state_config(path, ["reg_loss=huber"])


def test_training_config_paths_expand_environment_variables(tmp_path, monkeypatch):
    path = tmp_path / "env.yaml"
    path.write_text("features: ${METASD_DATA}/feats\nverifier: y\nout: $OUT_ROOT/ck\n")
    monkeypatch.setenv("METASD_DATA", "/data/sets")
    monkeypatch.setenv("OUT_ROOT", "runs")
    cfg = load_train_hidden_state_config(path)
    assert (cfg.features, cfg.out) == ("/data/sets/feats", "runs/ck")
    monkeypatch.delenv("METASD_DATA")
    with pytest.raises(ValueError, match=r"(?s)env.yaml.*features.*METASD_DATA.*not set"):
        load_train_hidden_state_config(path)


# ---------------------------------------------------------------- batched drafting


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_drafts_made_side_by_side_equal_drafts_made_alone(verifier_model, mode):
    # four requests' drafting loops advanced together: their recurrence steps packed into one step (pasts of different
    # lengths side by side, a block-diagonal mask) and their head calls stacked; every draft and every depth state is
    # what the request drafts alone, in D + D calls for the four instead of 4 (D + D)
    drafter = _drafter(verifier_model, mode=mode, depth=4, nodes=9, k=3)
    ctxs = [_ctx(verifier_model, p) for p in PROMPTS]
    alone = [drafter.fork() for _ in PROMPTS]
    expected = [d.propose(ctx) for d, ctx in zip(alone, ctxs)]
    together = [drafter.fork() for _ in PROMPTS]
    layer_rows = []
    drafter.net.layer.register_forward_pre_hook(lambda module, args: layer_rows.append(args[0].shape[0]))
    drafts, calls = drive_together([d.drafting(ctx) for d, ctx in zip(together, ctxs)])
    for got, want, a, t in zip(drafts, expected, alone, together):
        assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
        assert torch.allclose(t.last_states, a.last_states, atol=1e-5)
        assert got.meta["drafter_forwards"] == want.meta["drafter_forwards"] == 4
    assert len(calls) == 8 and set(calls) == {4}, calls  # 4 recurrence steps, then 4 head calls, each for all four
    assert layer_rows[0] == sum(len(p) - 1 for p in PROMPTS)  # the refresh: every request's real states, packed


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_concurrent_requests_share_the_recurrence_and_decode_as_alone(verifier_model, mode):
    from drafting_helpers import schedule_together
    drafter = _drafter(verifier_model, mode=mode)
    engine = Engine(Verifier(verifier_model), drafter, check_tokenizers=False)
    alone = [engine.generate(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    layer_rows = []
    drafter.net.layer.register_forward_pre_hook(lambda module, args: layer_rows.append(args[0].shape[0]))
    results, steps = schedule_together(engine, PROMPTS, MAX_NEW, lambda: len(layer_rows))
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert [r.stats.tokens_per_step for r in results] == [a.stats.tokens_per_step for a in alone]
    full = [n for b, n in steps if b == 4]
    assert full and max(full) <= RUN["depth"] and max(layer_rows) >= 4, steps  # one recurrence step per depth
