"""``metasd serve MODEL``: a model from the command line with generate's drafter options or vLLM's
``--speculative-config``, each mapped to the pool it describes and refused, naming the option or key, before any model
loads; ``--help`` printing each default once; and a real ``metasd serve MODEL --speculative-config ...`` process on a
tiny model: its name and context, greedy text equal to plain decoding's drafted by the configured drafter, /metrics
without the key, an access line per request and the periodic stats line."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from metasd.cli import build_parser, main
from metasd.serve.cli import pool_recipe
from serve_helpers import write_tiny_pool
from test_serve_cli import _listening, _until

pytest.importorskip("fastapi")

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(write_tiny_pool(tmp_path_factory.mktemp("tiny")).parent / "verifier")


def _pool(*argv):
    argv = ["serve", *argv]
    return pool_recipe(build_parser(argv).parse_args(argv)).parse()


def _drafters(config):
    return [(d.name, d.type, d.model, d.params, d.arm) for d in config.drafters]


@pytest.mark.parametrize("spec, drafters", [
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2},
     [("ngram", "ngram", None, {"k": 4, "n_max": 5, "n_min": 2}, True)]),
    ({"method": "suffix", "num_speculative_tokens": 12, "suffix_decoding_max_tree_depth": 24,
      "suffix_decoding_min_token_prob": 0.2},
     [("suffix", "suffix", None, {"max_depth": 12, "max_nodes": 12, "min_prob": 0.2}, True)]),
    ({"model": "TINY", "num_speculative_tokens": 20},  # the method vLLM infers from a model: draft_model
     [("draft", "pretrained", "TINY", {"k": 20, "k_max": 20}, True)]),
])
def test_speculative_config_maps_vllms_keys_to_one_drafter(tiny_dir, spec, drafters):
    config = _pool(tiny_dir, "--speculative-config", json.dumps(spec).replace("TINY", tiny_dir))
    assert config.verifier.model == tiny_dir
    want = [(n, t, m.replace("TINY", tiny_dir) if m else m, p, a) for n, t, m, p, a in drafters]
    assert [(n, t, m, {k: p[k] for k in w[3]}, a) for (n, t, m, p, a), w in zip(_drafters(config), want)] == want
    assert len(config.drafters) == 1
    assert not config.no_speculation_arm and not config.serving.adaptive  # drafts as configured


def test_drafter_options_apply_to_the_serving_pool_over_model(tiny_dir):
    config = _pool(tiny_dir, "--drafter", "ngram", "--k", "4", "--param", "ngram.n_max=2")
    assert config.verifier.model == tiny_dir
    assert _drafters(config) == [("ngram", "ngram", None, {"k": 4, "n_max": 2}, True)]
    assert config.serving.adaptive and config.policy.name == "per_load"  # the serving pool's, as generate keeps its
    default = _pool()
    assert default.verifier.model == "bundled:qwen2.5-coder-1.5b-instruct" and default.serving.adaptive


@pytest.mark.parametrize("args, message", [
    (["--speculative-config", '{"method": "eagle3", "model": "x"}'],
     "--speculative-config: method 'eagle3' is not supported; supported: ngram, suffix, draft_model"),
    (["--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 1}'],
     "--speculative-config: unknown key 'draft_tensor_parallel_size' for method 'ngram'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": "5"}'],
     "--speculative-config: num_speculative_tokens must be an integer, got '5'"),
    (["--speculative-config", "{method: ngram}"], "--speculative-config: not JSON"),
    (["--speculative-config", '{"method": "draft_model"}'], "method 'draft_model' needs 'model'"),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 0}'], "drafters.0.params.n_max"),
    (["--speculative-config", '{"method": "ngram"}', "--drafter", "ngram"],
     "--speculative-config sets the drafter and its num_speculative_tokens: give it without --drafter and --k"),
    (["--pool", "p.yaml"], "give MODEL (TINY) or --pool (p.yaml), not both"),
    (["--max-model-len", "1000"], "--max-model-len 1000 exceeds the context of TINY (256 tokens)"),
    (["--param", "nope.k=3"], "--param nope.k: no drafter named 'nope' in the pool"),
])
def test_bad_model_options_exit_2_naming_them_before_any_model_loads(tiny_dir, monkeypatch, capsys, args, message):
    import metasd.config.build

    monkeypatch.setattr(metasd.config.build, "build_engine", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["serve", tiny_dir, *args]) == 2
    assert message.replace("TINY", tiny_dir) in capsys.readouterr().err


def test_unknown_model_is_refused_naming_model(capsys):
    assert main(["serve", "bundled:no-such-model"]) == 2
    assert "metasd serve: error: MODEL 'bundled:no-such-model'" in capsys.readouterr().err


def test_help_prints_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    options = re.split(r" (?=--[a-z])", out.split("options:", 1)[1])
    assert [o.split()[0] for o in options if o.count("(default") > 1] == []
    for needle in ("--port PORT port to listen on (0: one the OS chooses, printed) (default: 8000)",
                   "--max-body-bytes MAX_BODY_BYTES the largest request body read; a larger one gets 413 (default: 8 "
                   "MiB) --body-timeout SECONDS", "--metrics-require-key /metrics needs the API key too --served-model-name"):
        assert needle in out, needle


def test_served_model_names_repeat_the_flag_and_never_take_model(tiny_dir):
    """One name per --served-model-name (repeated for several): a name list would swallow a MODEL given after it and
    serve the default pool's verifier under its name."""
    from metasd.serve.cli import served_model_name

    def names(*argv):
        args = build_parser(["serve", *argv]).parse_args(["serve", *argv])
        return args.model, served_model_name(args, pool_recipe(args).parse())

    assert names("--served-model-name", "a", tiny_dir) == (tiny_dir, "a")
    assert names(tiny_dir, "--served-model-name", "a", "--served-model-name", "b") == (tiny_dir, ["a", "b"])
    assert names(tiny_dir) == (tiny_dir, tiny_dir)


def test_a_model_served_with_a_speculative_config(tiny_dir, tmp_path):
    """The process end to end: ``metasd serve DIR --speculative-config ...`` with a name, a shorter context, a key."""
    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier
    from metasd.models import load_tokenizer
    from tiny import tiny_qwen, tiny_tokenizer

    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "metasd.cli", "serve", tiny_dir, "--port", "0", "--served-model-name", "tiny-ngram",
           "--served-model-name", "ngram-alias", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--max-model-len", "64",
           "--api-key", "k3y", "--log-stats-interval", "0.2",
           "--dtype", "float32"]  # auto is bf16 on a CPU with AVX512-BF16; the reference below is fp32
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = _listening(proc, log)
        key = {"Authorization": "Bearer k3y"}
        models = httpx.get(url + "/v1/models", headers=key).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny-ngram", 64), ("ngram-alias", 64)]
        prompt = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
        body = {"model": "ngram-alias", "prompt": prompt, "max_tokens": 16, "temperature": 0}  # either name is served
        answer = httpx.post(url + "/v1/completions", json=body, headers=key, timeout=60).json()
        assert answer["model"] == "tiny-ngram"  # answers name the first, as vLLM's
        assert httpx.get(url + "/v1/models/ngram-alias", headers=key).json()["id"] == "ngram-alias"
        plain = Engine(Verifier(tiny_qwen(seed=0), tiny_tokenizer(), name="ref")).generate(prompt, max_new_tokens=16)
        assert answer["choices"][0]["text"] == load_tokenizer(tiny_dir).decode(plain.token_ids)
        assert set(answer["metasd"]["drafter_counts"]) == {"ngram"} and answer["metasd"]["drafted"] > 0
        too_long = httpx.post(url + "/v1/completions", json=body | {"prompt": [10] * 50}, headers=key)
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        metrics = httpx.get(url + "/metrics")  # no key: a scraper needs none unless --metrics-require-key
        assert metrics.status_code == 200 and "process_cpu_seconds_total" in metrics.text
        assert 'http_requests_total{handler="/v1/completions",method="POST",status="4xx"} 1.0' in metrics.text
        _until(lambda: "mean acceptance length" in log.read_text(), proc, log)
        text = log.read_text()
        assert '"POST /v1/completions HTTP/1.1" 200' in text and '"POST /v1/completions HTTP/1.1" 400' in text
        assert re.search(r"\[metasd serve\] prompt [\d.]+ tokens/s, generation [\d.]+ tokens/s, running \d+", text)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
