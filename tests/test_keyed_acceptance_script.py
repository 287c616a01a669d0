"""benchmarks/keyed_acceptance.py keeps what it measured: its JSON is written after every request pair, so a run
stopped part-way (as the first one was, at 7 of 12 pairs) leaves its rows and their summary."""
from __future__ import annotations

import json

import pytest

import metasd.data
from benchmark_scripts import load_script
from metasd.data import Question
from serve_helpers import tiny_engine


def test_a_run_cut_short_leaves_its_rows_and_their_summary(tmp_path, monkeypatch):
    script = load_script("keyed_acceptance")
    questions = [Question(str(i), "writing", [f"w{i} w{i + 1}"]) for i in range(3)]
    monkeypatch.setattr(metasd.data, "load_questions", lambda *a, **k: questions)
    engine = tiny_engine()
    calls = {"n": 0}
    generate = engine.generate

    def cut_after_two_pairs(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 4:  # two pairs (stream + keyed each), then the run is stopped
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", cut_after_two_pairs)
    monkeypatch.setattr(script, "build", lambda drafters: engine)
    out = tmp_path / "keyed.json"
    with pytest.raises(KeyboardInterrupt):
        script.main(["--pools", "chain", "--seeds", "1", "--max-new-tokens", "4", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["complete"] is False and [r["question"] for r in result["rows"]] == ["0", "1"]
    chain = result["summary"]["chain"]
    assert chain["stream"]["tokens_per_step"] > 0 and chain["keyed_over_stream_tokens_per_step"]["median"] > 0
