"""SD² steered drafter on tiny models: no-op at init, guide timing, training (agreement, acceptance,
resume, MLflow), checkpoint loading from a pool config, config errors."""
import argparse
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from metasd.config import ConfigError as PoolConfigError
from metasd.config import load_pool
from metasd.core.decoding.drafter import BuildContext, StepContext
from metasd.drafters import PretrainedDrafter, PretrainedTreeDrafter, SteeredDrafter, SteeredTreeDrafter
from metasd.drafters.steered import SteeringModule, decoder_layers, load_steering
from metasd.core.engine import Engine
from metasd.core.decoding.sampling import SamplingParams
from metasd.training.data import Example
from metasd.training.features import extract_features
from metasd.training.steering import ConfigError, SteeringTrainer, parse_config, train_steering
from metasd.training.steering_cli import add_train_steering_parser
from metasd.core import HiddenStore, Verifier
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

GUIDE = [1, 2, 3]  # hidden_states of the 4-layer tiny verifier (low, mid, high)
K = 3
PROMPT_LEN, RESPONSE_LEN = 6, 24


@pytest.fixture(scope="module")
def verifier_model():
    return tiny_qwen(seed=0, layers=4, logit_scale=4.0)


@pytest.fixture(scope="module")
def drafter_model():
    return tiny_qwen(seed=1, layers=2)


@pytest.fixture(scope="module")
def examples(verifier_model):
    """Verifier-generated (greedy) responses to random prompts: the training distribution."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(16):
        prompt = [0] + torch.randint(6, 64, (PROMPT_LEN - 1,), generator=g).tolist()
        response = plain_greedy(verifier_model, prompt, RESPONSE_LEN)
        out.append(Example(prompt + response, [False] * PROMPT_LEN + [True] * RESPONSE_LEN))
    return out


@pytest.fixture(scope="module")
def features(verifier_model, examples, tmp_path_factory):
    path = tmp_path_factory.mktemp("features")
    extract_features(verifier_model, examples, path, layers=[1, 2, 3, 4], topk=8, shard_size=8, log=lambda *a: None)
    return path


def _config(features, out_dir, **sections):
    raw = {"drafter": "unused (tests pass the model)", "out_dir": str(out_dir),
           "data": {"features": str(features), "train_shards": [0, 1], "val_shards": [0, 1], "val_sequences": 16},
           "steering": {"guide_layers": GUIDE},
           "train": {"steps": 40, "batch_size": 4, "lr": 3e-2, "k": K, "dtype": "fp32"},
           "log": {"mlflow": False, "val_every": 20, "log_every": 10, "checkpoint_every": 20}}
    for name, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(name, {}).update(values)
        else:
            raw[name] = values
    return parse_config(raw)


@pytest.fixture(scope="module")
def trained(features, drafter_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    tr = train_steering(_config(features, out), model=drafter_model, log=lambda *a: None)
    return tr


def _random_module(drafter_model, **kw):
    module = SteeringModule.for_models(drafter_model, 32, guide_layers=GUIDE, **kw)
    with torch.no_grad():
        module.proj.weight.normal_(0, 0.3)
    return module


def _capture_logits(model):
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    return seen, handle


@pytest.mark.parametrize("kw", [dict(), dict(rank=4, layers=1), dict(injection="mlp_out"), dict(guide_norm="standardize")],
                         ids=["full", "lowrank-last1", "mlp_out", "standardize"])
def test_untrained_module_leaves_drafter_unchanged(verifier_model, drafter_model, kw):
    prompt = [0, 7, 12, 9, 33, 12, 9, 41, 5]
    steered = SteeredDrafter(drafter_model, steering=SteeringModule.for_models(drafter_model, 32, guide_layers=GUIDE, **kw), k=4)
    plain = PretrainedDrafter(drafter_model, k=4)  # the same model object: the hooks are shared
    runs = {}
    for name, drafter in (("steered", steered), ("plain", plain)):
        seen, handle = _capture_logits(drafter_model)
        engine = Engine(Verifier(verifier_model), drafter, check_tokenizers=False)
        greedy = engine.generate(prompt, max_new_tokens=30)
        sampled = engine.generate(prompt, max_new_tokens=30, temperature=1.0, seed=3)
        handle.remove()
        runs[name] = (greedy.token_ids, greedy.stats.tokens_per_step, sampled.token_ids, sampled.stats.tokens_per_step, seen)
    assert steered.hidden_layers == tuple(GUIDE)
    assert runs["steered"][:4] == runs["plain"][:4]
    assert len(runs["steered"][4]) == len(runs["plain"][4]) > 0
    assert all(torch.equal(a, b) for a, b in zip(runs["steered"][4], runs["plain"][4]))  # bit-identical logits
    steered.close()


def test_guide_timing_hand_built(drafter_model):
    """Which verifier row steers each fed drafter position, recorded by ``trace`` and checked against the
    biases actually added to up_proj (captured by a second hook)."""
    module = _random_module(drafter_model)
    sd = SteeredDrafter(drafter_model, steering=module, k=K)
    up = decoder_layers(drafter_model)[0].mlp.up_proj
    added = []
    handle = up.register_forward_hook(lambda m, a, out: added.append((out - F.linear(a[0], m.weight))[0].detach()))
    g = torch.Generator().manual_seed(0)
    store = HiddenStore(GUIDE)

    def commit_rows(n):  # the verifier states of n newly cached positions
        store.append({layer: torch.randn(n, 32, generator=g) for layer in GUIDE})

    def step(tokens):
        sd.steering.trace, added[:] = [], []
        ctx = StepContext(tokens=torch.tensor(tokens), prompt_len=PROMPT_LEN, max_depth=10, sampling=SamplingParams(),
                          hidden=store)
        draft = sd.propose(ctx).tokens.tolist()
        # every fed position got exactly the bias of its recorded guide row (or none)
        deltas = torch.cat(added)
        assert len(deltas) == len(sd.steering.trace)
        for (pos, tok, row), d in zip(sd.steering.trace, deltas):
            want = torch.zeros_like(d) if row is None else module(module.guide_input(store, row))[0]
            torch.testing.assert_close(d, want, rtol=1e-5, atol=1e-5)
        return draft, [(p, r) for p, _, r in sd.steering.trace], [t for _, t, _ in sd.steering.trace]

    prompt = [0, 11, 12, 13, 14, 15]
    commit_rows(PROMPT_LEN - 1)  # the verifier prefill caches the prompt but its last token
    sd.begin(None)
    # step 1: prompt prefill unsteered; the last prompt token (pending) and the drafts use row 4 (= T-2)
    d1, trace, fed = step(prompt)
    assert trace == [(0, None), (1, None), (2, None), (3, None), (4, None), (5, 4), (6, 4), (7, 4)]
    assert fed == prompt + d1[:2]
    # step 2: 1 of 3 accepted, bonus b: d1[0] at position 6 keeps row 4's keys; only the bonus is re-fed
    b = (d1[1] + 1) % 64
    tokens = prompt + [d1[0], b]
    commit_rows(2)  # rows 5 (pending token) and 6 (d1[0])
    d2, trace, fed = step(tokens)
    assert trace == [(7, 6), (8, 6), (9, 6)] and fed == [b] + d2[:2]
    # step 3: all 3 accepted: d2[2] was never fed; it is fed now with the new guide (its own row, 10)
    tokens += d2 + [5]
    commit_rows(4)  # rows 7..10
    d3, trace, fed = step(tokens)
    assert trace == [(10, 10), (11, 10), (12, 10), (13, 10)] and fed == [d2[2], 5] + d3[:2]
    # step 4: the drafter sat idle while 5 tokens were committed by other arms: all are re-fed with row 15
    idle = [(d3[0] + 1) % 64, 20, 21, 22, 23]
    tokens += idle
    commit_rows(5)  # rows 11..15
    d4, trace, fed = step(tokens)
    assert trace == [(p, 15) for p in range(12, 19)] and fed == idle + d4[:2]
    # the outputs that became the 3 drafts are those of the last 3 fed positions (the pending token's, then the
    # first two drafts'): they saw guide rows position-1 .. position-3 (staleness 1..k, as training simulates)
    assert len(d4) == 3 and [position - row for position, row in trace[-3:]] == [1, 2, 3]
    handle.remove()
    sd.close()


@pytest.mark.parametrize("mode", ["dynamic", "rsd_c"])
def test_steered_tree_drafter(verifier_model, drafter_model, mode):
    """Zero-initialised: the same trees as the plain tree drafter; trained-like (random) module: still
    exact under greedy and sampling-exact decoding runs; every tree level fed with the step's guide."""
    prompt = [0, 7, 12, 9, 33, 12, 9, 41, 5]
    tree = dict(mode=mode, nodes=10, depth=4, width=3)
    zero = SteeredTreeDrafter(drafter_model, steering=SteeringModule.for_models(drafter_model, 32, guide_layers=GUIDE), **tree)
    plain = PretrainedTreeDrafter(drafter_model, **tree)
    runs = {}
    for name, drafter in (("zero", zero), ("plain", plain)):
        engine = Engine(Verifier(verifier_model), drafter, check_tokenizers=False)
        g, s = engine.generate(prompt, max_new_tokens=24), engine.generate(prompt, max_new_tokens=24, temperature=1.0, seed=2)
        runs[name] = (g.token_ids, g.stats.tokens_per_step, s.token_ids, s.stats.tokens_per_step)
    assert runs["zero"] == runs["plain"] and zero.hidden_layers == tuple(GUIDE)
    zero.close()

    steered = SteeredTreeDrafter(drafter_model, steering=_random_module(drafter_model), **tree)
    steered.steering.trace, steps = [], []
    inner = steered.propose

    def recording(ctx):  # where each step's entries start in the trace, the committed length T, the guide
        guide = steered.steering.module.guide_input(ctx.hidden).clone() if ctx.hidden is not None and len(ctx.hidden) else None
        steps.append((len(steered.steering.trace), len(ctx.tokens), guide))
        return inner(ctx)
    steered.propose = recording
    up = decoder_layers(drafter_model)[0].mlp.up_proj  # steered layer 0: capture what was really added
    added = []
    handle = up.register_forward_hook(lambda m, a, out: added.append((out - F.linear(a[0], m.weight))[0].detach()))
    engine = Engine(Verifier(verifier_model), steered, check_tokenizers=False)
    result = engine.generate(prompt, max_new_tokens=24)
    handle.remove()
    assert result.token_ids == plain_greedy(verifier_model, prompt, 24)
    # every position fed in a step (catch-up and all tree levels) uses guide row T-2, the verifier state
    # that produced the bonus token; only the prompt prefill is unsteered
    deltas = torch.cat(added)[-len(steered.steering.trace):]  # the engine's warm-up-free run: one row per fed position
    bounds = [b for b, _, _ in steps] + [len(steered.steering.trace)]
    for (begin, T, guide), end in zip(steps, bounds[1:]):
        for i in range(begin, end):  # none if nothing was left to draft
            pos, _, row = steered.steering.trace[i]
            assert row == (None if pos < len(prompt) - 1 else T - 2)
            with torch.inference_mode():  # the guide was recorded inside the drafter's inference mode
                want = torch.zeros_like(deltas[i]) if row is None else steered.steering.module(guide)[0]
            torch.testing.assert_close(deltas[i], want, rtol=1e-5, atol=1e-5)
    assert len(steps) >= result.stats.steps > 1 and sum(row is not None for _, _, row in steered.steering.trace) > 10
    assert steered.describe()["kind"] == "steered_tree" and steered.describe()["mode"] == mode
    # the steering changes the trees (otherwise this test could not tell steered from plain)
    plain_engine = Engine(Verifier(verifier_model), PretrainedTreeDrafter(drafter_model, **tree), check_tokenizers=False)
    assert result.stats.tokens_per_step != plain_engine.generate(prompt, max_new_tokens=24).stats.tokens_per_step
    steered.close()


def test_training_raises_agreement_and_acceptance(trained, verifier_model, drafter_model, examples):
    first, last = trained.history[0], trained.history[-1]
    assert first["step"] == 0 and last["step"] == 40
    assert first["val_agree_steered"] == first["val_agree_plain"]  # zero-init: no change
    assert last["val_agree_plain"] == first["val_agree_plain"]  # frozen drafter
    assert last["val_agree_steered"] > first["val_agree_plain"] + 0.15
    assert last["val_kl_steered"] < first["val_kl_plain"]

    def mean_tau(module):
        sd = SteeredDrafter(drafter_model, steering=module, k=K)
        engine = Engine(Verifier(verifier_model), sd, check_tokenizers=False)
        taus = []
        for ex in examples[:8]:
            result = engine.generate(ex.ids[:PROMPT_LEN], max_new_tokens=RESPONSE_LEN)
            assert result.token_ids == ex.ids[PROMPT_LEN:]  # == plain greedy decoding (the examples are)
            taus += result.stats.tokens_per_step
        sd.close()
        return sum(taus) / len(taus)

    assert any(float(p.detach().abs().max()) > 0 for p in trained.module.proj.parameters())
    assert mean_tau(trained.module) > mean_tau(SteeringModule(trained.module.spec)) + 0.2
    prompt = [0, 7, 12, 9, 33, 12, 9, 41, 5]  # outside the training data
    sd = SteeredDrafter(drafter_model, steering=trained.module, k=4)
    engine = Engine(Verifier(verifier_model), sd, check_tokenizers=False)
    assert engine.generate(prompt, max_new_tokens=40).token_ids == plain_greedy(verifier_model, prompt, 40)
    sd.close()


def test_best_validation_checkpoint_is_kept(trained, features, drafter_model, tmp_path, monkeypatch):
    vals = [h for h in trained.history if "val_kl_steered" in h]
    best = min(vals, key=lambda h: h["val_kl_steered"])
    _, _, config = load_steering(Path(trained.cfg.out_dir) / "best" / "steering.safetensors")
    assert config["training"]["step"] == best["step"] and config["selected_by"].startswith("lowest val_kl_steered")
    # scripted validation figures: the middle one is best, so best/ holds step 2 and the last export step 4
    scripted = iter([0.5, 0.3, 0.4])
    monkeypatch.setattr(SteeringTrainer, "validate", lambda self: {"val_agree_steered": 0.0, "val_agree_plain": 0.0,
                                                                   "val_kl_steered": next(scripted), "val_kl_plain": 1.0})
    cfg = _config(features, tmp_path, train={"steps": 4, "batch_size": 2}, log={"val_every": 2, "checkpoint_every": 100})
    train_steering(cfg, model=copy.deepcopy(drafter_model), log=lambda *a: None)
    assert load_steering(tmp_path / "best" / "steering.safetensors")[2]["training"]["step"] == 2
    assert load_steering(tmp_path / "steering.safetensors")[2]["training"]["step"] == 4
    off = _config(features, tmp_path / "off", train={"steps": 2, "batch_size": 2}, log={"keep_best": False})
    scripted = iter([0.5, 0.3])
    train_steering(off, model=copy.deepcopy(drafter_model), log=lambda *a: None)
    assert not (tmp_path / "off" / "best").exists()
    # best_by agree: the highest agreement wins, whatever the KL says
    scripted_agree = iter([0.5, 0.7, 0.6])
    monkeypatch.setattr(SteeringTrainer, "validate", lambda self: {"val_agree_steered": next(scripted_agree),
                                                                   "val_agree_plain": 0.0, "val_kl_steered": 0.1,
                                                                   "val_kl_plain": 1.0})
    by_agree = _config(features, tmp_path / "agree", train={"steps": 4, "batch_size": 2},
                       log={"val_every": 2, "checkpoint_every": 100, "best_by": "agree"})
    train_steering(by_agree, model=copy.deepcopy(drafter_model), log=lambda *a: None)
    _, _, chosen = load_steering(tmp_path / "agree" / "best" / "steering.safetensors")
    assert chosen["training"]["step"] == 2 and chosen["selected_by"].startswith("highest val_agree_steered")


def test_pool_config_loads_the_checkpoint(trained, verifier_model, drafter_model, tmp_path):
    tok = tiny_tokenizer()
    for name, model in (("verifier", verifier_model), ("drafter", drafter_model)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    ckpt = trained.cfg.out_dir + "/steering.safetensors"
    module, drafter_params, config = load_steering(ckpt)
    assert drafter_params == {} and config["training"]["step"] == 40
    pool = {"verifier": {"model": str(tmp_path / "verifier"), "dtype": "fp32"},
            "drafters": [{"name": "sd2", "type": "steered", "model": str(tmp_path / "drafter"), "checkpoint": ckpt,
                          "params": {"k": K}},
                         {"name": "plain", "type": "pretrained", "model": str(tmp_path / "drafter")},
                         {"name": "sd2-tree", "type": "steered_tree", "model": str(tmp_path / "drafter"), "checkpoint": ckpt,
                          "params": {"nodes": 8, "depth": 3, "min_path_prob": 0.01}}],
            "policy": {"name": "ucb"}}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    engine = load_pool(tmp_path / "pool.yaml")
    sd2 = engine.drafter("sd2")
    assert isinstance(sd2, SteeredDrafter) and sd2.hidden_layers == tuple(GUIDE) and engine.hidden_layers == tuple(GUIDE)
    assert all(torch.equal(a, b) for a, b in zip(sd2.steering.module.state_dict().values(), trained.module.state_dict().values()))
    tree = engine.drafter("sd2-tree")
    assert isinstance(tree, SteeredTreeDrafter) and tree.model is sd2.model and tree.describe()["nodes"] == 8
    prompt = [0, 7, 12, 9, 33, 12, 9, 41, 5]
    result = engine.generate(prompt, max_new_tokens=30)
    assert result.token_ids == plain_greedy(verifier_model, prompt, 30)
    del pool["drafters"][0]["checkpoint"]
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    with pytest.raises(PoolConfigError, match=r"pool.yaml(?s:.*)drafters\.0\.checkpoint: drafter type 'steered' needs a checkpoint"):
        load_pool(tmp_path / "pool.yaml")  # refused when the file is read, before any model loads


def test_resume_matches_uninterrupted_training(features, drafter_model, tmp_path):
    """Steering (low rank) + the last drafter layer fine-tuned; interrupted at step 3 of 6 and resumed."""
    settings = dict(steering={"rank": 4, "layers": 1}, finetune=1,
                    train={"steps": 6, "batch_size": 2, "lr": 1e-2, "drafter_lr": 1e-3},
                    log={"log_every": 3, "val_every": 100, "checkpoint_every": 2})
    quiet = dict(log=lambda *a: None)
    full = train_steering(_config(features, tmp_path / "full", **settings), model=copy.deepcopy(drafter_model), **quiet)
    mlflow_log = {"mlflow": True, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "test"}
    cfg = _config(features, tmp_path / "resumed", **{**settings, "log": {**settings["log"], **mlflow_log}})
    half = train_steering(cfg, model=copy.deepcopy(drafter_model), stop_at_step=3, **quiet)
    assert half.step == 3 and not (tmp_path / "resumed" / "steering.safetensors").exists()
    resumed = train_steering(cfg, model=copy.deepcopy(drafter_model), **quiet)
    assert resumed.step == 6 and resumed.run_id == half.run_id
    a, b = full.trainable_state(), resumed.trainable_state()
    assert sorted(a) == sorted(b) and any(k.startswith("drafter.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    fa, fb = (load_file(str(tmp_path / d / "steering.safetensors")) for d in ("full", "resumed"))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    from mlflow.tracking import MlflowClient

    history = MlflowClient(mlflow_log["tracking_uri"]).get_metric_history(resumed.run_id, "train_loss")
    assert sorted(m.step for m in history) == [3, 6]  # one before the interruption, one after
    # a resume with other settings is refused, naming them
    other = _config(features, tmp_path / "resumed", **{**settings, "train": {**settings["train"], "k": 2}})
    with pytest.raises(ConfigError, match="train"):
        train_steering(other, model=copy.deepcopy(drafter_model), **quiet)


def test_distilled_baseline_trains_without_steering(features, drafter_model, tmp_path):
    cfg = _config(features, tmp_path, steering={"enabled": False, "guide_layers": None}, finetune=1,
                  train={"steps": 4, "batch_size": 2, "drafter_lr": 1e-3})
    tr = train_steering(cfg, model=copy.deepcopy(drafter_model), log=lambda *a: None)
    assert tr.module is None and "val_agree_steered" not in tr.history[-1]
    module, params, config = load_steering(tmp_path / "steering.safetensors")
    assert module is None and params and config["steering"] is None
    # loadable as a drafter: the fine-tuned weights go into a copy, never into the (shared) loaded model
    before = {k: v.clone() for k, v in drafter_model.state_dict().items()}
    build = BuildContext(verifier=None, model="tiny", checkpoint=str(tmp_path / "steering.safetensors"),
                         load_model=lambda ref, quantize=None: (drafter_model, None))
    distilled = SteeredDrafter.from_config("distilled", {"k": 2}, build)
    assert distilled.model is not drafter_model and distilled.hidden_layers == ()
    assert all(torch.equal(v, before[k]) for k, v in drafter_model.state_dict().items())
    own = dict(distilled.model.named_parameters())
    assert all(torch.equal(own[k], v) for k, v in params.items())


@pytest.mark.parametrize("sections, field", [
    (dict(train={"lr": -1.0}), "train.lr"),
    (dict(train={"lrr": 1.0}), "train.lrr"),
    (dict(steering={"injection": "down"}), "steering.injection"),
    (dict(train={"loss": "mse"}), "train.loss"),
    (dict(data={"val_sequences": -2}), "data.val_sequences"),
])
def test_config_errors_name_the_field(features, tmp_path, sections, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _config(features, tmp_path, **sections)


@pytest.mark.parametrize("sections, field", [
    (dict(steering={"guide_layers": [1, 2, 7]}), "steering.guide_layers"),
    (dict(steering={"guide_layers": None}), "steering.guide_layers"),
    (dict(data={"val_shards": [5]}), "data.val_shards"),
    (dict(train={"min_staleness": K + 1}), "train.min_staleness"),
    (dict(steering={"layers": 9}), "steering.layers"),
    (dict(finetune=[4]), "finetune"),
    (dict(steering={"enabled": False}), "finetune"),
    (dict(data={"features": "/nonexistent/features"}), "data.features"),
])
def test_setup_errors_name_the_field(features, drafter_model, tmp_path, sections, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SteeringTrainer(_config(features, tmp_path, **sections), model=drafter_model)


def test_cli_reports_config_errors(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_train_steering_parser(parser.add_subparsers(dest="cmd"))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"drafter": "x", "out_dir": "o", "data": {"features": "f"},
                                                       "train": {"k": 0}}))
    args = parser.parse_args(["steering", str(tmp_path / "bad.yaml"), "--steps", "3"])
    assert args.func(args) == 2
    assert "train.k" in capsys.readouterr().err
    # --set KEY=VALUE overrides any dotted key (VALUE read as YAML): the bad train.k is fixed, so the run
    # gets as far as the missing feature directory
    args = parser.parse_args(["steering", str(tmp_path / "bad.yaml"), "--set", "train.k=2", "--set", "steering.rank=null"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "data.features" in err and "train.k" not in err
    for bad, field in (("train.k", "--set"), ("=3", "--set"), ("train.nope=1", "nope")):
        args = parser.parse_args(["steering", str(tmp_path / "bad.yaml"), "--set", bad])
        assert args.func(args) == 2
        assert field in capsys.readouterr().err


@pytest.mark.parametrize("loss", ["kl", "tvd", "top1"])
def test_each_loss_is_the_documented_formula(features, drafter_model, tmp_path, loss):
    """Unsteered, on one held-out sequence: the loss equals its formula computed here from the drafter's logits."""
    tr = SteeringTrainer(_config(features, tmp_path, train={"loss": loss}), model=drafter_model)
    seq = tr.val_set[0]
    out = tr.sequence_loss(seq, offset=None)
    rows = seq["loss_mask"][1:].nonzero().squeeze(-1)
    with torch.no_grad():
        logq = drafter_model(input_ids=seq["ids"][None]).logits[0, rows].float().log_softmax(-1)  # [R, vocab]
    top_ids, top_lp = seq["topk_ids"][rows], seq["topk_logp"][rows].float()  # [R, k]
    p = (top_lp - top_lp.logsumexp(-1, keepdim=True)).exp()  # p: verifier top-k renormalised
    q = logq.exp().gather(-1, top_ids)  # q: drafter prob of those tokens
    want = {"kl": (p * (p.log() - q.log())).sum(-1),
            "tvd": 0.5 * ((p - q).abs().sum(-1) + (1 - q.sum(-1)).clamp_min(0)),
            "top1": -q[:, 0].log()}[loss].sum()
    torch.testing.assert_close(out["loss"].detach(), want, rtol=1e-4, atol=1e-4)
    assert int(out["n"]) == len(rows) > 0


def test_staleness_range(features, drafter_model, tmp_path):
    """Training staleness o ~ U{min_staleness..k}: 1..k by default (what inference sees), 0..k for the
    oracle diagnostic."""
    for lo in (1, 0):
        tr = SteeringTrainer(_config(features, tmp_path / str(lo), train={"min_staleness": lo}), model=drafter_model)
        assert {tr.offset_for(step) for step in range(200)} == set(range(lo, K + 1))


def test_frozen_guide_projection_stays_identity(features, drafter_model, tmp_path):
    """steering.train_guide false: W_hml keeps its [I I I] initialisation while the projection trains."""
    cfg = _config(features, tmp_path, steering={"guide_layers": GUIDE, "train_guide": False},
                  train={"steps": 3, "batch_size": 2}, log={"val_every": 100})
    tr = train_steering(cfg, model=copy.deepcopy(drafter_model), log=lambda *a: None)
    fresh = SteeringModule(tr.module.spec)
    assert torch.equal(tr.module.guide.weight, fresh.guide.weight) and torch.equal(tr.module.guide.bias, fresh.guide.bias)
    assert not torch.equal(tr.module.proj.weight, fresh.proj.weight)
    trained_ids = {id(p) for g in tr.opt.param_groups for p in g["params"]}
    assert id(tr.module.guide.weight) not in trained_ids and id(tr.module.proj.weight) in trained_ids


def test_standardized_guide_is_the_documented_formula(drafter_model):
    """guide_norm standardize: delta = P(LayerNorm(W_hml (h - mean) / std + b)); std floored at 1e-3."""
    torch.manual_seed(0)
    module = _random_module(drafter_model, guide_norm="standardize", rank=4)
    n_in = 3 * 32
    mean, std = torch.randn(n_in) * 5, torch.rand(n_in) * 3
    std[0] = 0.0
    module.set_input_stats(mean, std)
    h = torch.randn(7, n_in) * 10  # [positions, 3 d_v]
    x = (h - mean) / std.clamp_min(1e-3)
    want = module.proj(module.down(F.layer_norm(x @ module.guide.weight.T + module.guide.bias, (32,),
                                                module.norm.weight, module.norm.bias)))
    got = module(h)  # [positions, n_steered, d_ff]
    assert got.shape == (7, len(module.spec.steered_layers), module.spec.d_out)
    torch.testing.assert_close(got.flatten(1), want)
    with pytest.raises(ValueError, match="standardize"):
        _random_module(drafter_model).set_input_stats(mean, std)


def test_guide_dropout_is_training_only(drafter_model):
    torch.manual_seed(0)
    module = _random_module(drafter_model, rank=4)
    h = torch.randn(5, 3 * 32)
    clean = module(h)
    module.dropout = 0.5
    assert torch.equal(module.eval()(h), clean)
    module.train()
    assert not torch.equal(module(h), clean) and not torch.equal(module(h), module(h))


def test_trained_standardization_uses_training_statistics(features, drafter_model, tmp_path):
    """The trainer fixes mean/std from every position of the training shards; the exported module keeps
    them in fp32 (even with save_dtype bf16) and a pool loads the same numbers."""
    cfg = _config(features, tmp_path, steering={"guide_layers": GUIDE, "guide_norm": "standardize", "dropout": 0.1},
                  data={"train_shards": [1], "val_shards": [0]}, train={"steps": 2, "batch_size": 2},
                  log={"val_every": 100}, save_dtype="bf16")
    tr = train_steering(cfg, model=copy.deepcopy(drafter_model), log=lambda *a: None)
    shard = load_file(str(sorted(Path(features).glob("*.safetensors"))[1]))
    x = torch.cat([shard[f"hidden_{layer}"].double() for layer in GUIDE], dim=-1)
    torch.testing.assert_close(tr.module.in_mean, x.mean(0).float())
    torch.testing.assert_close(tr.module.in_std, x.std(0, unbiased=False).float().clamp_min(1e-3))
    assert tr.module.dropout == 0.1
    module, _, config = load_steering(tmp_path / "steering.safetensors")
    assert config["steering"]["guide_norm"] == "standardize"
    assert torch.equal(module.in_mean, tr.module.in_mean) and torch.equal(module.in_std, tr.module.in_std)


def test_resumed_standardization_loads_the_checkpoints_statistics(features, drafter_model, tmp_path, monkeypatch):
    """A resumed run takes mean/std from its checkpoint and does not pass over the training data again."""
    import metasd.training.steering as steering_training

    cfg = _config(features, tmp_path, steering={"guide_layers": GUIDE, "guide_norm": "standardize"},
                  data={"train_shards": [1], "val_shards": [0]}, train={"steps": 2, "batch_size": 2},
                  log={"val_every": 100})
    first = train_steering(cfg, model=copy.deepcopy(drafter_model), stop_at_step=1, log=lambda *a: None)
    monkeypatch.setattr(steering_training, "guide_input_stats", lambda *a: pytest.fail("statistics recomputed"))
    resumed = train_steering(cfg, model=copy.deepcopy(drafter_model), log=lambda *a: None)
    assert resumed.step == 2 and torch.any(resumed.module.in_std != 1)
    assert torch.equal(resumed.module.in_mean, first.module.in_mean) and torch.equal(resumed.module.in_std, first.module.in_std)
