"""Offline batch generation (metasd/core/batching/offline.py, ``metasd generate --input --output``): request lines
checked before anything runs, every request served through the scheduler, a result line per request as it finishes."""
import io
import json

import pytest

from metasd.core.engine import Engine
from metasd.core.batching.offline import read_requests, run_offline
from metasd.core.execution.verifier import Verifier
from metasd.drafters import NGramDrafter
from tiny import tiny_qwen, tiny_tokenizer

DEFAULTS = dict(max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None, chat=False)


def test_lines_are_checked_before_anything_runs():
    for text, message in [("not json", "line 1: not JSON"), ("[1]", "expected a JSON object"),
                          ('{"prompt": "w7", "messages": []}', "exactly one of"),
                          ('{"prompt": "w7", "temprature": 1}', "unknown keys \\['temprature'\\]"),
                          ('{"prompt": 7}', "'prompt' must be a string")]:
        with pytest.raises(ValueError, match=message):
            read_requests([text], DEFAULTS)
    sampling = read_requests(['{"prompt": "w7", "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1}'], DEFAULTS)
    assert {k: sampling[0][1][k] for k in ("temperature", "top_p", "top_k", "min_p")} == dict(
        temperature=0.5, top_p=0.9, top_k=4, min_p=0.1)


def test_every_request_gets_a_line_with_its_result():
    tok = tiny_tokenizer()
    engine = Engine(Verifier(tiny_qwen(seed=0, logit_scale=4.0), tok), NGramDrafter(k=4, n_max=2), check_tokenizers=False)
    lines = ['{"prompt": "w7 w12 w9 w33 w12 w9", "id": "a"}', "",
             '{"messages": [{"role": "user", "content": "w8 w9"}], "max_tokens": 5, "temperature": 1.0, "seed": 3}',
             '{"prompt": "w20 w21", "max_tokens": 1000}',  # over the context: refused, recorded
             '{"prompt": "w10 w11 w10 w11", "max_tokens": 12, "speculate": false}']
    requests = read_requests(lines, DEFAULTS)
    out = io.StringIO()
    assert run_offline(engine, requests, out, max_batch=2, progress=False) == (3, 1)
    records = {r["line"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert sorted(records) == [1, 3, 4, 5]
    assert records[1]["id"] == "a" and records[3]["id"] == 3
    assert "context" in records[4]["error"]
    expected = {1: engine.generate("w7 w12 w9 w33 w12 w9", 8),
                3: engine.generate([{"role": "user", "content": "w8 w9"}], 5, temperature=1.0, seed=3),
                5: engine.generate("w10 w11 w10 w11", 12)}
    for line, result in expected.items():
        assert records[line]["token_ids"] == result.token_ids and records[line]["text"] == result.text
        assert records[line]["finish_reason"] == "length" and records[line]["stats"]["steps"] >= 1
    assert records[5]["stats"]["drafted"] == 0 and records[1]["stats"]["drafted"] > 0


def test_input_and_output_paths_are_named_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """A folder or a missing file as --input (once a traceback, or an error naming no flag) and an --output whose
    folder does not exist (once found only after the models loaded) are refused naming the flag, nothing loaded."""
    import metasd.config
    from metasd.cli import main

    def no_load(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(metasd.config, "build_engine", no_load)
    good, out = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    good.write_text('{"prompt": "w7"}\n')
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    for argv, message in (
            (["--input", str(tmp_path), "--output", out], f"--input {tmp_path}: Is a directory"),
            (["--input", str(tmp_path / "missing.jsonl"), "--output", out], "--input " + str(tmp_path / "missing.jsonl")),
            (["--input", str(tmp_path / "latin1.jsonl"), "--output", out], "--input " + str(tmp_path / "latin1.jsonl")),
            (["--input", str(good), "--output", "/nonexistent_dir/o.jsonl"], "--output /nonexistent_dir/o.jsonl"),
            (["--input", str(good), "--output", str(tmp_path)], f"--output {tmp_path}"),
            (["--input", str(good), "--output", out, "--max-batch", "0"], "--max-batch must be >= 1, got 0")):
        assert main(["generate", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_structured_output_per_line_and_from_the_command():
    """A line's ``guided_*`` field or ``response_format`` holds its answer; a line without one takes the command's
    (``--regex`` here); ``{"type": "text"}`` asks for none. Each answer is what ``Engine.generate`` gives with that
    constraint. A bad one names its line and field before anything runs."""
    import re

    pytest.importorskip("llguidance")
    from metasd.core.constraints import Constraint
    from serve_helpers import tiny_chain_engine
    from test_constraints import byte_bpe

    with pytest.raises(ValueError, match=r"line 1: guided_regex: does not compile"):
        read_requests(['{"prompt": "a", "guided_regex": "("}'], DEFAULTS)
    with pytest.raises(ValueError, match=r"line 1: guided_choice: only one structured output"):
        read_requests(['{"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]}'], DEFAULTS)
    tok = byte_bpe(340)
    engine = tiny_chain_engine(tok, "tiny", context=512)
    command = Constraint.regex("[a-z]{3,6}")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    lines = [json.dumps({"prompt": "Count: ", "guided_json": schema, "max_tokens": 40}),
             json.dumps({"prompt": "Pick: ", "guided_choice": ["red", "green", "blue"]}),
             json.dumps({"prompt": "Word: "}),
             json.dumps({"prompt": "Word: ", "response_format": {"type": "text"}, "max_tokens": 6})]
    requests = read_requests(lines, {**DEFAULTS, "max_new_tokens": 12, "constraint": command})
    out = io.StringIO()
    assert run_offline(engine, requests, out, max_batch=2, progress=False) == (4, 0)
    records = {r["line"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert isinstance(json.loads(records[1]["text"])["n"], int)
    assert records[2]["text"] in ("red", "green", "blue")
    assert re.fullmatch("[a-z]{3,6}", records[3]["text"])
    expected = {1: ("Count: ", 40, Constraint.json_schema(schema)), 2: ("Pick: ", 12, Constraint.choice(
        ["red", "green", "blue"])), 3: ("Word: ", 12, command), 4: ("Word: ", 6, None)}
    for line, (prompt, budget, constraint) in expected.items():
        assert records[line]["token_ids"] == engine.generate(prompt, budget, constraint=constraint).token_ids
