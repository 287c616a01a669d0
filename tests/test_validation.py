"""Issue 19: every bad config or request input is refused before any model loads, naming the file, the field
(or option) and what is allowed. Each refusal row goes through ``metasd.cli.main`` with every model-loading
entry point replaced by one that fails the test."""
import glob
import inspect
import sys
import time
from pathlib import Path

import pytest
import yaml

import metasd.models.bundled
import metasd.config
import metasd.drafters  # noqa: F401  (registers the drafter types before anything is timed)
import metasd.models
import metasd.policies  # noqa: F401
from metasd.cli import main
from metasd.config import parse_pool_config, read_pool_config
from metasd.core.decoding.drafter import DRAFTERS

REPO = Path(__file__).resolve().parents[1]
# a pool that is valid and loads nothing while it is checked: the verifier is a directory holding only a
# config.json (enough for the reference check; loading it would fail the test anyway)
BASE_POOL = {"verifier": {"model": "VERIFIER_DIR", "dtype": "fp32"},
             "drafters": [{"name": "ngram", "type": "ngram", "params": {"k": 4}},
                          {"name": "ngram2", "type": "ngram", "params": {"k": 2}}],
             "policy": {"name": "ucb", "params": {"c": 1.0}}}


@pytest.fixture
def no_model_load(monkeypatch):
    """Every way ``metasd generate`` could load weights fails the test; returns the calls seen."""
    calls = []

    def refuse(what):
        def fail(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"model loaded ({what})")
        return fail

    # every module's binding of each loader (``from ... import`` copies the name into the importing module)
    loaders = {metasd.models.loading.load_model: "load_model", metasd.models.loading.load_tokenizer: "load_tokenizer",
               metasd.models.loading._from_pretrained: "from_pretrained", metasd.models.bundled.prepare_bundled:
               "prepare_bundled", metasd.config.build.build_engine: "build_engine"}
    for module in [m for name, m in sys.modules.items() if name.startswith("metasd")]:
        for attr, value in list(vars(module).items()):
            loader = next((name for fn, name in loaders.items() if value is fn), None)  # identity: any callable,
            if loader is not None:  # hashable or not (a ctypes callback), compares
                monkeypatch.setattr(module, attr, refuse(loader))
    monkeypatch.setattr(metasd.config.ModelCache, "load", refuse("ModelCache.load"))
    return calls


def _pool_file(tmp_path, mutate=None, name="pool.yaml") -> Path:
    cfg = yaml.safe_load(yaml.safe_dump(BASE_POOL))  # a deep copy
    (tmp_path / "verifier").mkdir(exist_ok=True)
    (tmp_path / "verifier" / "config.json").write_text("{}")
    cfg["verifier"]["model"] = str(tmp_path / "verifier")
    if mutate:
        mutate(cfg)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _set_param(i, **params):
    return lambda c: c["drafters"][i]["params"].update(params)


def _not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(yaml.safe_dump(BASE_POOL, sort_keys=False).encode() + "# caf\u00e9\n".encode("latin-1"))
    return ["--pool", str(path)], [str(path), ": not UTF-8 text (byte 0xe9 at position "]


def _directory(tmp_path):
    (tmp_path / "pools").mkdir()
    return ["--pool", str(tmp_path / "pools")], [f"{tmp_path / 'pools'}: is a directory, not a pool config file"]


def _missing(tmp_path):
    return ["--pool", str(tmp_path / "nope.yaml")], [f"pool config {tmp_path / 'nope.yaml'} does not exist"]


def _bad_yaml(tmp_path):
    (tmp_path / "bad.yaml").write_text("verifier: [unclosed\n")
    return ["--pool", str(tmp_path / "bad.yaml")], [f"{tmp_path / 'bad.yaml'}: not valid YAML"]


def _twice(tmp_path):
    path = _pool_file(tmp_path)
    path.write_text(path.read_text() + "reward: accepted\nreward: throughput\n")  # plain YAML keeps the last
    return ["--pool", str(path)], [f"{path}: not valid YAML: the key 'reward' is given twice"]


def _pool_row(mutate, *needles):
    def row(tmp_path):
        path = _pool_file(tmp_path, mutate)
        return ["--pool", str(path)], [f"{path}: invalid pool config", *needles]
    return row


def _option_row(args, *needles):
    return lambda tmp_path: (list(args), list(needles))


def _missing_drafter_path(tmp_path):
    ref = str(tmp_path / "no" / "such" / "model")
    return (["--pool", str(_pool_file(tmp_path)), "--drafter", ref],
            [f"--drafter {ref!r} is not a drafter of the pool (ngram, ngram2), 'ngram' or 'none', nor a model "
             f"reference: model path {ref!r} does not exist"])


def _missing_pool_model(tmp_path):
    ref = str(tmp_path / "no-such-drafter")
    path = _pool_file(tmp_path, lambda c: c["drafters"].append({"name": "small", "type": "pretrained", "model": ref}))
    return ["--pool", str(path)], [f"{path}: invalid pool config", f"drafters.2.model: model path {ref!r} does not exist"]


def _missing_checkpoint(tmp_path):
    path = _pool_file(tmp_path, lambda c: c["drafters"].append(
        {"name": "tf", "type": "treeflash", "checkpoint": "ckpt/none"}))
    return ["--pool", str(path)], [f"{path}: invalid pool config",
                                   f"drafters.2.checkpoint: {str(tmp_path.resolve() / 'ckpt' / 'none')!r} does not exist"]


ROWS = {
    "pool drafter param out of range": _pool_row(
        _set_param(0, k=-3), "  drafters.0.params.k: Input should be greater than or equal to 1 (got -3)"),
    "unknown drafter param": _pool_row(
        _set_param(1, kk=3), "  drafters.1.params.kk: NGramDrafter has no parameter 'kk' (did you mean 'k'?); "
                             "allowed: k, n_min, n_max, latest"),
    "drafter mode not allowed": _pool_row(
        lambda c: c["drafters"].append({"name": "t", "type": "pretrained_tree", "model": c["verifier"]["model"],
                                        "params": {"mode": "beam"}}),
        "  drafters.2.params.mode: Input should be 'dynamic', 'rsd_c' or 'rsd_s' (got 'beam')"),
    "entry missing its model": _pool_row(
        lambda c: c["drafters"].append({"name": "t", "type": "pretrained_tree"}),
        "  drafters.2.model: drafter type 'pretrained_tree' needs a model reference"),
    "tokenizer: own on a type that cannot translate": _pool_row(
        lambda c: c["drafters"][1].update(tokenizer="own"),
        "  drafters.1.tokenizer: drafter type 'ngram' cannot draft with a tokenizer of its own; types that can: "
        "pretrained"),
    "entry with a checkpoint its type ignores": _pool_row(
        lambda c: c["drafters"][1].update(checkpoint="ck"), "  drafters.1.checkpoint: drafter type 'ngram' takes no checkpoint"),
    "unknown pool field": _pool_row(lambda c: c.update(speed="fast"),
                                    "  speed: unknown field; allowed here: verifier, drafters, policy, reward, "),
    "unknown policy": _pool_row(lambda c: c["policy"].update(name="ucbx"),
                                "  policy.name: unknown policy 'ucbx'; registered: ['discounted_ucb', "),
    "policy param out of range": _pool_row(lambda c: c["policy"]["params"].update(c=-1),
                                           "  policy.params.c: Input should be greater than or equal to 0 (got -1)"),
    "non-UTF-8 pool file": _not_utf8,
    "directory as pool file": _directory,
    "missing pool file": _missing,
    "YAML syntax error": _bad_yaml,
    "a key given twice": _twice,
    "pool model path missing": _missing_pool_model,
    "pool checkpoint missing": _missing_checkpoint,
    "max_new_tokens 0": _option_row(["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    "temperature -1": _option_row(["--temperature", "-1"], "--temperature must be >= 0 (0 = greedy), got -1.0"),
    "top_p 1.5": _option_row(["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    "top_k -1": _option_row(["--top-k", "-1"], "--top-k must be >= 0 (0 = off), got -1"),
    "min_p 2": _option_row(["--min-p", "2"], "--min-p must be in [0, 1] (0 = off), got 2.0"),
    "threads 0": _option_row(["--threads", "0"], "--threads must be an integer >= 1, got 0"),
    "k 0": _option_row(["--drafter", "ngram", "--k", "0"], "--k must be an integer >= 1, got 0"),
    "--k without a drafter that takes it": _option_row(["--k", "3"], "--k 3: no chosen drafter drafts a chain"),
    "--k with --drafter none": _option_row(["--drafter", "none", "--k", "4"], "--k 4: no chosen drafter drafts"),
    "unknown --policy": _option_row(["--policy", "ucbx"], "--policy: unknown policy 'ucbx'; registered: ["),
    "bad --dtype": _option_row(["--dtype", "fp8"], "--dtype: dtype 'fp8' is not valid; allowed: 'auto', "),
    "bad verifier.dtype": _pool_row(lambda c: c["verifier"].update(dtype="bf17"),
                                    "  verifier.dtype: dtype 'bf17' is not valid; allowed: 'auto', "),
    "bad drafter dtype": _pool_row(lambda c: c["drafters"][1].update(dtype="int8"),
                                   "  drafters.1.dtype: dtype 'int8' is not valid; allowed: 'auto', "),
    "--stream with --json": _option_row(["--stream", "--json"], "--stream and --json go apart: --json prints one "
                                                                "record once the text is done"),
    "nonexistent --drafter path": _missing_drafter_path,
    "--json-schema that is not JSON": _option_row(["--json-schema", '{"type": '], "--json-schema: is not valid JSON"),
    "--json-schema that is no schema": _option_row(["--json-schema", '{"type": "objec"}'],
                                                   "--json-schema: does not compile to a grammar"),
    "--regex that does not compile": _option_row(["--regex", "("], "--regex: does not compile to a grammar"),
    "--grammar with an unknown rule": _option_row(["--grammar", "start: x"], "--grammar: does not compile",
                                                  'unknown name: "x"'),
    "--choice with an empty string": _option_row(["--choice", ""], "--choice: choice 0 must be a non-empty string"),
    "--param without KEY=VALUE": _option_row(["--param", "ngram"], "--param 'ngram': expected DRAFTER.KEY=VALUE"),
    "--param for a drafter not in the pool": lambda tmp_path: (
        ["--pool", str(_pool_file(tmp_path)), "--param", "tree.nodes=4"],
        ["--param tree.nodes: no drafter named 'tree' in the pool (drafters: ngram, ngram2)"]),
    "--param with a key the type lacks": lambda tmp_path: (
        ["--pool", str(_pool_file(tmp_path)), "--param", "ngram2.nodes=4"], ["drafters.1.params.nodes: NGramDrafter has no parameter 'nodes'"]),
    "--param with a value out of range": lambda tmp_path: (
        ["--pool", str(_pool_file(tmp_path)), "--param", "ngram.k=0"], ["drafters.0.params.k"]),
    "unknown bundled --drafter": _option_row(["--drafter", "bundled:nope"],
                                             "--drafter 'bundled:nope' is not a drafter of the pool",
                                             "unknown bundled model 'bundled:nope'; bundled models are: bundled:"),
    "nonexistent --verifier path": _option_row(["--verifier", "/no/such/verifier"],
                                               "--verifier '/no/such/verifier': model path '/no/such/verifier' "
                                               "does not exist"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_is_refused_before_any_model_loads(row, tmp_path, no_model_load, capsys):
    args, needles = ROWS[row](tmp_path)
    t0 = time.perf_counter()
    code = main(["generate", *args, "w7 w8 w9"])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("metasd generate: error: "), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"
    assert no_model_load == []
    assert elapsed < 2.0, f"refused after {elapsed:.2f} s"  # the requirement (measured: well under 0.1 s)


def test_valid_options_reach_the_engine(tmp_path, no_model_load, capsys):
    """The same checks let valid input through: the first thing after them is building the engine."""
    path = _pool_file(tmp_path)
    with pytest.raises(AssertionError, match=r"model loaded \(build_engine\)"):
        main(["generate", "--pool", str(path), "--max-new-tokens", "1", "--temperature", "0.7", "--top-p", "1",
              "--top-k", "0", "--threads", "1", "--drafter", "ngram", "--k", "3", "--drafter", "none",
              "--policy", "thompson", "--dtype", "fp32", "w7 w8"])
    assert no_model_load == ["build_engine"]


def test_tty_prompt_notice(monkeypatch, no_model_load, capsys):
    class Tty:
        def isatty(self):
            return True

        def read(self):
            return ""

    monkeypatch.setattr(sys, "stdin", Tty())
    assert main(["generate"]) == 2
    err = capsys.readouterr().err
    assert "metasd generate: reading the prompt from stdin (end with Ctrl-D)" in err
    assert "metasd generate: error: the prompt is empty" in err


def test_generate_help_shows_defaults_and_allowed_values(capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for needle in ["--max-new-tokens MAX_NEW_TOKENS tokens to generate: an integer >= 1 (default: 128)",
                   ">= 0 (0 = greedy) (default: 0.0)", "in (0, 1] (1 = off) (default: 1.0)", ">= 0 (0 = off) (default: 0)",
                   "{throughput,wall_throughput,block_efficiency,block_divergence}", "{step,request}", "one of discounted_ucb,"]:
        assert needle in out, needle


@pytest.mark.parametrize("flags, terminal, streams", [
    ([], True, True), ([], False, False), (["--no-stream"], True, False), (["--stream"], False, True),
    (["--json"], True, False)])
def test_end_to_end_generate_still_works(tmp_path, monkeypatch, capsys, flags, terminal, streams):
    """A valid pool of tiny local models generates through the CLI (nothing valid is refused); text streams
    to a terminal by default, not into a pipe, and never with --json."""
    from metasd.core.engine import Engine

    monkeypatch.setattr(metasd.cli, "_stdout_is_terminal", lambda: terminal)
    calls = []
    for method in ("stream", "generate"):
        original = getattr(Engine, method)
        monkeypatch.setattr(Engine, method, lambda self, *a, _m=method, _f=original, **k: (calls.append(_m), _f(self, *a, **k))[1])
    from tiny import tiny_qwen, tiny_tokenizer

    tok = tiny_tokenizer()
    build = metasd.config.build_engine

    def build_with_tiny_tokenizer(*args, **kwargs):  # AutoTokenizer reloads the word-level tokenizer as Qwen2's BPE
        engine = build(*args, **kwargs)
        engine.tokenizer = tok
        return engine

    monkeypatch.setattr(metasd.config, "build_engine", build_with_tiny_tokenizer)
    for name, seed in (("verifier", 0), ("drafter", 1)):
        tiny_qwen(seed=seed).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    pool = {"verifier": {"model": str(tmp_path / "verifier"), "dtype": "fp32", "device": "cpu"},
            "drafters": [{"name": "small", "type": "pretrained", "model": str(tmp_path / "drafter"),
                          "params": {"k": 3, "confidence_threshold": 0.0}},
                         {"name": "ngram", "type": "ngram", "params": {"k": 4, "n_max": 2}}],
            "policy": {"name": "ucb", "params": {"c": 1.0, "normalize": True}}, "reward": "block_efficiency"}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    assert main(["generate", "--pool", str(tmp_path / "pool.yaml"), "--raw", "--max-new-tokens", "6", "--threads", "1",
                 *flags, "w7 w8 w9 w7 w8"]) == 0
    out, err = capsys.readouterr()
    assert calls[0] == ("stream" if streams else "generate")
    assert ('"token_ids"' in out) == ("--json" in flags)
    assert "[metasd] loading" in err and "[metasd] loaded in" in err


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_params_models_match_the_constructors(kind):
    """Each built-in drafter's Params declares only constructor keywords, with the constructor's defaults."""
    cls = DRAFTERS[kind]
    assert cls.Params is not None and cls.Params.model_config.get("extra") == "forbid"
    sig = constructor_keywords(cls)
    for name, field in cls.Params.model_fields.items():
        assert name in sig, f"{kind}: Params.{name} is not an __init__ keyword"
        if field.is_required():  # required in the file, positional in Python (a fused drafter's arms)
            assert sig[name].default is inspect.Parameter.empty, f"{kind}: Params.{name} is required, __init__ has a default"
            continue
        assert field.default == sig[name].default, f"{kind}: Params.{name} default {field.default!r} != {sig[name].default!r}"


def constructor_keywords(cls: type) -> dict[str, inspect.Parameter]:
    """The keywords ``cls(...)`` takes: its ``__init__``'s, and through ``**kwargs`` its parents' (a steered
    drafter forwards the pretrained drafter's parameters without repeating them)."""
    out: dict[str, inspect.Parameter] = {}
    for owner in cls.__mro__:
        if "__init__" not in owner.__dict__:
            continue
        params = inspect.signature(owner.__init__).parameters
        out = {**{k: p for k, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}, **out}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return out


SHIPPED_POOLS = sorted(glob.glob(str(REPO / "configs" / "*.yaml")) + glob.glob(str(REPO / "configs" / "pools" / "*.yaml")))


def test_every_pool_file_lives_under_configs():
    assert len(SHIPPED_POOLS) > 40
    elsewhere = [p for p in glob.glob(str(REPO / "**" / "*.yaml"), recursive=True)
                 if "/configs/" not in p and "/.venv/" not in p and "verifier" in Path(p).read_text()
                 and "drafters" in Path(p).read_text() and "datasets" not in Path(p).read_text()]
    assert not elsewhere, f"pool files outside configs/: {elsewhere}"


@pytest.mark.parametrize("path", SHIPPED_POOLS, ids=lambda p: str(Path(p).relative_to(REPO)))
def test_shipped_pools_stay_valid(path):
    raw = yaml.safe_load(Path(path).read_text())
    config = read_pool_config(path)
    for given, checked in zip(raw.get("drafters", []), config.drafters):
        assert checked.params == (given.get("params") or {})  # passed through as given: no defaults injected


def test_engine_api_checks_sampling_arguments_before_any_forward(monkeypatch):
    from tiny import tiny_qwen, tiny_tokenizer

    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier

    engine = Engine(Verifier(tiny_qwen(seed=0), tiny_tokenizer()))

    def no_forward(*a, **k):
        raise AssertionError("forward ran")

    monkeypatch.setattr(engine.verifier, "prefill", no_forward)
    for kwargs, needle in [({"temperature": -1}, "temperature must be >= 0"), ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
                           ({"top_k": -1}, "top_k must be >= 0"), ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1")]:
        with pytest.raises(ValueError, match=needle):
            engine.generate([0, 7, 12], **{"max_new_tokens": 4, **kwargs})
        with pytest.raises(ValueError, match=needle):
            next(engine.stream([0, 7, 12], **{"max_new_tokens": 4, **kwargs}))


def test_unreadable_pool_file_is_named(tmp_path, monkeypatch, no_model_load, capsys):
    path = _pool_file(tmp_path)

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # chmod 000 does not stop root, which runs some CI
    assert main(["generate", "--pool", str(path), "w7"]) == 2
    assert f"metasd generate: error: {path}: cannot read the pool config: Permission denied" in capsys.readouterr().err
    assert no_model_load == []


def test_hub_id_out_of_reach_and_not_cached_is_refused(tmp_path, monkeypatch, no_model_load, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _pool_file(tmp_path)
    assert main(["generate", "--pool", str(path), "--drafter", "no-org/no-model", "w7"]) == 2
    err = capsys.readouterr().err
    assert ("--drafter 'no-org/no-model' is not a drafter of the pool (ngram, ngram2), 'ngram' or 'none', nor a model "
            "reference: cannot load model 'no-org/no-model': it is not a local path or a bundled: reference, and the "
            "Hugging Face hub is disabled (HF_HUB_OFFLINE=1) and the model is not in the local Hugging Face cache") in err
    assert no_model_load == []


def test_param_sets_params_of_any_drafter_type(tmp_path):
    """``--param NAME.KEY=VALUE`` reaches the named entry's params (any type; the value read as YAML), also
    for a drafter chosen with --drafter, and leaves the other entries alone."""
    from metasd.cli import _pool_overrides, build_parser

    argv = ["generate", "--pool", str(_pool_file(tmp_path)), "--param", "ngram2.n_max=3", "--param", "ngram2.latest=true"]
    cfg = parse_pool_config(_pool_overrides(build_parser(argv).parse_args(argv)))
    params = {d.name: d.params for d in cfg.drafters}
    assert params["ngram2"]["n_max"] == 3 and params["ngram2"]["latest"] is True
    assert "latest" not in params["ngram"]
    argv = ["generate", "--pool", str(_pool_file(tmp_path)), "--drafter", "ngram", "--param", "ngram.n_min=2"]
    cfg = parse_pool_config(_pool_overrides(build_parser(argv).parse_args(argv)))
    assert [(d.name, d.params["n_min"]) for d in cfg.drafters] == [("ngram", 2)]


def test_backend_option_sets_the_verifiers_backend_and_bad_combinations_are_refused(tmp_path):
    """``--backend llama.cpp`` sets ``verifier.backend`` (generate and serve); with a pool setting that means nothing
    there (``quantize``) the pool is refused naming the field, before any model loads."""
    from metasd.cli import _pool_overrides, build_parser
    from metasd.config import ConfigError

    argv = ["generate", "--pool", str(_pool_file(tmp_path)), "--backend", "llama.cpp"]
    cfg = parse_pool_config(_pool_overrides(build_parser(argv).parse_args(argv)))
    assert cfg.verifier.backend == "llama.cpp"
    argv = ["generate", "--pool", str(_pool_file(tmp_path))]
    assert parse_pool_config(_pool_overrides(build_parser(argv).parse_args(argv))).verifier.backend == "torch"
    pools = Path(__file__).resolve().parents[1] / "configs" / "pools"
    argv = ["generate", "--backend", "llama.cpp", "--pool", str(pools / "verifier_int8.yaml")]
    with pytest.raises(ConfigError, match="quantize"):
        parse_pool_config(_pool_overrides(build_parser(argv).parse_args(argv)))
    from metasd.config.build import default_serve_pool_path
    from metasd.config.cli_options import pool_overrides

    argv = ["serve", "bundled:qwen2.5-coder-1.5b-instruct", "--backend", "llama.cpp"]
    args = build_parser(argv).parse_args(argv)
    args.verifier = args.model
    assert parse_pool_config(pool_overrides(args, default_serve_pool_path())).verifier.backend == "llama.cpp"


def test_drafter_option_on_the_default_cascade_keeps_the_entries_an_arm_drafts_with():
    """The embedded default's one arm is a fused cascade over two ``arm: false`` entries: ``--drafter`` with any of
    its names gives a valid pool whose arms are exactly the chosen ones, each after the entries it drafts with."""
    from metasd.cli import _pool_overrides, build_parser

    def arms_and_parts(*refs):
        argv = ["generate"] + [a for r in refs for a in ("--drafter", r)]
        cfg = parse_pool_config(_pool_overrides(build_parser(argv).parse_args(argv)))
        return [(d.name, d.arm) for d in cfg.drafters]

    assert arms_and_parts("cascade") == [("suffix", False), ("qwen0.5b", False), ("cascade", True)]
    assert arms_and_parts("qwen0.5b") == [("qwen0.5b", True)]
    assert arms_and_parts("cascade", "suffix") == [("suffix", True), ("qwen0.5b", False), ("cascade", True)]
    assert arms_and_parts("ngram", "qwen0.5b") == [("ngram", True), ("qwen0.5b", True)]
    assert arms_and_parts("none") == []


def test_prompt_and_max_new_tokens_beyond_the_context_are_refused_before_the_models_load(tmp_path, monkeypatch, capsys):
    """The verifier's context length is in its config and the prompt's length needs only its tokenizer, so neither
    waits for the weights (tiny verifier: a context of 256 tokens)."""
    from tiny import tiny_qwen, tiny_tokenizer

    folder = tmp_path / "verifier"
    tiny_qwen(seed=0, context=256).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"verifier": {"model": str(folder), "dtype": "fp32", "device": "cpu"},
                                    "drafters": [{"name": "ngram", "type": "ngram"}]}))
    loaded = []
    monkeypatch.setattr(metasd.config.ModelCache, "load", lambda *a, **k: loaded.append(a) or 1 / 0)
    # AutoTokenizer reloads the tiny word-level tokenizer as Qwen2's BPE (transformers 5): hand over the original
    monkeypatch.setattr(metasd.models, "load_tokenizer", lambda ref: tiny_tokenizer())
    assert main(["generate", "--pool", str(pool), "--raw", "--max-new-tokens", "256", "w7"]) == 2
    assert "--max-new-tokens 256 does not fit the context of" in capsys.readouterr().err
    long_prompt = " ".join(["w7"] * 300)
    assert main(["generate", "--pool", str(pool), "--raw", "--max-new-tokens", "8", long_prompt]) == 2
    assert f"prompt of 300 tokens + max_new_tokens=8 exceeds the context of {folder} (256 tokens)" in capsys.readouterr().err
    assert loaded == []


def test_structured_output_from_the_command_line(tmp_path, monkeypatch, capsys):
    """``--json-schema FILE`` and ``--choice`` reach the engine: the answers follow them, as ``Engine.generate`` with
    the same constraint gives (tiny local models over a byte-level tokenizer, which the grammar library reads)."""
    import json

    pytest.importorskip("llguidance")
    from metasd.core.constraints import Constraint
    from test_constraints import byte_bpe
    from tiny import tiny_qwen

    tok = byte_bpe(340)
    build, engines = metasd.config.build_engine, []

    def build_with_tokenizer(*args, **kwargs):  # the saved tokenizer reloads as another class: use the one built here
        engine = build(*args, **kwargs)
        engine.tokenizer = tok
        engines.append(engine)
        return engine

    monkeypatch.setattr(metasd.config, "build_engine", build_with_tokenizer)
    for name, seed in (("verifier", 0), ("drafter", 1)):
        tiny_qwen(seed=seed, vocab=len(tok), eos=0).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    pool = {"verifier": {"model": str(tmp_path / "verifier"), "dtype": "fp32", "device": "cpu"},
            "drafters": [{"name": "small", "type": "pretrained", "model": str(tmp_path / "drafter"),
                          "params": {"k": 3}}],
            "policy": {"name": "ucb"}, "reward": "block_efficiency"}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    base = ["generate", "--pool", str(tmp_path / "pool.yaml"), "--raw", "--max-new-tokens", "30", "--json"]
    for flags, constraint in ((["--json-schema", str(tmp_path / "schema.json")], Constraint.json_schema(schema)),
                              (["--choice", "yes", "--choice", "no"], Constraint.choice(["yes", "no"]))):
        assert main([*base, *flags, "Answer: "]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["token_ids"] == engines[-1].generate("Answer: ", 30, constraint=constraint).token_ids
        assert record["text"] in ("yes", "no") if flags[0] == "--choice" else isinstance(
            json.loads(record["text"])["n"], int)
