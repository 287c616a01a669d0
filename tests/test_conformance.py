"""Conformance of every registered drafter type, built from a pool file on tiny models: the entry loads and its
settings round-trip through ``describe``, greedy output is the verifier's, and sampled output follows the
verifier's distribution. A type without a checkpoint is covered with its default parameters as it is (the
entry gives the tiny drafter model when the type takes one); ``ENTRIES`` below sets parameters worth testing
and writes the checkpoints of the types that need one (a new such type fails
``test_every_registered_type_is_covered`` until it adds its function there). ``VARIANTS`` adds entries of a type
beyond its own, e.g. a cross-tokenizer drafter (``tokenizer: own``) of every type that can draft with its own tokenizer.

The models are loaded with the tiny word-level tokenizer they were saved with (``_models``): ``AutoTokenizer`` would
reload it beside a Qwen2 model as Qwen2's BPE, which encodes nothing."""
from pathlib import Path
from typing import Callable

import pytest
import torch
import yaml

import metasd.drafters  # noqa: F401  (registers the built-in drafter types)
from metasd.config import ModelCache, load_pool
from metasd.models import load_model
from metasd.models.draft_vocab import DraftVocab
from metasd.core.decoding.drafter import DRAFTERS
from sampling_check import sampled_pairs_pvalue
from tiny import VOCAB, as_llama, plain_greedy, spaced_word_map, spaced_word_tokenizer, tiny_qwen, tiny_tokenizer

LAYERS = 4  # verifier layers: hidden states 0..4 for steering, block heads and hidden-state drafters
PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]
SHARPNESS = 20.0  # verifier logit scale: ~300 pairs carry 90% of the two-token mass, so 400 samples test it
DEVICE = "cpu"  # where the pools run: pytest --metasd-device cuda (tests/conftest.py) runs this file on a GPU


@pytest.fixture(autouse=True, scope="module")
def _device(request):
    global DEVICE
    DEVICE = request.config.getoption("--metasd-device")


def _draft_vocab() -> DraftVocab:
    return DraftVocab(torch.arange(50, 2, -1), VOCAB)  # reduced and permuted: 16 ids can never be drafted


def _block(root: Path) -> dict:
    from metasd.drafters.block import BlockHeads

    verifier = tiny_qwen(seed=0, layers=LAYERS, logit_scale=SHARPNESS)
    torch.manual_seed(0)
    vocab = _draft_vocab()
    heads = BlockHeads(32, 3, vocab.head_weight(verifier.lm_head.weight), vocab, LAYERS, init="normal")
    heads.save(root / "block", dtype=torch.float32)
    return {"checkpoint": str(root / "block"), "params": {"paths": 3, "top_m": 4}}


def _hidden_state(root: Path) -> dict:
    from metasd.drafters.hidden_state_net import HiddenStateConfig, HiddenStateNet, save_checkpoint

    torch.manual_seed(0)
    net = HiddenStateNet(HiddenStateConfig(32, VOCAB, LAYERS, num_heads=4, num_kv_heads=2, intermediate_size=32,
                                           inject_intermediate_size=16))
    with torch.no_grad():  # a stand-in for a trained net: depth 1 passes the verifier's last state through, so its
        net.in_proj.weight.copy_(torch.eye(32))  # drafts are the verifier's own (over the reduced vocabulary);
        for name, param in net.layer.named_parameters():  # deeper depths differ through the token injection
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        torch.nn.init.normal_(net.inject.down.weight, std=0.5)
    save_checkpoint(root / "hidden_state", net, _draft_vocab())
    return {"checkpoint": str(root / "hidden_state"), "params": {"mode": "tree", "depth": 3, "nodes": 6, "k": 2}}


def _treeflash(root: Path) -> dict:
    from metasd.drafters.treeflash import save_checkpoint
    from metasd.drafters.treeflash_backbone import TreeFlashConfig, TreeFlashModel

    torch.manual_seed(0)
    cfg = TreeFlashConfig(verifier_hidden_size=32, verifier_vocab_size=VOCAB, context_layers=[1, 2], hidden_size=16,
                          num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=32, ar_intermediate_size=16,
                          block_size=4, context_window=16)
    model = TreeFlashModel(cfg)
    torch.nn.init.normal_(model.ar.down.weight, std=0.5)  # make the AR correction matter
    save_checkpoint(root / "treeflash", model, _draft_vocab())
    return {"checkpoint": str(root / "treeflash"), "params": {"mode": "treeflash", "m": 3, "k": 3, "tree_size": 8}}


def _steering_checkpoint(root: Path) -> str:
    from metasd.drafters.steered import SteeringModule, save_steering

    drafter = tiny_qwen(seed=0, layers=LAYERS)
    steering = SteeringModule.for_models(drafter, 32, guide_layers=[1, 2, 3])
    torch.nn.init.normal_(steering.proj.weight, std=0.3)  # a trained-like module: it changes the drafts
    return str(save_steering(root / "steering", steering))


ENTRIES: dict[str, Callable[[Path], dict]] = {
    # a model tree and a lookup merged (they are not arms themselves: the fused drafter is the pool's one arm)
    "fused": lambda root: {"before": [{"name": "tree", "type": "pretrained_tree", "model": str(root / "drafter"),
                                       "arm": False, "params": {"nodes": 6, "depth": 3, "width": 2}},
                                      {"name": "lookup", "type": "ngram", "arm": False, "params": {"k": 4, "n_max": 2}}],
                           "params": {"arms": ["tree", "lookup"], "nodes": [6, 4]}},
    "pretrained": lambda root: {"model": str(root / "drafter"), "params": {"k": 3}},
    "pretrained_tree": lambda root: {"model": str(root / "drafter"),  # with a draft head over ids < 40 (+ EOS)
                                     "params": {"mode": "dynamic", "nodes": 8, "depth": 3, "width": 2, "head_vocab": 40}},
    "ngram": lambda root: {"params": {"k": 4, "n_max": 2}},
    # drafts from earlier requests too: under sampling, the answers the verifier sampled before (accepted often)
    "suffix": lambda root: {"params": {"cross_request": True, "max_cached_tokens": 2000}},
    "block": _block,
    "hidden_state": _hidden_state,
    "treeflash": _treeflash,
    "steered": lambda root: {"model": str(root / "drafter"), "checkpoint": _steering_checkpoint(root),
                             "params": {"k": 3, "head_vocab": 40}},
    "steered_tree": lambda root: {"model": str(root / "drafter"), "checkpoint": _steering_checkpoint(root),
                                  "params": {"mode": "dynamic", "nodes": 8, "depth": 3, "width": 2}},
}


def _own_tokenizer(root: Path) -> dict:
    """A drafter of another tokenizer (``spaced_word_tokenizer``: words with the space before them, other ids) whose
    model computes what the soft tiny drafter computes, saved as a Llama (its folder's tokenizer loads as saved)."""
    tok = spaced_word_tokenizer()
    path = root / "other_tokenizer"
    if not path.exists():
        as_llama(tiny_qwen(seed=0, layers=LAYERS, logit_scale=SHARPNESS / 3), len(tok), spaced_word_map(tok)).save_pretrained(path)
        tok.save_pretrained(path)
    return {"model": str(path), "tokenizer": "own", "params": {"k": 4}}


#: case name -> (drafter type, entry): entries beyond each type's own (cross-tokenizer drafting for every type that can)
VARIANTS: dict[str, tuple[str, Callable[[Path], dict]]] = {
    f"{kind}, tokenizer: own": (kind, _own_tokenizer) for kind, cls in DRAFTERS.items() if cls.cross_tokenizer}


def default_entry(kind: str) -> Callable[[Path], dict] | None:
    """The entry of a type without one in ``ENTRIES``: its default parameters, with the tiny drafter model when
    the type takes a model; None for a type that needs a checkpoint (only its own code can write one)."""
    cls = DRAFTERS[kind]
    if cls.checkpoint_field == "required":
        return None
    if cls.model_field in ("required", "optional"):
        return lambda root: {"model": str(root / "drafter"), "params": {}}
    return lambda root: {"params": {}}


def entry(case: str) -> Callable[[Path], dict]:
    if case in VARIANTS:
        return VARIANTS[case][1]
    return ENTRIES.get(case) or default_entry(case)


def kind_of(case: str) -> str:
    return VARIANTS[case][0] if case in VARIANTS else case


KINDS = sorted(DRAFTERS)
CASES = KINDS + sorted(VARIANTS)


def test_every_registered_type_is_covered():
    missing = [k for k in KINDS if entry(k) is None]
    assert not missing, f"drafter types {missing} need a checkpoint: add a function writing one to ENTRIES"
    assert not set(ENTRIES) - set(DRAFTERS), f"entries for unregistered types {sorted(set(ENTRIES) - set(DRAFTERS))}"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("conformance")
    tok = tiny_tokenizer()
    # the drafter: the verifier's weights with softer next-token distributions, so drafts are often but
    # not always accepted (an unrelated tiny model's drafts are almost never accepted by a sharp verifier)
    models = {"verifier": tiny_qwen(seed=0, layers=LAYERS, logit_scale=SHARPNESS),
              "drafter": tiny_qwen(seed=0, layers=LAYERS, logit_scale=SHARPNESS / 3)}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def _pool(root: Path, case: str, entry: dict, name: str = "pool") -> Path:
    """A pool whose one arm is the entry (``before``: entries it drafts with, placed before it, not arms)."""
    kind = kind_of(case)
    entry = dict(entry)
    before = entry.pop("before", [])
    pool = {"verifier": {"model": str(root / "verifier"), "dtype": "fp32", "device": DEVICE},
            "drafters": [*before, {"name": kind, "type": kind, **entry}]}
    path = root / f"{name}_{case.replace(', ', '_').replace(': ', '_')}.yaml"
    path.write_text(yaml.safe_dump(pool))
    return path


def _models(root: Path) -> ModelCache:
    """The tiny verifier and drafter with the word-level tokenizer they were saved with."""
    cache = ModelCache(DEVICE)
    for name in ("verifier", "drafter"):
        model, _ = load_model(str(root / name), dtype="fp32", device=DEVICE)
        cache.put(str(root / name), "fp32", (model, tiny_tokenizer()))
    return cache


def _load(root: Path, path: Path):
    return load_pool(path, models=_models(root))


def _engine(root: Path, case: str):
    return _load(root, _pool(root, case, entry(case)(root)))


@pytest.mark.parametrize("case", CASES)
def test_pool_entry_round_trips_through_describe(root, case):
    """The drafter built from the entry reports the entry's settings, and an entry written from that report
    builds a drafter that reports the same."""
    kind = kind_of(case)
    given = entry(case)(root)
    drafter = _load(root, _pool(root, case, given)).drafter(kind)
    assert type(drafter).kind == kind
    described = drafter.describe()
    for key, value in given["params"].items():
        assert described[key] == value, f"{case}: describe()[{key!r}] = {described.get(key)!r}, the entry says {value!r}"
    if "tokenizer" in given:
        assert described["tokenizer"] == given["tokenizer"]
    fields = DRAFTERS[kind].Params.model_fields
    again_entry = {**given, "params": {k: v for k, v in described.items() if k in fields and v is not None}}
    again = _load(root, _pool(root, case, again_entry, name="again")).drafter(kind)
    assert again.describe() == described


@pytest.mark.parametrize("case", CASES)
def test_the_built_drafter_carries_its_entry_name(root, case):
    """Stats, policies and ``--drafter`` name a drafter by its pool entry, whatever its type's default name."""
    path = _pool(root, case, entry(case)(root), name="named")
    pool = yaml.safe_load(path.read_text())
    pool["drafters"][-1]["name"] = "my arm"
    path.write_text(yaml.safe_dump(pool))
    assert [d.name for d in _load(root, path).drafters] == ["my arm"]


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_is_the_verifiers(root, case):
    kind = case
    engine = _engine(root, case)
    verifier = engine.verifier.model
    for n in (1, 9, 30):
        result = engine.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == plain_greedy(verifier, PROMPT, n), f"{kind}: differs at max_new_tokens={n}"
    assert result.stats.drafted > 0, f"{kind}: drafted nothing, so the check checked nothing"


@pytest.mark.parametrize("case", CASES)
def test_sampling_follows_the_verifiers_distribution(root, case):
    kind = case
    engine = _engine(root, case)
    # the prompt ends in a bigram seen before: prompt lookup drafts too
    pvalue, accepted, drafted = sampled_pairs_pvalue(engine, [0, 7, 12, 9, 33, 7, 12], 400)
    assert pvalue > 1e-3, f"{kind}: sampled pairs do not follow the verifier (p = {pvalue:.2g})"
    assert drafted > 0, f"{kind}: nothing was drafted, so acceptance went unchecked"
    if kind != "ngram":  # the copied n-gram is rarely what the sharp verifier samples: its drafts test rejection
        assert accepted > 0, f"{kind}: no draft token was ever accepted, so acceptance went unchecked"


def test_readme_worked_example_is_covered_without_editing_a_list(root, tmp_path, monkeypatch):
    """The README's example drafter file, saved as a module, registers itself and passes every check above
    through its default entry; the README's pool entry for it validates."""
    import importlib
    import re
    import sys

    from metasd.config import parse_pool_config

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n# drafters/greedy_recompute\.py\n(.*?)```", readme, re.S).group(1)
    entry_yaml = re.search(r"```yaml\n(drafters:\n  - \{name: recompute, type: greedy_recompute.*?)```", readme, re.S).group(1)
    (tmp_path / "greedy_recompute.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    kind = "greedy_recompute"
    try:
        importlib.import_module("greedy_recompute")
        assert kind in DRAFTERS and kind not in ENTRIES and entry(kind) is not None
        pool = {"verifier": {"model": "bundled:qwen2.5-coder-1.5b-instruct"}, **yaml.safe_load(entry_yaml)}
        assert parse_pool_config(pool).drafters[0].params == {"k": 4}
        test_pool_entry_round_trips_through_describe(root, kind)
        test_greedy_output_is_the_verifiers(root, kind)
        test_sampling_follows_the_verifiers_distribution(root, kind)
    finally:
        DRAFTERS.pop(kind, None)
        sys.modules.pop("greedy_recompute", None)
