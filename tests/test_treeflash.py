"""TreeFlash drafter: tree construction on hand-built tables, tree masks and positions, greedy identity in
every mode (untrained and trained), sampling exactness through the engine, training resume, configs."""
import json
import math

import pytest
import torch
import yaml

from metasd.models.draft_vocab import DraftVocab
from metasd.drafters import TreeFlashDrafter
from metasd.drafters.treeflash import TransitionTable, build_tree, marginal_tables, treeflash_tables
from metasd.drafters.treeflash_backbone import TreeFlashConfig, TreeFlashModel, final_norm_of
from metasd.core.engine import Engine
from metasd.training.data import Example
from metasd.training.features import extract_features
from metasd.training.treeflash import load_train_treeflash_config
from metasd.training.treeflash_objective import tf_accept
from metasd.core.execution.tree import Draft, ancestor_mask, node_depths
from metasd.core.execution.verifier import Verifier
from metasd.core.execution.kv_cache import cache_kwargs
from sampling_check import joint_check
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]
MODES = ["chain", "marginal", "treeflash"]
MLFLOW = True
LN = math.log


def _table(tokens, probs, next_src):
    return TransitionTable(torch.tensor(tokens), torch.tensor(probs).log(), torch.tensor(next_src))


# ---------------------------------------------------------------- tree construction
def test_best_first_order_sibling_and_child_pushes():
    # depth 1 (root): 10 (0.6, in the marginal top-m of depth 1 as candidate 0), 11 (0.4, not in top-m)
    # depth 2, previous token 10: 20 (0.5), 21 (0.3)
    tables = [_table([[10, 11]], [[0.6, 0.4]], [[0, -1]]),
              _table([[20, 21]], [[0.5, 0.3]], [[-1, -1]])]
    tokens, parents, scores = build_tree(tables, tree_size=10)
    # pop 10 -> push sibling 11 (0.4) and child 20 (0.3); pop 11 -> no sibling, no child (not in top-m);
    # pop 20 -> push sibling 21 (0.18); pop 21
    assert tokens == [10, 11, 20, 21] and parents == [-1, -1, 0, 0]
    assert scores == pytest.approx([LN(0.6), LN(0.4), LN(0.3), LN(0.18)])
    assert build_tree(tables, tree_size=3)[:2] == ([10, 11, 20], [-1, -1, 0])
    assert build_tree(tables, tree_size=1)[:2] == ([10], [-1])


def test_top_m_rule_blocks_children_even_for_likely_tokens():
    # depth-1 token 11 is very likely but not a marginal top-m candidate of depth 1: it never gets children
    tables = [_table([[11, 10]], [[0.9, 0.1]], [[-1, 1]]),
              _table([[30, 31], [20, 21]], [[0.5, 0.5], [0.99, 0.01]], [[-1, -1], [-1, -1]])]
    tokens, parents, _ = build_tree(tables, tree_size=10)
    assert tokens == [11, 10, 20, 21] and parents == [-1, -1, 1, 1]  # 10's children come from table row 1


def _all_paths(tables):
    """Every node the search may create: (score, path of (depth, src, rank))."""
    out = []

    def walk(d, src, prefix, score):
        t = tables[d]
        for c in range(t.tokens.shape[1]):
            s = score + float(t.logp[src, c])
            path = prefix + [(d, src, c)]
            out.append((s, path))
            nxt = int(t.next_src[src, c])
            if d + 1 < len(tables) and nxt >= 0:
                walk(d + 1, nxt, path, s)

    walk(0, 0, [], 0.0)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_best_first_tree_is_the_top_n_paths(seed):
    g = torch.Generator().manual_seed(seed)
    m, k, D, V = 3, 3, 4, 12
    cand = torch.stack([torch.randperm(V, generator=g)[:m] for _ in range(D)])
    cond = [torch.randn(1 if d == 0 else m, V, generator=g).mul(2).log_softmax(-1) for d in range(D)]
    tables = treeflash_tables(cand[:D - 1], cond, k)
    paths = sorted(_all_paths(tables), key=lambda p: -p[0])
    for n in (1, 5, 17, 40):
        _, parents, scores = build_tree(tables, tree_size=n)
        expect = [s for s, _ in paths[:n]]
        assert scores == pytest.approx(expect)
        assert all(p < i for i, p in enumerate(parents))
        # scores are path sums: child = parent + log q
        for i, p in enumerate(parents):
            if p >= 0:
                assert scores[i] < scores[p]


def test_treeflash_tables_apply_the_top_m_rule():
    cand = torch.tensor([[5, 2]])  # depth-1 marginal top-2
    cond = [torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0, 0.4]]).clamp(min=1e-9).log(),  # root -> 5, 2, 1
            torch.full((2, 6), 1 / 6).log()]
    tables = treeflash_tables(cand, cond, k=3)
    assert tables[0].tokens.tolist() == [[5, 2, 1]]
    assert tables[0].next_src.tolist() == [[0, 1, -1]]  # 5 is candidate 0, 2 candidate 1, 1 none
    assert (tables[1].next_src == -1).all()  # the last depth has no children


def test_marginal_tree_shares_next_depth_distribution():
    logp = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]).log()
    tokens, parents, _ = build_tree(marginal_tables(logp, k=2), tree_size=100)
    assert len(tokens) == 2 + 4 + 8
    kids = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(tokens[i])
    assert all(sorted(v) == [0, 1] for v in kids.values())


def test_tree_mask_and_positions_match_path_forwards():
    model = tiny_qwen(seed=0)
    tables = [_table([[10, 11, 12]], [[0.5, 0.3, 0.2]], [[0, 1, -1]]),
              _table([[20, 21], [22, 23]], [[0.6, 0.4], [0.7, 0.3]], [[0, -1], [-1, -1]]),
              _table([[30, 31]], [[0.8, 0.2]], [[-1, -1]])]
    tokens, parents, _ = build_tree(tables, tree_size=9)
    draft = Draft(tokens, parents)
    depth = node_depths(draft.parents)
    assert int(depth.max()) == 3
    mask = ancestor_mask(draft.parents)
    for i in range(len(tokens)):  # row i+1 sees the root, itself and exactly its ancestors
        anc, p = {0, i + 1}, parents[i]
        while p >= 0:
            anc.add(p + 1)
            p = parents[p]
        assert set(mask[i + 1].nonzero().flatten().tolist()) == anc
        assert len(anc) - 1 == int(depth[i])
    verifier = Verifier(model)
    verifier.prefill(torch.tensor(PROMPT[:-1]))
    logits = verifier.verify(PROMPT[-1], draft).logits
    for i in range(len(tokens)):
        path, p = [], i
        while p >= 0:
            path.insert(0, tokens[p])
            p = parents[p]
        with torch.no_grad():
            ref = model(torch.tensor([PROMPT + path])).logits[0, -1]
        assert torch.allclose(logits[i + 1], ref, atol=1e-4)


def test_teacher_forced_acceptance_walk():
    tokens, parents = [1, 2, 3, 4], [-1, -1, 1, 2]  # root -> 1, 2; 2 -> 3 -> 4
    assert tf_accept(tokens, parents, [2, 3, 4], [True] * 3, [2, 3, 4]) == (3, 3)
    assert tf_accept(tokens, parents, [2, 3, 4], [True] * 3, [2, 9, 4]) == (3, 2)
    assert tf_accept(tokens, parents, [2, 3, 4], [True, True, False], [2, 3, 4]) == (2, 2)
    assert tf_accept(tokens, parents, [5, 3, 4], [True] * 3, [5, 3, 4]) == (0, 0)


# ---------------------------------------------------------------- the drafter on tiny models
def _tiny_cfg(vocab=64, hidden=32, block=5, layers=(1, 2), output_norm="verifier", extras=False):
    """extras: the options the real recipe uses (own norm, per-layer context norm, last state, output skip)."""
    more = dict(output_norm="own", context_layer_norm=True, last_state=True, output_skip_layer=2) if extras else {}
    return TreeFlashConfig(verifier_hidden_size=hidden, verifier_vocab_size=vocab, context_layers=list(layers),
                           hidden_size=16, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=32,
                           ar_intermediate_size=16, block_size=block, context_window=16,
                           **({"output_norm": output_norm} | more))


def _untrained(seed=0, **kw):
    torch.manual_seed(seed)
    m = TreeFlashModel(_tiny_cfg(**kw))
    torch.nn.init.normal_(m.ar.down.weight, std=0.5)  # make the AR correction matter
    return m


@pytest.fixture(scope="module")
def verifier_model():
    return tiny_qwen(seed=0)


def _check_greedy(model, drafter, ns=(1, 7, 40)):
    engine = Engine(Verifier(model), drafter, check_tokenizers=False)
    for n in ns:
        result = engine.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == plain_greedy(model, PROMPT, n)
        assert result.stats.new_tokens == n == result.stats.committed
    return result


@pytest.mark.parametrize("variant", ["plain", "extras"])
@pytest.mark.parametrize("mode", MODES)
def test_untrained_greedy_identical(verifier_model, mode, variant):
    vocab = DraftVocab(torch.arange(50, 2, -1), 64)  # reduced and permuted
    drafter = TreeFlashDrafter(_untrained(extras=variant == "extras"), verifier_model, vocab, mode=mode, m=3, k=3,
                               tree_size=12)
    _check_greedy(verifier_model, drafter)


def test_drafter_shapes_and_context_cache(verifier_model):
    drafter = TreeFlashDrafter(_untrained(extras=True), verifier_model, DraftVocab.full(64), mode="treeflash", m=2,
                               k=2, tree_size=7, block_size=4)
    engine = Engine(Verifier(verifier_model), drafter, check_tokenizers=False)
    drafts = []
    orig = drafter.propose
    drafter.propose = lambda ctx: drafts.append(orig(ctx)) or drafts[-1]
    result = engine.generate(PROMPT, max_new_tokens=20)
    assert result.token_ids == plain_greedy(verifier_model, PROMPT, 20)
    assert drafts and all(len(d) <= 7 and d.depth <= 3 and d.probs is None for d in drafts)
    assert drafter._ctx_rows == 0 and drafter._ctx_kv is None  # end() freed the request state
    # context keys/values built incrementally equal a fresh projection of every row
    from metasd.core.decoding.drafter import StepContext
    from metasd.core.decoding.sampling import SamplingParams
    from metasd.core import HiddenStore

    tokens = PROMPT + result.token_ids
    store = HiddenStore(drafter.hidden_layers)
    with torch.no_grad():
        out = verifier_model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
    store.append({l: out.hidden_states[l][0] for l in drafter.hidden_layers})
    ctx = StepContext(tokens=torch.tensor(tokens), prompt_len=len(PROMPT), max_depth=3, sampling=SamplingParams(),
                      hidden=store)
    drafter.begin(ctx)
    h_fresh = drafter.block_states(ctx)
    drafter.begin(ctx)
    for cut in (len(PROMPT), len(PROMPT) + 5, len(tokens)):
        sub = StepContext(tokens=torch.tensor(tokens[:cut]), prompt_len=len(PROMPT), max_depth=3,
                          sampling=SamplingParams(), hidden=store)
        h_inc = drafter.block_states(sub)
    assert torch.allclose(h_fresh, h_inc, atol=1e-5)


# ---------------------------------------------------------------- training (module fixture) and trained drafters
@torch.no_grad()
def _examples(model, n, seed, prompt_len=6, new=40):
    """n random prompts and the verifier's greedy continuations (one batched cached loop)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.zeros(n, 1, dtype=torch.long), torch.randint(6, 64, (n, prompt_len - 1), generator=g)], 1)
    out = model(ids, use_cache=True)
    cache, seqs = out.past_key_values, ids
    for _ in range(new):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seqs = torch.cat([seqs, nxt], 1)
        out = model(nxt, **cache_kwargs(model, cache), use_cache=True)
    return [Example(s.tolist(), [False] * prompt_len + [True] * new) for s in seqs]


def _train_yaml(root, name, **over):
    cfg = {"features": str(root / "feat"), "verifier": str(root / "verifier"), "out": str(root / name),
           "train_shards": "0-2", "val_shards": "3", "vocab_size": 48, "target": "verifier",
           "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 32,
                     "ar_intermediate_size": 16, "block_size": 5, "context_window": 16},
           "stage1": {"steps": 40, "lr": 5e-3, "warmup": 2, "sequences_per_step": 2, "anchors_per_sequence": 8},
           "stage2": {"steps": 20, "lr": 5e-3, "warmup": 2, "sequences_per_step": 2, "anchors_per_sequence": 8},
           "defaults": {"mode": "treeflash", "m": 3, "k": 3, "tree_size": 12},
           "log_every": 10, "eval_every": 20, "save_every": 7, "val_anchors": 32, "val_tree_anchors": 16,
           "bf16": False, "mlflow": False, "threads": 1, "save_dtype": "fp32"}
    cfg.update(over)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, verifier_model):
    """Features of the tiny verifier, its HF directory, and a drafter trained through the CLI with MLflow."""
    from metasd.cli import main

    root = tmp_path_factory.mktemp("treeflash")
    verifier_model.save_pretrained(root / "verifier")
    tiny_tokenizer().save_pretrained(root / "verifier")
    extract_features(verifier_model, _examples(verifier_model, 32, 0), root / "feat", layers=[1, 2], topk=8,
                     shard_size=8, log=lambda *a: None)
    cfg = _train_yaml(root, "ckpt", mlflow=MLFLOW, run_name="tiny")
    raw = yaml.safe_load(cfg.read_text())
    raw["model"].update(output_norm="own", context_layers=[1, 2], output_skip_layer=2)
    cfg.write_text(yaml.safe_dump(raw))
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    try:
        assert main(["train", "treeflash", str(cfg)]) == 0
    finally:
        mp.undo()
    return root


def test_training_writes_checkpoint_and_mlflow(trained):
    ckpt = trained / "ckpt"
    meta = json.loads((ckpt / "config.json").read_text())
    assert meta["format"] == "metasd-treeflash" and meta["model"]["context_layers"] == [1, 2]
    assert (ckpt / "MODEL_CARD.md").read_text().startswith("# TreeFlash drafter")
    untrained, stage1, stage2 = meta["validation"]["stages"]
    assert (untrained["stage"], stage1["stage"], stage2["stage"]) == (0, 1, 2)
    assert stage1["loss_marg"] < untrained["loss_marg"] - 0.05  # stage 1 trains the marginals
    assert stage2["loss_marg"] == stage1["loss_marg"]  # stage 2 leaves the backbone alone
    assert stage2["loss_ar"] < stage1["loss_ar"] - 0.02 and stage2["acc_ar"] > stage1["acc_ar"]  # and trains the AR MLP
    final = meta["validation"]["final"]
    assert final["tau_argmax_marg_tf"] >= 1.0 and final["nodes_treeflash"] <= 12
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{trained / 'mlflow.db'}")
    run = client.get_run(meta["training"]["mlflow_run_id"])
    assert "train/loss_stage1" in run.data.metrics and "final/tau_treeflash_tf" in run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "train/loss_stage1")) >= 4


@pytest.mark.parametrize("mode", MODES)
def test_trained_greedy_identical(trained, verifier_model, mode):
    drafter = TreeFlashDrafter.from_checkpoint(trained / "ckpt", verifier_model, mode=mode)
    assert drafter.m == 3 and drafter.tree_size == 12  # checkpoint defaults
    _check_greedy(verifier_model, drafter)


def test_pool_config_builds_treeflash(trained, tokenizer):
    pool = {"verifier": {"model": str(trained / "verifier"), "dtype": "fp32"},
            "drafters": [{"name": "tf", "type": "treeflash", "checkpoint": "ckpt",
                          "params": {"mode": "marginal", "block_size": 4, "tree_size": 9}}]}
    path = trained / "pool.yaml"
    path.write_text(yaml.safe_dump(pool))
    engine = Engine.from_config(path)
    d = engine.drafter("tf")
    assert (d.mode, d.block_size, d.tree_size, d.k) == ("marginal", 4, 9, 3)
    result = engine.generate(PROMPT, max_new_tokens=12)
    assert result.token_ids == plain_greedy(engine.verifier.model, PROMPT, 12)
    from metasd.config import ConfigError

    pool["drafters"][0]["params"] = {"depth": 3}
    path.write_text(yaml.safe_dump(pool))
    with pytest.raises(ConfigError, match="depth"):
        Engine.from_config(path)
    pool["drafters"][0]["params"] = {"block_size": 9}
    path.write_text(yaml.safe_dump(pool))
    with pytest.raises(ConfigError, match="block_size"):
        Engine.from_config(path)


def test_resume_equals_uninterrupted(trained):
    from metasd.cli import main
    from safetensors.torch import load_file

    full = _train_yaml(trained, "full", stage1={"steps": 6, "lr": 5e-3, "warmup": 1, "sequences_per_step": 2,
                                                "anchors_per_sequence": 4},
                       stage2={"steps": 5, "lr": 5e-3, "warmup": 1, "sequences_per_step": 2, "anchors_per_sequence": 4},
                       save_every=2, eval_every=3, val_tree_anchors=4)
    raw = yaml.safe_load(full.read_text())
    raw["out"] = str(trained / "parts")
    parts = trained / "parts.yaml"
    parts.write_text(yaml.safe_dump(raw))
    assert main(["train", "treeflash", str(full)]) == 0
    for stop in (3, 6, 8):  # mid stage 1, at the stage boundary, mid stage 2
        assert main(["train", "treeflash", str(parts), "--until-step", str(stop)]) == 0
        assert not (trained / "parts" / "model.safetensors").exists()
    assert main(["train", "treeflash", str(parts)]) == 0
    a, b = load_file(str(trained / "full" / "model.safetensors")), load_file(str(trained / "parts" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma = json.loads((trained / "full" / "metrics.json").read_text())
    mb = json.loads((trained / "parts" / "metrics.json").read_text())
    assert ma == mb


def test_training_config_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"features": "x", "verifier": "y", "out": "z", "stage1": {"stepz": 3}}))
    with pytest.raises(ValueError, match="stage1.stepz"):
        load_train_treeflash_config(path)
    path.write_text(yaml.safe_dump({"features": "x", "verifier": "y", "out": "z", "target": "nope"}))
    with pytest.raises(ValueError, match="target"):
        load_train_treeflash_config(path)


def test_drafter_argument_errors(verifier_model):
    vocab = DraftVocab.full(64)
    with pytest.raises(ValueError, match="mode"):
        TreeFlashDrafter(_untrained(), verifier_model, vocab, mode="beam")
    with pytest.raises(ValueError, match="block_size"):
        TreeFlashDrafter(_untrained(), verifier_model, vocab, block_size=6)
    with pytest.raises(ValueError, match="width"):
        TreeFlashDrafter(_untrained(hidden=48), verifier_model, vocab)
    with pytest.raises(ValueError, match="context layers"):
        TreeFlashDrafter(_untrained(layers=(1, 3)), verifier_model, vocab)
    with pytest.raises(ValueError, match="output_norm"):
        _tiny_cfg(output_norm="layer")
    with pytest.raises(ValueError, match="output_skip_layer"):
        TreeFlashConfig(verifier_hidden_size=32, verifier_vocab_size=64, context_layers=[1], output_skip_layer=2)

    class NoNorm(torch.nn.Module):
        base_model = torch.nn.Module()

    with pytest.raises(ValueError, match="final norm"):
        final_norm_of(NoNorm())


# ---------------------------------------------------------------- sampling exactness
SMALL_V = 8


def test_tree_sample_and_match_is_exact():
    verifier = tiny_qwen(seed=5, vocab=SMALL_V, logit_scale=4.0)
    cfg = _tiny_cfg(vocab=SMALL_V, block=3)
    torch.manual_seed(1)
    model = TreeFlashModel(cfg)
    torch.nn.init.normal_(model.ar.down.weight, std=0.5)
    vocab = DraftVocab(torch.tensor([3, 1, 0, 6, 5, 2]), SMALL_V)  # 4 and 7 can never be drafted
    drafter = TreeFlashDrafter(model, verifier, vocab, mode="treeflash", m=2, k=3, tree_size=6)
    engine = Engine(Verifier(verifier), drafter, check_tokenizers=False)
    check = joint_check(engine, [1, 2, 3], 1000, length=2)  # rare pairs pooled (sampling_check)
    assert check.pvalue > 1e-3
    assert check.taken_at(1) > 0  # some steps did accept a draft token (the test exercises acceptance)


@pytest.mark.parametrize("tied", [False, True])
def test_training_loads_only_the_verifier_parts_it_needs(tmp_path, tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from metasd.training.common import load_verifier_parts

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied)
    full = Qwen2ForCausalLM(cfg)
    full.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    part = load_verifier_parts(str(tmp_path))
    for a, b in [(part.get_input_embeddings().weight, full.get_input_embeddings().weight),
                 (part.get_output_embeddings().weight, full.get_output_embeddings().weight),
                 (part.model.norm.weight, full.model.norm.weight)]:
        assert torch.equal(a, b.to(torch.bfloat16))
    assert part.model.layers[0].mlp.up_proj.weight.is_meta  # the rest is never read from disk


# ---------------------------------------------------------------- batched drafting
@pytest.mark.parametrize("mode", MODES)
def test_blocks_of_four_requests_run_as_one_forward_and_draft_as_alone(verifier_model, mode):
    # four requests' drafting loops advanced together (as the scheduler does): their blocks run as ONE backbone
    # forward, each over its own context (contexts of 2..10 rows, padded and masked), and every draft is the one the
    # request makes alone
    from drafting_helpers import PROMPTS, drive_together
    from metasd.core import HiddenStore
    from metasd.core.decoding.drafter import StepContext
    from metasd.core.decoding.sampling import SamplingParams

    drafter = TreeFlashDrafter(_untrained(extras=True), verifier_model, DraftVocab(torch.arange(50, 2, -1), 64),
                               mode=mode, m=3, k=3, tree_size=12)

    def ctx(tokens):
        store = HiddenStore(drafter.hidden_layers)
        with torch.no_grad():
            out = verifier_model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        store.append({layer: out.hidden_states[layer][0] for layer in drafter.hidden_layers})
        return StepContext(tokens=torch.tensor(tokens), prompt_len=len(tokens), max_depth=8,
                           sampling=SamplingParams(), hidden=store)

    ctxs = [ctx(p) for p in PROMPTS]
    expected = [drafter.fork().propose(c) for c in ctxs]
    blocks = []
    drafter.model.register_forward_pre_hook(lambda module, args: blocks.append(args[0].shape[0]))
    drafts, calls = drive_together([drafter.fork().drafting(c) for c in ctxs])
    # one projection of the four requests' new context rows, one backbone forward for the four blocks, one call of the
    # logits over their rows, one AR pass (treeflash mode) or one host read of the four chains (chain mode)
    assert blocks == [4] and calls == [4, 4, 4] + [4] * (mode in ("treeflash", "chain")), (blocks, calls)
    for got, want in zip(drafts, expected):
        assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
        assert len(got) > 1


def test_concurrent_requests_share_the_block_forward_and_decode_as_alone(verifier_model):
    from drafting_helpers import MAX_NEW, PROMPTS, schedule_together

    drafter = TreeFlashDrafter(_untrained(extras=True), verifier_model, DraftVocab(torch.arange(50, 2, -1), 64),
                               mode="treeflash", m=3, k=3, tree_size=12)
    engine = Engine(Verifier(verifier_model), drafter, check_tokenizers=False)
    alone = [engine.generate(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    blocks, ar_rows, projected = [], [], []
    drafter.model.register_forward_pre_hook(lambda module, args: blocks.append(args[0].shape[0]))
    drafter.model.ar.register_forward_pre_hook(lambda module, args: ar_rows.append(args[0].shape[0]))
    drafter.model.fc.register_forward_pre_hook(lambda module, args: projected.append(args[0].shape[0]))
    results, steps = schedule_together(engine, PROMPTS, MAX_NEW, lambda: (len(blocks), len(ar_rows), len(projected)))
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert [r.stats.tokens_per_step for r in results] == [a.stats.tokens_per_step for a in alone]
    full = [n for b, n in steps if b == 4]
    # one block forward, one AR pass and one context projection per step for the whole batch (the AR pass over every
    # request's candidates, the projection over every request's new rows)
    assert full and max(n[0] for n in full) == 1 and max(blocks) == 4, steps
    assert max(n[1] for n in full) == 1 and max(ar_rows) > 1 + 3 * (drafter.block_size - 2), (steps, ar_rows)
    assert max(n[2] for n in full) == 1 and max(projected) > max(len(p) for p in PROMPTS), (steps, projected)
