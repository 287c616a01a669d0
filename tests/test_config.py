"""Pool configs: validation errors name the field; pools build engines; policies learn the good drafter."""

from pathlib import Path

import pytest
import yaml

from metasd.config import ConfigError, load_pool, parse_pool_config, read_pool_config
from metasd.drafters import PretrainedDrafter
from metasd.core.engine import Engine
from metasd.policies import UCB1, ThompsonSampling
from metasd.core.execution.verifier import Verifier
from tiny import plain_greedy, tiny_llama, tiny_qwen, tiny_tokenizer

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = tiny_tokenizer()
    dirs = {}
    for name, model in {"verifier": tiny_qwen(seed=0), "good": tiny_qwen(seed=0), "bad": tiny_qwen(seed=9)}.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def _pool(dirs, **over):
    cfg = {
        "verifier": {"model": dirs["verifier"], "dtype": "fp32"},
        "drafters": [
            {"name": "good", "type": "pretrained", "model": dirs["good"], "params": {"k": 4}},
            {"name": "bad", "type": "pretrained", "model": dirs["bad"], "params": {"k": 4}},
            {"name": "ngram", "type": "ngram", "params": {"k": 4}},
        ],
        "policy": {"name": "ucb", "params": {"c": 1.0, "normalize": True}},
        "reward": "block_efficiency",
    }
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c["drafters"][1].update(type="nope"), "drafters.1.type: unknown drafter type 'nope'; registered: ["),
    (lambda c: c["drafters"][0]["params"].update(kk=3),
     "drafters.0.params.kk: PretrainedDrafter has no parameter 'kk' (did you mean 'k'?); allowed: k, confidence_threshold, "),
    (lambda c: c["drafters"][0]["params"].update(k=-3), "drafters.0.params.k: Input should be greater than or equal to 1 (got -3)"),
    (lambda c: c["drafters"][0]["params"].update(k=20), "drafters.0.params: need 1 <= k_min <= k <= k_max, got k_min=1, k=20"),
    (lambda c: c["drafters"][2]["params"].update(k="4"), "drafters.2.params.k: Input should be a valid integer (got '4')"),
    (lambda c: c["policy"]["params"].update(c=-1.0), "policy.params.c: Input should be greater than or equal to 0 (got -1.0)"),
    (lambda c: c["policy"].update(name="exp3", params={}) or c.update(reward="throughput"),
     "reward: policy 'exp3' (as configured) needs rewards in [0, 1]; 'throughput' is unbounded"),
    (lambda c: c["policy"].update(name="ucbx"), "policy.name: unknown policy 'ucbx'; registered: ["),
    (lambda c: c["policy"]["params"].update(beta=2), "policy.params.beta: UCB1 has no parameter 'beta'; allowed: c, normalize"),
    (lambda c: c.update(reward="speed"), "reward: Input should be 'throughput', 'wall_throughput', 'block_efficiency' or 'block_divergence'"),
    (lambda c: c.update(granularity="token"), "granularity: Input should be 'step' or 'request'"),
    (lambda c: c["drafters"][1].update(name="good"), "drafters: drafter names must be unique; repeated: ['good']"),
    (lambda c: c.update(extra_field=1), "extra_field: unknown field; allowed here: verifier, drafters,"),
    (lambda c: c.update(drafter=c.pop("drafters")), "drafter: unknown field (did you mean 'drafters'?)"),
    (lambda c: c["policy"].update(parms={}), "policy.parms: unknown field (did you mean 'params'?); allowed here: name, params, seed"),
    (lambda c: c.pop("verifier"), "verifier: Field required"),
    (lambda c: c["drafters"][0].update(type="os.path:join"), "drafters.0.type: 'os.path:join' is not a metasd.core.decoding.drafter.Drafter subclass"),
])
def test_bad_fields_are_named(model_dirs, mutate, needle):
    cfg = _pool(model_dirs)
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        parse_pool_config(cfg, source="pool.yaml")
    assert "pool.yaml" in str(err.value) and needle in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_pool_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("verifier: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        read_pool_config(tmp_path / "bad.yaml")


def test_bad_policy_value_names_the_parameter(model_dirs):
    # refused with the pool file (checked by the policy's Params), not after the models load
    with pytest.raises(ConfigError, match=r"pool\.yaml: invalid pool config\n  policy\.params\.gamma: Input should be less than or equal to 1"):
        parse_pool_config(_pool(model_dirs, policy={"name": "exp3", "params": {"gamma": 5.0}}), source="pool.yaml")


def test_embedded_default_pool_is_valid():
    cfg = read_pool_config()
    assert cfg.verifier.model == "bundled:qwen2.5-coder-1.5b-instruct"
    assert cfg.verifier.quantize == "none"  # outputs stay the (bf16) verifier's own
    entries = {d.name: d for d in cfg.drafters}
    drafter = entries["qwen0.5b"]
    assert drafter.type == "pretrained_tree" and drafter.quantize == "int4"
    assert drafter.model == "bundled:qwen2.5-coder-0.5b-instruct"
    # one arm, the cascade: suffix decoding first, the int4 tree where the suffix draft is short
    assert [d.name for d in cfg.drafters if d.arm] == ["cascade"]
    assert entries["cascade"].type == "fused" and entries["cascade"].params["arms"] == ["suffix", "qwen0.5b"]
    assert entries["suffix"].type == "suffix"


def test_the_default_pool_is_chosen_by_the_device(monkeypatch):
    """Where CUDA is, the embedded default is configs/gpu_default.yaml (a suffix + static-tree cascade whose drafting
    loop and verify forwards are captured); elsewhere configs/default.yaml; a verifier override naming the device
    decides; ``--pool default`` / ``gpu_default`` name either (``metasd generate`` prints the choice)."""
    import torch

    from metasd.config.build import default_pool_choice, default_pool_path, pool_argument

    assert default_pool_path().name == "default.yaml" and "no CUDA device" in default_pool_choice()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_pool_path().name == "gpu_default.yaml" and "GPU default" in default_pool_choice()
    cfg = read_pool_config()
    entries = {d.name: d for d in cfg.drafters}
    assert entries["qwen0.5b"].type == "static_tree" and entries["qwen0.5b"].params["graphs"] == "auto"
    assert entries["qwen0.5b"].quantize == "none" and cfg.verifier.graphs == "auto"
    assert [d.name for d in cfg.drafters if d.arm] == ["gpu_cascade"]
    assert entries["gpu_cascade"].params["arms"] == ["suffix", "qwen0.5b"]
    cpu = read_pool_config(None, {"verifier": {"model": "bundled:qwen2.5-coder-1.5b-instruct", "device": "cpu"}})
    assert {d.name: d.type for d in cpu.drafters}["qwen0.5b"] == "pretrained_tree"
    assert Path(pool_argument("default")).name == "default.yaml"
    assert Path(pool_argument("gpu_default")).name == "gpu_default.yaml" and pool_argument("x.yaml") == "x.yaml"


def test_pool_file_builds_an_engine_that_stays_exact(model_dirs, tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(_pool(model_dirs)))
    engine = load_pool(path)
    assert [d.name for d in engine.drafters] == ["good", "bad", "ngram"]
    assert isinstance(engine.policy, UCB1)
    result = engine.generate(PROMPT, max_new_tokens=30)
    assert result.token_ids == plain_greedy(engine.verifier.model, PROMPT, 30)
    # derive: same models, one arm, no reload
    single = engine.derive(drafters=["good"])
    assert single.drafters[0] is engine.drafters[0] and single.verifier is engine.verifier


def test_user_drafter_by_import_path(model_dirs):
    cfg = _pool(model_dirs, drafters=[{"name": "mine", "type": "metasd.drafters.ngram:NGramDrafter", "params": {"k": 2}}])
    assert parse_pool_config(cfg).drafters[0].type.endswith(":NGramDrafter")


@pytest.mark.parametrize("policy", [lambda: UCB1(2, seed=0, normalize=True), lambda: ThompsonSampling(2, seed=0)])
def test_policy_converges_to_the_good_drafter_per_step(policy):
    verifier_model = tiny_qwen(seed=0)
    pool = [PretrainedDrafter(tiny_llama(seed=9), k=4, name="bad"), PretrainedDrafter(tiny_qwen(seed=0), k=4, name="good")]
    engine = Engine(Verifier(verifier_model), pool, policy(), reward="block_efficiency", check_tokenizers=False)
    result = engine.generate(PROMPT, max_new_tokens=200)
    counts = result.stats.selection_counts
    assert counts["good"] > 3 * counts.get("bad", 0)
    assert result.token_ids == plain_greedy(verifier_model, PROMPT, 200)


def test_persistent_policy_learns_across_requests_per_request_granularity():
    verifier_model = tiny_qwen(seed=0)
    pool = [PretrainedDrafter(tiny_llama(seed=9), k=4, name="bad"), PretrainedDrafter(tiny_qwen(seed=0), k=4, name="good")]
    engine = Engine(Verifier(verifier_model), pool, UCB1(2, seed=0), reward="block_efficiency",
                    granularity="request", persistent_policy=True, check_tokenizers=False)
    chosen = [engine.generate(PROMPT[: 4 + i % 5], max_new_tokens=12).stats.drafter_per_step[0] for i in range(12)]
    assert len(set(engine.generate(PROMPT, max_new_tokens=12).stats.drafter_per_step)) == 1  # one drafter per request
    assert chosen[2:].count("good") >= 8


def test_bounded_policy_refuses_unbounded_reward_and_linucb_gets_features():
    from metasd.drafters import NGramDrafter
    from metasd.policies import EXP3, LinUCB

    pool = [NGramDrafter(name="a"), NGramDrafter(name="b", k=3)]
    with pytest.raises(ValueError, match="needs rewards in \\[0, 1\\]"):
        Engine(Verifier(tiny_qwen(seed=0)), pool, ThompsonSampling(2), reward="throughput", check_tokenizers=False)
    with pytest.raises(ValueError, match="needs rewards in \\[0, 1\\]"):
        Engine(Verifier(tiny_qwen(seed=0)), pool, EXP3(2), reward="throughput", check_tokenizers=False)
    Engine(Verifier(tiny_qwen(seed=0)), pool, EXP3(2, reward_scale="running_max"), reward="throughput", check_tokenizers=False)
    seen = []
    policy = LinUCB(2, seed=0)
    original = policy.select
    policy.select = lambda context=None: seen.append(context) or original(context)
    engine = Engine(Verifier(tiny_qwen(seed=0)), pool, policy, reward="block_efficiency",
                    categories=["code", "chat"], check_tokenizers=False)
    engine.generate(PROMPT, max_new_tokens=24, category="chat")  # the text falls into a loop: lookups match it
    # the request's features (bias, length, overlap, category one-hot: chat), then the step's (lookup match, model
    # confidence, each arm's recent acceptance)
    assert seen and all(c is not None and len(c) == (3 + 2) + (2 + 2) and c[4] == 1.0 for c in seen)
    assert seen[0][5] == 0.0 and max(c[5] for c in seen) == 3 / 8  # no match at first, then the loop's 3 tokens
    assert all(c[6] == 0.0 for c in seen)  # no tracked model drafter
    assert list(seen[0][7:]) == [0.5, 0.5] and list(seen[-1][7:]) != [0.5, 0.5]  # acceptance learnt as steps go


def test_committed_training_configs_validate_and_name_no_machine_path(monkeypatch):
    """Every training config in the repository validates, with its data under ${METASD_DATA} (no machine path)."""
    from metasd.training.block import load_train_block_config
    from metasd.training.hidden_state import load_train_hidden_state_config
    from metasd.training.steering import read_config as load_steering_config
    from metasd.training.treeflash import load_train_treeflash_config

    root = Path(__file__).resolve().parents[1]
    loaders = {"hidden_state": load_train_hidden_state_config, "steering": load_steering_config,
               "distill": load_steering_config, "block": load_train_block_config, "treeflash": load_train_treeflash_config}
    files = sorted(root.glob("configs/train/*.yaml")) + sorted(root.glob("experiments/*/train_*.yaml"))
    assert len(files) >= 9
    monkeypatch.setenv("METASD_DATA", "/data")
    for f in files:
        kind = f.parent.name if f.parent.parent.name == "experiments" else f.stem.split("_")[0]
        kind = "hidden_state" if f.stem.startswith("hidden_state") else kind
        cfg = loaders[kind](f)
        features = cfg.data.features if hasattr(cfg, "data") else cfg.features
        assert features.startswith("/data/"), (f, features)
        assert "/work/" not in f.read_text() and "/root/" not in f.read_text(), f
