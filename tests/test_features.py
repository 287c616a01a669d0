"""Training-data plumbing: verifier-generated (on-policy) responses, resumable; the features command's
guard against training on benchmark questions."""
import argparse
import json

import pytest
import torch

from metasd.engine import Engine
from metasd.training.data import Example, generate_responses, prompt_length
from metasd.training.features import add_train_features_parser
from metasd.verifier import Verifier
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
    out = generate_responses(engine, _examples(), path, max_new_tokens=6, max_len=9, log=lambda *a: None)
    for ex, orig in zip(out, _examples()):
        prompt = orig.ids[:prompt_length(orig)]
        assert ex.ids == (prompt + plain_greedy(model, prompt, 6))[:9]
        assert ex.loss_mask == [False] * len(prompt) + [True] * (len(ex.ids) - len(prompt))
    assert [json.loads(line)["index"] for line in path.read_text().splitlines()] == [0, 1, 2]

    class NoGeneration:
        def generate(self, *a, **k):
            raise AssertionError("a cached response was generated again")
    again = generate_responses(NoGeneration(), _examples(), path, max_new_tokens=6, max_len=9, log=lambda *a: None)
    assert [e.ids for e in again] == [e.ids for e in out]
    # resume after an interruption: only the missing response is generated
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2]) + "\n")
    calls = []
    inner = engine.generate
    engine.generate = lambda *a, **k: calls.append(a[0]) or inner(*a, **k)
    resumed = generate_responses(engine, _examples(), path, max_new_tokens=6, max_len=9, log=lambda *a: None)
    assert [e.ids for e in resumed] == [e.ids for e in out] and len(calls) == 1
    other = [Example([0, 7, 7, 7, 40], [False] * 4 + [True])] + _examples()[1:]
    with pytest.raises(ValueError, match="another prompt"):
        generate_responses(engine, other, path, max_new_tokens=6, log=lambda *a: None)
    with pytest.raises(ValueError, match="no response"):
        prompt_length(Example([1, 2], [False, False]))


def test_features_command_refuses_a_missing_benchmark_file(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_train_features_parser(parser.add_subparsers())
    args = parser.parse_args(["features", str(tmp_path / "out"), "--exclude", str(tmp_path / "nope.jsonl")])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "--exclude" in err and "nope.jsonl" in err
    assert not (tmp_path / "out").exists()
