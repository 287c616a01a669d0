"""Training-data plumbing: verifier-generated (on-policy) responses, resumable; the features command's
guard against training on benchmark questions, and its options checked before any model loads."""
import argparse
import json
from pathlib import Path

import pytest

from metasd.core.engine import Engine
from metasd.training.data import (Example, batched_greedy_responder, engine_responder, generate_responses,
                                  prompt_length)
from metasd.training.features import add_train_features_parser
from metasd.core.execution.verifier import Verifier
from tiny import plain_greedy, tiny_qwen


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0)


def _examples():
    # prompts of 4-6 tokens followed by some (ShareGPT-like) reply that the verifier did not write
    return [Example([0, 5 + i, 9, 13 + i] + [1] * i + [40, 41, 42], [False] * (4 + i) + [True] * 3) for i in range(3)]


def test_generate_responses_are_the_verifiers_and_resume(model, tmp_path):
    engine = Engine(Verifier(model), [], check_tokenizers=False)
    path = tmp_path / "responses.jsonl"
    respond = engine_responder(engine, max_new_tokens=6, log=lambda *a: None)
    out = generate_responses(respond, _examples(), path, max_len=9, log=lambda *a: None)
    for ex, orig in zip(out, _examples()):
        prompt = orig.ids[:prompt_length(orig)]
        assert ex.ids == (prompt + plain_greedy(model, prompt, 6))[:9]
        assert ex.loss_mask == [False] * len(prompt) + [True] * (len(ex.ids) - len(prompt))
    assert [json.loads(line)["index"] for line in path.read_text().splitlines()] == [0, 1, 2]

    def no_generation(prompts):
        raise AssertionError("a cached response was generated again")
    again = generate_responses(no_generation, _examples(), path, max_len=9, log=lambda *a: None)
    assert [e.ids for e in again] == [e.ids for e in out]
    # resume after an interruption: only the missing response is generated
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2]) + "\n")
    calls = []
    inner = engine.generate
    engine.generate = lambda *a, **k: calls.append(a[0]) or inner(*a, **k)
    resumed = generate_responses(respond, _examples(), path, max_len=9, log=lambda *a: None)
    assert [e.ids for e in resumed] == [e.ids for e in out] and len(calls) == 1
    other = [Example([0, 7, 7, 7, 40], [False] * 4 + [True])] + _examples()[1:]
    with pytest.raises(ValueError, match="another prompt"):
        generate_responses(respond, other, path, log=lambda *a: None)
    with pytest.raises(ValueError, match="no response"):
        prompt_length(Example([1, 2], [False, False]))


def test_batched_greedy_responses_match_unbatched_greedy(model, tmp_path):
    # prompts of different lengths share one left-padded batch; in fp32 on a tiny model (no near-ties)
    # every response must equal the verifier's unbatched greedy continuation, cut after the first EOS
    prompts = [[3, 9, 4], [0, 5, 9, 13, 7, 7, 2], [11, 12]]
    want = [plain_greedy(model, p, 8) for p in prompts]
    eos = {want[1][4]}  # a token the second response produces: it must stop there, EOS kept
    respond = batched_greedy_responder(model, max_new_tokens=8, eos_ids=eos, pad_id=0)
    got = respond(prompts)
    for g, w in zip(got, want):
        cut = next((j + 1 for j, t in enumerate(w) if t in eos), len(w))
        assert g == w[:cut]
    assert len(got[1]) <= 5
    # through generate_responses: batches of two, shortest prompt first, written under each example's index
    examples = [Example(p + [1, 1], [False] * len(p) + [True] * 2) for p in prompts]
    seen = []
    out = generate_responses(lambda ps: seen.append(ps) or respond(ps), examples, tmp_path / "r.jsonl", batch_size=2,
                             log=lambda *a: None)
    assert seen == [[prompts[2], prompts[0]], [prompts[1]]]
    assert [e.ids for e in out] == [p + r for p, r in zip(prompts, got)]
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [2, 0, 1] and all(r["prompt"] == prompts[r["index"]] for r in rows)


def test_features_command_refuses_a_missing_benchmark_file(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_train_features_parser(parser.add_subparsers())
    args = parser.parse_args(["features", str(tmp_path / "out"), "--exclude", str(tmp_path / "nope.jsonl")])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "--exclude" in err and "nope.jsonl" in err
    assert not (tmp_path / "out").exists()


def test_features_command_refuses_an_unused_pool(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_train_features_parser(parser.add_subparsers())
    for extra in (["--responses", "verifier", "--batch-size", "4"], []):
        args = parser.parse_args(["features", str(tmp_path / "out"), "--pool", "p.yaml", "--exclude", "none"] + extra)
        assert args.func(args) == 2
        assert "--pool" in capsys.readouterr().err


def _features_args(tmp_path, *flags):
    parser = argparse.ArgumentParser()
    add_train_features_parser(parser.add_subparsers())
    return parser.parse_args(["features", str(tmp_path / "out"), "--exclude", "none", *map(str, flags)])


@pytest.fixture
def nothing_loads(monkeypatch):
    """``metasd train features`` must refuse before it loads a model or a pool: loading fails the test."""
    import metasd.config
    import metasd.models

    def fail(*a, **kw):
        raise AssertionError("a model was loaded before the options were checked")
    monkeypatch.setattr(metasd.models, "load_model", fail)
    monkeypatch.setattr(metasd.config, "load_pool", fail)


@pytest.mark.parametrize("flags, named", [
    (["--layers", "3,x"], "--layers '3,x'"), (["--layers", "-1"], "--layers '-1'"), (["--layers", ","], "--layers"),
    (["--sequences", 0], "--sequences"), (["--skip", -1], "--skip"), (["--max-len", 1], "--max-len"),
    (["--topk", 0], "--topk"), (["--shard-size", 0], "--shard-size"), (["--max-new-tokens", 0], "--max-new-tokens"),
    (["--batch-size", 0], "--batch-size"), (["--dtype", "fp8"], "--dtype: dtype 'fp8'"),
    (["--device", "gpu0"], "--device: device 'gpu0'"), (["--sharegpt", "nope.json"], "--sharegpt: nope.json"),
    (["--responses", "verifier", "--verifier", "bundled:other",
      "--pool", str(Path(__file__).resolve().parents[1] / "configs" / "pools" / "serve_adaptive.yaml")],
     "--verifier is 'bundled:other'")])
def test_features_command_refuses_a_bad_option_before_any_model_loads(tmp_path, nothing_loads, capsys, flags, named):
    args = _features_args(tmp_path, *flags)
    assert args.func(args) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_features_command_refuses_to_resume_features_of_another_kind(tmp_path, nothing_loads, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"layers": [1, 2], "topk": 4, "shard_size": 32}))
    args = _features_args(tmp_path, "--layers", "2,1", "--topk", 8, "--shard-size", 32)
    assert args.func(args) == 2
    assert "holds features with topk=4, asked for 8 (--topk)" in capsys.readouterr().err


def test_features_command_refuses_a_layer_the_verifier_does_not_have(tmp_path, model, monkeypatch, capsys):
    import metasd.models

    monkeypatch.setattr(metasd.models, "load_model", lambda *a, **kw: (model, None))
    depth = model.config.num_hidden_layers
    args = _features_args(tmp_path, "--layers", f"0,{depth + 1}", "--verifier", "tiny")
    assert args.func(args) == 2
    assert f"--layers '0,{depth + 1}': tiny has hidden_states 0..{depth}" in capsys.readouterr().err
